"""The data of an architecture's mapping: :class:`Rule` s in a :class:`MappingTable`.

A :class:`Rule` says which HF tensors feed one Megatron parameter and with which
transform (see :mod:`megastart.loader.mapping.transforms`). Megatron names are
*canonical*: the layer index is the global layer (``layer_number - 1``), not
the index inside a pipeline chunk, so a rule never depends on the parallel
layout. Expert tensors fit the same scheme: an ``{expert}`` field in both
patterns, canonicalised to the global expert index (EP rank offset added), for
``local_experts.{expert}`` and grouped ``weight{expert}`` names alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

VALUE_HEAD = "output_layer."
"""Canonical name prefix of a value model's head: Megatron's ``output_layer`` with one output."""

VALUE_HEAD_SOURCES = ("lm_head.weight", "reward_head.weight", "score.weight")
"""HF tensors a value head's weight is read from: the first of the head's own shape
(``[1, hidden]``) wins, in the order verl's loader tries them
(``verl.models.mcore.loader.load_state_dict_to_megatron_gptmodel``). A one-row
``lm_head.weight`` is a value head saved under the LM head's name (verl's legacy
loader and mbridge take it too); a vocabulary ``lm_head.weight`` never has that shape, so it never fills a value head."""

VALUE_MODEL_UNCHECKED = ("tie_word_embeddings",)
"""HF config keys a value model need not agree on: its head is never tied to the embedding."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One Megatron parameter and the HF tensors it is made from."""

    megatron: tuple[str, ...]
    """Canonical Megatron names (patterns with ``{layer}``/``{expert}``), one per layer-spec spelling."""

    hf: tuple[str, ...]
    """HF tensor names, in the order the transform takes them."""

    transform: str
    """A name in :data:`megastart.loader.mapping.transforms.TRANSFORMS`."""

    hf_if_tied: tuple[str, ...] = ()
    """The HF tensors to use instead when the HF config ties word embeddings."""


@dataclass(frozen=True, slots=True)
class MappingTable:
    """How one HF architecture's tensors become Megatron-core parameters."""

    architectures: tuple[str, ...]
    """The ``config.json`` ``architectures`` values this table serves."""

    rules: tuple[Rule, ...]

    config_checks: tuple[tuple[str, str], ...] = ()
    """``(HF config key, Megatron TransformerConfig attribute)`` pairs that must agree."""

    ignored: tuple[str, ...] = ()
    """Regexes of HF tensors that are expected in checkpoints but feed no parameter."""

    model_types: tuple[str, ...] = ()
    """``config.json`` ``model_type`` values whose causal LM is this table's architecture:
    used for configs without ``architectures`` when ``transformers`` is not installed."""
    value_head_sources: tuple[str, ...] = VALUE_HEAD_SOURCES
    """HF tensors a value model's head may come from, in order of preference."""
    extra_layers_key: str = ""
    """The ``config.json`` key counting layers stored after the decoder's
    (``model.layers.{num_hidden_layers}`` on: DeepSeek-V3's multi-token prediction), which
    a model without them leaves unread; ``""``: none."""

    _compiled: list[tuple[re.Pattern[str], Rule]] = field(
        default_factory=list, compare=False, repr=False
    )

    def match(self, name: str) -> tuple[Rule, dict[str, str]] | None:
        """The rule for canonical Megatron parameter ``name`` and its fields (``layer``...)."""
        if not self._compiled:
            self._compiled.extend((_pattern(m), rule) for rule in self.rules for m in rule.megatron)
        for pattern, rule in self._compiled:
            found = pattern.fullmatch(name)
            if found:
                return rule, found.groupdict()
        return None

    def resolve(self, name: str, config: dict[str, Any]) -> tuple[Rule, dict[str, str]] | None:
        """:meth:`match` for a parameter of this rank, with ``config.json``: a
        multi-token-prediction layer ``mtp.layers.{i}`` is checkpoint layer
        ``num_hidden_layers + i``, its ``transformer_layer`` a decoder layer of that number."""
        found = _MTP_LAYER.fullmatch(name) if self.extra_layers_key else None
        if found is None:
            return self.match(name)
        layer = int(config.get("num_hidden_layers", 0)) + int(found[1])
        rest = found[2]
        inner = rest.removeprefix("transformer_layer.")
        return self.match(
            f"decoder.layers.{layer}.{inner}" if inner != rest else f"mtp.layers.{layer}.{rest}"
        )

    def leaves(self, name: str) -> bool:
        """Whether the load leaves canonical parameter ``name`` as the host initialised it
        (none here; a bridge's table leaves what the bridge leaves)."""
        return False

    def hf_names(self, rule: Rule, fields: dict[str, str], *, tied: bool) -> tuple[str, ...]:
        names = rule.hf_if_tied if tied and rule.hf_if_tied else rule.hf
        return tuple(n.format(**fields) for n in names)

    def is_ignored(self, hf_name: str, config: dict[str, Any] | None = None) -> bool:
        """Whether ``hf_name`` is expected in checkpoints yet feeds no parameter: an ``ignored``
        tensor, or one of the extra layers when ``config`` is given (and no parameter took it)."""
        if any(re.fullmatch(p, hf_name) for p in self.ignored):
            return True
        if not (self.extra_layers_key and config and config.get(self.extra_layers_key)):
            return False
        found = _HF_LAYER.match(hf_name)
        return found is not None and int(found[1]) >= int(config.get("num_hidden_layers", 0))


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.*)")


def _pattern(template: str) -> re.Pattern[str]:
    escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)")
    return re.compile(escaped.replace(r"\{expert\}", r"(?P<expert>\d+)"))
