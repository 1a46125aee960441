"""Megatron-Bridge's per-weight hooks (``maybe_modify_loaded_hf_weight``), as data.

A bridge may change each HF tensor between reading it and its mapping's ``hf_to_megatron``:
dequantise it, swap or transpose parts of it, read it under an older name, or make one the
checkpoint does not hold (Gemma 4's zero K/V on layers that share another's, its V as a
copy of K on layers whose keys are their values). megastart reads no bridge code at run
time: it recognises the class that defines the hook (by module and name, through the
bridge's MRO) and applies what :data:`HOOKS` says that hook does, to each rank's slice:

* ``dequantises``: the quantised forms the hook turns into the parameter's values exactly as
  megastart's own dequantisation does (:mod:`~megastart.loader.mapping.dequantise`,
  :mod:`~megastart.loader.mapping.unpack`); any other quantisation is not reproduced;
* ``suffix``, ``wrapper``: HF tensors ending in ``suffix`` take the transform ``wrapper``
  around their mapping's own (:data:`~megastart.loader.mapping.transforms.TRANSFORMS`);
* ``derives_kv``: a ``QKVMapping`` whose V (or K and V) the checkpoint lacks is planned from
  the tensors it has: V from K's rows (read once, placed twice), or zero K and V;
* ``legacy``: ``(new, old)`` name parts: a tensor the checkpoint lacks is read under the
  name with ``new`` replaced by ``old``, where that one exists.

A hook not in :data:`HOOKS`, and a subclass from outside Megatron-Bridge of a registered bridge
that overrides more than its registry and its hook (it may change the load anywhere), leave
the whole model to the bridge, said so by name (:func:`recognise`, :func:`check_class`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megastart.errors import PlanError
from megastart.loader.checkpoint.quantised import INT4, MXFP4, PACKED_SUFFIXES
from megastart.loader.mapping import interleave

FP8_BLOCKS = "fp8 blocks"
"""DeepSeek-V3's FP8 with a float32 ``weight_scale_inv`` per 128x128 block."""

_BRIDGE = "megatron.bridge.models."
_MEGATRON_BRIDGE = "megatron.bridge."


class Untranslatable(PlanError):
    """The bridge's mappings are not all ones megastart reproduces: the bridge loads."""


@dataclass(frozen=True, slots=True)
class Hook:
    """What one bridge class's ``maybe_modify_loaded_hf_weight`` does, and why it is so."""

    why: str
    dequantises: frozenset[str] = frozenset()
    suffix: str = ""
    wrapper: str = ""
    derives_kv: bool = False
    legacy: tuple[str, str] | None = None
    may_lack: tuple[str, ...] = ()
    """HF name suffixes some layers of its checkpoints lack, whose parameters the bridge then
    leaves as initialised (its load skips a mapping whose tensor is absent): megastart leaves
    them too, and still refuses any other absent tensor."""

    def leaves(self, hf: Any, stored: Callable[[str], str | None]) -> bool:
        """Whether the parameter mapped from ``hf`` is one the bridge leaves (:attr:`may_lack`)."""
        lacking = bool(self.may_lack) and isinstance(hf, str) and hf.endswith(self.may_lack)
        return lacking and stored(hf) is None


_AS_LOADED = "returns each weight as loaded"

HOOKS: dict[str, Hook] = {
    f"{_BRIDGE}conversion.model_bridge.MegatronModelBridge": Hook(_AS_LOADED),
    f"{_BRIDGE}deepseek.deepseek_v3_bridge.DeepSeekV3Bridge": Hook(
        "dequantises FP8 weights by their 128x128 *_scale_inv blocks, as megastart does",
        frozenset({FP8_BLOCKS}),
    ),
    f"{_BRIDGE}minimax_m2.minimax_m2_bridge.MiniMaxM2Bridge": Hook(
        "the same helper (quantization_utils.maybe_dequantize_fp8_blockwise), 128x128 blocks",
        frozenset({FP8_BLOCKS}),
    ),
    f"{_BRIDGE}mimo_v2_flash.mimo_v2_flash_bridge.MiMoV2FlashBridge": Hook(
        "returns a float weight as loaded; an FP8 one times its *_scale_inv block, in float32, "
        "rounded once to bfloat16 (megastart's arithmetic into a bfloat16 model)",
        frozenset({FP8_BLOCKS}),
    ),
    f"{_BRIDGE}ministral3.ministral3_bridge.Ministral3Bridge": Hook(
        "returns a float weight as loaded (it multiplies an FP8 one by a scalar "
        "weight_scale_inv, which megastart does not reproduce)"
    ),
    f"{_BRIDGE}kimi_vl.kimi_k25_vl_bridge.KimiK25VLBridge": Hook(
        "returns each weight as loaded, an INT4 one dequantised (dequantize_int4)",
        frozenset({INT4}),
    ),
    f"{_BRIDGE}gpt_oss.gpt_oss_bridge.GPTOSSBridge": Hook(
        "dequantises MXFP4 X_blocks (dequantize_mxfp4); transposes bf16 experts' down_proj to "
        "[E, H, I], which the down transform does by shape (an MXFP4 one it leaves)",
        frozenset({MXFP4}),
        ".mlp.experts.down_proj",
        "oriented",
    ),
    f"{_BRIDGE}mimo.mimo_bridge.MimoBridge": Hook(
        "swaps the column halves of MTP's input_proj.weight, returns the rest as loaded",
        suffix=".input_proj.weight",
        wrapper="swapped_halves",
    ),
    f"{_BRIDGE}gemma.gemma4_bridge.Gemma4Bridge": Hook(
        "makes V a copy of K where v_proj is absent, zero K and V where both are (layers "
        "sharing another's KV, which lack k_norm too: the bridge leaves it)",
        derives_kv=True,
        may_lack=(".self_attn.k_norm.weight",),
    ),
    f"{_BRIDGE}deepseek.deepseek_v4_bridge.DeepSeekV4Bridge": Hook(
        "returns a float weight as loaded, the CSA indexer's under its legacy name where the "
        "native one is absent (its FP8 and MXFP4 *.scale formats megastart does not reproduce)",
        legacy=(".indexer.scorer.weights_proj.", ".indexer.weights_proj."),
    ),
}
"""Per class defining ``maybe_modify_loaded_hf_weight`` (module and name): what it does."""


def hook_owner(bridge: Any) -> str:
    """The module and name of the class in ``bridge``'s MRO that defines its hook."""
    owner = next(c for c in type(bridge).__mro__ if "maybe_modify_loaded_hf_weight" in vars(c))
    return f"{owner.__module__}.{owner.__qualname__}"


def hook_of(bridge: Any) -> Hook:
    """The :class:`Hook` of ``bridge`` (recognised: see :func:`recognise`)."""
    return HOOKS[hook_owner(bridge)]


def recognise(bridge: Any) -> Hook:
    """``bridge``'s hook as data; raises :class:`Untranslatable` for a hook megastart does not
    reproduce."""
    owner = hook_owner(bridge)
    if owner not in HOOKS:
        hook = type(bridge).maybe_modify_loaded_hf_weight
        raise Untranslatable(
            f"Megatron-Bridge's {type(bridge).__name__} changes each loaded weight "
            f"({hook.__qualname__}, from {owner}), which megastart does not reproduce"
        )
    return HOOKS[owner]


def check_class(bridge: Any) -> None:
    """Raise :class:`Untranslatable` for a subclass, from outside Megatron-Bridge, of one of its
    bridges that overrides more than megastart reads as data (:data:`READ_AS_DATA`: its
    registry and its hook, which :func:`recognise` judges): it changes the load where megastart
    cannot see, and is never guessed. A bridge of one's own made directly on
    ``MegatronModelBridge`` is read by its registry and hook like any other."""
    kind = type(bridge)
    if kind.__module__.startswith(_MEGATRON_BRIDGE):
        return
    mro = [b.__name__ for b in kind.__mro__]
    below = kind.__mro__[: mro.index(_BASE)] if _BASE in mro else kind.__mro__
    own = [b for b in below if not b.__module__.startswith(_MEGATRON_BRIDGE)]
    if len(own) == len(below):  # nothing of Megatron-Bridge's own between it and the base
        return
    changed = sorted(
        name
        for b in own
        for name, value in vars(b).items()
        if callable(value) and not name.startswith("__") and name not in READ_AS_DATA
    )
    if changed:
        known = next(b for b in below if b.__module__.startswith(_MEGATRON_BRIDGE))
        raise Untranslatable(
            f"Megatron-Bridge's {kind.__name__} ({kind.__module__}.{kind.__qualname__}) is a "
            f"subclass of {known.__name__} that megastart does not recognise: it changes "
            f"{', '.join(changed)}"
        )


READ_AS_DATA = {"mapping_registry", "maybe_modify_loaded_hf_weight"}
"""What a bridge's subclass may override and still be served: megastart reads its registry
at run time and judges its hook by the class that defines it (:data:`HOOKS`)."""

_BASE = "MegatronModelBridge"
"""The base a bridge of one's own may start from (itself on Megatron-Bridge's PEFT base)."""


def dequantises_form(bridge: Any, form: str) -> bool:
    """Whether ``bridge``'s hook dequantises ``form`` as megastart does."""
    return form in HOOKS.get(hook_owner(bridge), Hook("")).dequantises


def wrapped(hook: Hook, hf: Any, transform: str, stored: Callable[[str], str | None]) -> str:
    """``transform`` as the hook changes an HF tensor ending in its ``suffix``: ``oriented``
    turns a bf16 expert row-parallel weight by its shape (an MXFP4 one, which the hook leaves
    as dequantised, stays as it is); any other wrapper goes around the mapping's transform."""
    if not hook.wrapper or not isinstance(hf, str) or not hf.endswith(hook.suffix):
        return transform
    if hook.wrapper == "oriented":
        if stored(hf + PACKED_SUFFIXES[MXFP4][0]) is not None:  # MXFP4 (X_blocks)
            return transform
        return transform.replace("expert_row_parallel", "expert_oriented_row_parallel")
    return f"{hook.wrapper}:{transform}"


def legacy_names(
    hook: Hook, names: tuple[str, ...], stored: Callable[[str], str | None]
) -> tuple[str, ...]:
    """``names``, each the checkpoint lacks read under the hook's legacy name where that one
    is stored (DeepSeek-V4's CSA indexer)."""
    if hook.legacy is None:
        return names
    new, old = hook.legacy
    return tuple(
        n.replace(new, old)
        if new in n and stored(n) is None and stored(n.replace(new, old)) is not None
        else n
        for n in names
    )


def derived_qkv(
    hook: Hook, config: Any, names: tuple[str, ...], stored: Callable[[str], str | None]
) -> tuple[tuple[str, ...], str] | None:
    """A ``QKVMapping``'s HF tensors and transform where the hook derives V (or K and V): per
    query group its query heads, then K's rows, then K's rows again as V (one read of K), or
    zero K and V rows; ``None`` where the checkpoint holds all three, or the hook derives none.
    The dims are the attention module's own config (Gemma 4's global layers have theirs)."""
    q, k, v = names
    if not hook.derives_kv or stored(v) is not None or stored(q) is None:
        return None
    heads, groups = (
        config.num_attention_heads,
        config.num_query_groups or config.num_attention_heads,
    )
    d = config.kv_channels
    per = heads // groups
    query = interleave.Component(0, per * d, 0, per * d)
    if stored(k) is None:  # zero K and V: only Q is read
        zero = interleave.Component(interleave.ZERO, 0, 0, d)
        return (q,), interleave.spec(groups, True, [query, zero, zero])
    key = interleave.Component(1, d, 0, d)
    return (q, k), interleave.spec(groups, True, [query, key, key])
