"""HF architecture <-> Megatron-core parameter names: one table per architecture, as data.

A :class:`Rule` says which HF tensors feed one Megatron parameter and with which
transform (see :mod:`megastart.loader.transforms`). Megatron names are
*canonical*: the layer index is the global layer (``layer_number - 1``), not
the index inside a pipeline chunk, so a rule never depends on the parallel
layout. Expert tensors fit the same scheme: an ``{expert}`` field in both
patterns, canonicalised to the global expert index (EP rank offset added), for
``local_experts.{expert}`` and grouped ``weight{expert}`` names alike.

Each Megatron pattern lists every spelling a layer spec uses (local spec
``input_layernorm.weight``, Transformer-Engine spec
``linear_qkv.layer_norm_weight``); a table matches whichever the model has.

More tables are registered through the entry-point group ``megastart.mappings``
(each entry point's value is a :class:`MappingTable`); a registered table
replaces a built-in one for the same architecture.

A value model (critic, reward model) is the same decoder with a one-output head
in place of the LM head: Megatron's ``output_layer``, filled from the
checkpoint's reward head (:data:`VALUE_HEAD_SOURCES`) or left to the host. A
reward model's checkpoint (``*ForSequenceClassification``,
``*ForTokenClassification``) is served by its ``*ForCausalLM`` table.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

log = logging.getLogger("megastart")

MAPPINGS_GROUP = "megastart.mappings"

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

_HEAD_ARCHITECTURES = ("ForSequenceClassification", "ForTokenClassification")
"""Architecture suffixes of reward-model checkpoints: the decoder of ``*ForCausalLM`` and a ``score`` head."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One Megatron parameter and the HF tensors it is made from."""

    megatron: tuple[str, ...]
    """Canonical Megatron names (patterns with ``{layer}``/``{expert}``), one per layer-spec spelling."""

    hf: tuple[str, ...]
    """HF tensor names, in the order the transform takes them."""

    transform: str
    """A name in :data:`megastart.loader.transforms.TRANSFORMS`."""

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

    def hf_names(self, rule: Rule, fields: dict[str, str], *, tied: bool) -> tuple[str, ...]:
        names = rule.hf_if_tied if tied and rule.hf_if_tied else rule.hf
        return tuple(n.format(**fields) for n in names)

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignored)


def _pattern(template: str) -> re.Pattern[str]:
    escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)")
    return re.compile(escaped.replace(r"\{expert\}", r"(?P<expert>\d+)"))


_LAYER = "decoder.layers.{layer}."
_HF_LAYER = "model.layers.{layer}."

DENSE_DECODER_RULES = (
    Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), "vocab"),
    Rule(
        ("output_layer.weight",),
        ("lm_head.weight",),
        "vocab",
        hf_if_tied=("model.embed_tokens.weight",),
    ),
    Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), "replicated"),
    Rule(
        (_LAYER + "input_layernorm.weight", _LAYER + "self_attention.linear_qkv.layer_norm_weight"),
        (_HF_LAYER + "input_layernorm.weight",),
        "replicated",
    ),
    Rule(
        (_LAYER + "self_attention.linear_qkv.weight",),
        tuple(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv",
    ),
    Rule(
        (_LAYER + "self_attention.linear_proj.weight",),
        (_HF_LAYER + "self_attn.o_proj.weight",),
        "row_parallel",
    ),
    Rule(
        (_LAYER + "pre_mlp_layernorm.weight", _LAYER + "mlp.linear_fc1.layer_norm_weight"),
        (_HF_LAYER + "post_attention_layernorm.weight",),
        "replicated",
    ),
    Rule(
        (_LAYER + "mlp.linear_fc1.weight",),
        (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"),
        "gate_up",
    ),
    Rule(
        (_LAYER + "mlp.linear_fc2.weight",), (_HF_LAYER + "mlp.down_proj.weight",), "row_parallel"
    ),
)

QKV_BIAS_RULES = (
    Rule(
        (_LAYER + "self_attention.linear_qkv.bias",),
        tuple(_HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
        "qkv",
    ),
)

QK_NORM_RULES = (
    Rule(
        (_LAYER + "self_attention.q_layernorm.weight",),
        (_HF_LAYER + "self_attn.q_norm.weight",),
        "replicated",
    ),
    Rule(
        (_LAYER + "self_attention.k_layernorm.weight",),
        (_HF_LAYER + "self_attn.k_norm.weight",),
        "replicated",
    ),
)

DENSE_CONFIG_CHECKS = (
    ("hidden_size", "hidden_size"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_query_groups"),
    ("intermediate_size", "ffn_hidden_size"),
    ("head_dim", "kv_channels"),
    ("tie_word_embeddings", "share_embeddings_and_output_weights"),
)

_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

LLAMA = MappingTable(
    ("LlamaForCausalLM",), DENSE_DECODER_RULES, DENSE_CONFIG_CHECKS, _IGNORED, ("llama",)
)
MISTRAL = MappingTable(
    ("MistralForCausalLM",), DENSE_DECODER_RULES, DENSE_CONFIG_CHECKS, _IGNORED, ("mistral",)
)
QWEN2 = MappingTable(
    ("Qwen2ForCausalLM",),
    DENSE_DECODER_RULES + QKV_BIAS_RULES,
    DENSE_CONFIG_CHECKS,
    _IGNORED,
    ("qwen2",),
)
QWEN3 = MappingTable(
    ("Qwen3ForCausalLM",),
    DENSE_DECODER_RULES + QK_NORM_RULES,
    DENSE_CONFIG_CHECKS,
    _IGNORED,
    ("qwen3",),
)

BUILTIN_TABLES = (LLAMA, MISTRAL, QWEN2, QWEN3)


def mapping_for(architecture: str) -> MappingTable | None:
    """The table for ``architecture`` (registered ones first), or ``None``.

    A reward model's architecture without a table of its own gets its causal LM's table.
    """
    tables = _registry()
    if architecture in tables:
        return tables[architecture]
    for suffix in _HEAD_ARCHITECTURES:
        if architecture.endswith(suffix):
            return tables.get(architecture.removesuffix(suffix) + "ForCausalLM")
    return None


def architecture_for_model_type(model_type: str) -> str | None:
    """The architecture of the table that declares ``model_type`` (``None``: none does)."""
    return next(
        (
            table.architectures[0]
            for table in _registry().values()
            if model_type in table.model_types
        ),
        None,
    )


def known_architectures() -> list[str]:
    return sorted(_registry())


@cache
def _registry() -> dict[str, MappingTable]:
    from importlib import metadata

    from megastart.loader.mappings_moe import MOE_TABLES

    builtin = BUILTIN_TABLES + MOE_TABLES
    tables = {arch: table for table in builtin for arch in table.architectures}
    for ep in sorted(metadata.entry_points(group=MAPPINGS_GROUP), key=lambda e: e.name):
        table: Any = ep.load()
        if not isinstance(table, MappingTable):
            raise TypeError(
                f"entry point {ep.name!r} = {ep.value!r} in group {MAPPINGS_GROUP!r} must name a "
                f"megastart.loader.mappings.MappingTable, got {type(table).__name__}"
            )
        for arch in table.architectures:
            if arch in tables:
                log.info(
                    "megastart: mapping %r from entry point %r replaces the built-in one",
                    arch,
                    ep.name,
                )
            tables[arch] = table
    return tables
