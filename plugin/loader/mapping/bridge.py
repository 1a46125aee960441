"""Mapping knowledge from the host's Megatron-Bridge bridge (verl 0.9's default loader, NeMo-RL's).

Each Megatron-Bridge bridge declares, in ``mapping_registry()``, a mapping object
per Megatron parameter pattern. Where megastart replaces the bridge's
``load_hf_weights``, :func:`bridge_table` turns that registry into a
:class:`BridgeTable` for this rank's model: each parameter the bridge would
load gets the HF tensors its mapping names and the megastart transform that
does what the mapping's ``hf_to_megatron`` does, so the one reader streams each
rank only what it takes, as with the built-in tables.

A multimodal model's towers (vision, audio) are parameters like the decoder's:
mostly ``ReplicatedMapping`` over ``prefix.**`` (read whole by each rank), a
TP-sharded ViT's ``ConcatenatedQKVMapping`` (three row ranges per group). All or
nothing: a mapping class not in :data:`TRANSLATED` (subclasses included), a module whose
parallelism ``AutoMapping`` cannot tell, a bridge whose ``maybe_modify_loaded_hf_weight``
megastart does not recognise, or a subclass of a bridge from outside Megatron-Bridge
(:mod:`~megastart.loader.mapping.hooks`) leaves the whole load to the bridge
(:class:`Untranslatable`, decided on every rank together). What the bridge
leaves alone, megastart leaves too: adapter parameters (LoRA) and parameters no
mapping names (:meth:`BridgeTable.leaves`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megastart.loader.checkpoint.quantised import Quantisation
from megastart.loader.mapping.archs.table import MappingTable, Rule
from megastart.loader.mapping.bridge_classes import (
    BRIDGE_CLASSES,
    expert_number,
    own_class,
    picked_row,
)
from megastart.loader.mapping.bridge_layouts import CONFIGURED, configured, gated_qkv, zero_centred
from megastart.loader.mapping.hooks import (
    Untranslatable,
    check_class,
    dequantises_form,
    derived_qkv,
    hook_of,
    legacy_names,
    recognise,
    wrapped,
)
from megastart.loader.mapping.permuted import permuted_name

TRANSLATED = {
    "AutoMapping": "",  # the parallelism of the module: column, row or replicated
    "ColumnParallelMapping": "column_parallel",
    "RowParallelMapping": "row_parallel",
    "ReplicatedMapping": "replicated",
    "DirectMapping": "replicated",
    "QKVMapping": "qkv",
    "GatedMLPMapping": "gate_up",
    "FusedExpertMapping": "",  # one expert of an [E, ...] tensor, then its module's parallelism
    "FusedGatedExpertMapping": "fused_gated_expert",  # one expert's gate/up of an [E, ...] tensor
    "RMSNorm2ZeroCenteredRMSNormMapping": "",  # its module's parallelism, minus one
    **dict.fromkeys(CONFIGURED, "interleave"),  # layouts from the config (bridge_layouts)
}
"""Megatron-Bridge's standard mapping classes (by exact class) and the transforms that
reproduce them; ``AutoMapping`` takes its module's."""

_BY_PARALLELISM = {"column": "column_parallel", "row": "row_parallel", "replicated": "replicated"}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Column-parallel parameters whose rows Megatron-Bridge pads to the padded vocabulary."""
_EXPERT = {"gate_up": "expert_gate_up", "row_parallel": "expert_row_parallel"}
"""Transforms of routed experts, split over expert tensor parallelism instead."""


def dequantises(quantisation: Quantisation, bridge: Any) -> bool:
    """Whether megastart dequantises this quantised checkpoint on this load: FP8 block-scaled
    always; a packed one where the host's bridge's hook dequantises it (:data:`~megastart.loader.mapping.hooks.HOOKS`)."""
    if quantisation.weight_block is not None:
        return True
    if not quantisation.packing or bridge is None:
        return False
    return dequantises_form(model_bridge(bridge), quantisation.packing)


@dataclass(frozen=True, slots=True)
class BridgeTable(MappingTable):
    """The mapping of one rank's parameters, from a bridge's registry (canonical names)."""

    by_name: dict[str, Rule] = field(default_factory=dict, compare=False)
    left: frozenset[str] = frozenset()
    """Parameters the bridge leaves alone (adapters, unmapped, a tied output layer)."""

    def match(self, name: str) -> tuple[Rule, dict[str, str]] | None:
        rule = self.by_name.get(name)
        return None if rule is None else (rule, {})

    def leaves(self, name: str) -> bool:
        return name in self.left


def model_bridge(bridge: Any) -> Any:
    """The ``MegatronModelBridge`` of an ``AutoBridge`` (or the bridge itself), holding the
    checkpoint it loads as the bridge's own load gives it one (``build_conversion_tasks``):
    from 0.6 a registry picks fused or per-expert expert mappings from the checkpoint's keys
    (``moe_experts_stored_packed``), and some read its config (GLM-4.5, gpt-oss)."""
    if not hasattr(bridge, "_model_bridge"):
        return bridge
    inner = bridge._model_bridge  # a new one on every access
    pretrained = getattr(bridge, "hf_pretrained", None)
    if pretrained is not None:
        inner.hf_pretrained = pretrained
        inner.hf_config = getattr(pretrained, "config", pretrained)
    return inner


def bridge_table(
    bridge: Any,
    params: list[tuple[str, Any, bool]],
    architectures: tuple[str, ...],
    *,
    tied: bool,
    stored: Callable[[str], str | None] = lambda name: None,
) -> BridgeTable:
    """The table for this rank's ``params`` (canonical name, owning module, whether a buffer),
    from the bridge's registry; raises :class:`Untranslatable` for anything it does not
    reproduce. A buffer no mapping names is model state the load does not touch; with
    ``tied`` embeddings the bridge leaves the output layer to the embedding. ``stored``: an
    HF tensor's dtype in the checkpoint (where a mapping computes in it)."""
    bridge = model_bridge(bridge)
    hook = recognise(bridge)
    registry = bridge.mapping_registry()
    for mapping in registry.get_all_mappings():
        _check_class(bridge, mapping)
    check_class(bridge)
    by_name: dict[str, Rule] = {}
    left: set[str] = set()
    is_adapter = getattr(bridge, "_is_adapter_param_name", lambda name: False)
    unwrap_lora = getattr(bridge, "_get_lora_unwrapped_name", lambda name: name)
    for canonical, module, buffer in params:
        if is_adapter(canonical) or (
            tied and _language_part(canonical).startswith("output_layer.")
        ):
            left.add(canonical)
            continue
        mapping = registry.megatron_to_hf_lookup(unwrap_lora(canonical))
        if mapping is not None and hook.leaves(mapping.hf_param, stored):
            left.add(canonical)
        elif mapping is not None:
            by_name[canonical] = _rule(bridge, mapping, canonical, module, stored)
        elif not buffer:  # a buffer no mapping names is state the load does not touch
            left.add(canonical)
    return BridgeTable(architectures, (), by_name=by_name, left=frozenset(left))


def _check_class(bridge: Any, mapping: Any) -> None:
    kind = type(mapping).__name__
    if f"{type(mapping).__module__}.{kind}" in BRIDGE_CLASSES:
        return
    if kind not in TRANSLATED or type(mapping).__module__ != _STANDARD_MODULE:
        raise Untranslatable(
            f"Megatron-Bridge's {type(bridge).__name__} maps {mapping.megatron_param!r} with "
            f"{kind}, which megastart does not translate"
        )


_STANDARD_MODULE = "megatron.bridge.models.conversion.param_mapping"


def _rule(
    bridge: Any, mapping: Any, canonical: str, module: Any, stored: Callable[[str], str | None]
) -> Rule:
    kind = type(mapping).__name__
    own = own_class(mapping)
    row = picked_row(mapping, canonical)  # the dim-0 index it takes first, or None
    if own not in TRANSLATED:  # a bridge's own class with a transform of its own
        if row is not None:
            own = f"fused_expert:{row}:{own}"
        return Rule((canonical,), (mapping.hf_param,), own)
    kind = own  # a standard class, or one doing a standard class's work on one expert's slice
    hf = mapping.hf_param
    names = (hf,) if isinstance(hf, str) else tuple(hf[k] for k in _INPUTS[kind])
    names = legacy_names(hook_of(bridge), names, stored)
    transform = TRANSLATED[kind]
    if kind in CONFIGURED:
        layout = configured(kind, mapping, module)
        if layout is None:
            raise Untranslatable(
                f"Megatron-Bridge's {type(bridge).__name__} maps {canonical!r} with {kind} under "
                "a config megastart does not translate (an output gate)"
            )
        return Rule((canonical,), names, layout)
    if kind == "QKVMapping":
        derived = derived_qkv(hook_of(bridge), mapping._get_config(module), names, stored)
        if derived is not None:  # V (or K and V) made from what the checkpoint holds
            return Rule((canonical,), *derived)
        transform = gated_qkv(mapping, module) or transform
    if TRANSLATED[kind] == "":  # AutoMapping and its subclasses: the module's parallelism
        try:
            transform = _BY_PARALLELISM[mapping._detect_parallelism_type(module)]
        except ValueError as e:
            raise Untranslatable(
                f"Megatron-Bridge's {type(bridge).__name__}: {e}".splitlines()[0]
            ) from None
    if kind == "FusedGatedExpertMapping":
        return Rule((canonical,), names, f"{transform}:{expert_number(canonical)}")
    if transform == "column_parallel" and _language_part(canonical) in _VOCAB:
        transform = "vocab"
    if mapping.is_expert:
        transform = _EXPERT.get(transform, transform)
        if transform not in _EXPERT.values() and transform != "replicated":
            raise Untranslatable(
                f"Megatron-Bridge's {type(bridge).__name__} maps the expert parameter "
                f"{canonical!r} with {kind} ({transform}), which megastart does not translate"
            )
    if getattr(mapping, "permute_dims", None) is not None:  # turned before it is cut
        transform = permuted_name(mapping.permute_dims, transform)
    if row is not None:
        transform = f"fused_expert:{row}:{transform}"
    transform = wrapped(hook_of(bridge), hf, transform, stored)
    if kind == "RMSNorm2ZeroCenteredRMSNormMapping":
        centred = zero_centred(transform, stored(names[0]))
        if centred is None:
            raise Untranslatable(
                f"Megatron-Bridge's {type(bridge).__name__} subtracts one from {names[0]!r}, "
                "which the checkpoint holds in no plain dtype"
            )
        transform = centred
    return Rule((canonical,), names, transform)


def _language_part(canonical: str) -> str:
    """``canonical`` without the prefix a multimodal model puts before its language model."""
    for prefix in _LANGUAGE_MODELS:
        if canonical.startswith(prefix):
            return canonical.removeprefix(prefix)
    return canonical


_LANGUAGE_MODELS = ("thinker.language_model.", "language_model.", "llava_model.language_model.")
"""Where multimodal models built by Megatron-Bridge hold their language model."""


_INPUTS = {"QKVMapping": ("q", "k", "v"), "GatedMLPMapping": ("gate", "up"), **CONFIGURED}
"""The order in which a fused mapping's HF tensors are the transform's inputs."""
