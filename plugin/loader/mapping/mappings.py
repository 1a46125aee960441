"""HF architecture <-> Megatron-core parameter names: one table per architecture, as data.

A :class:`Rule` says which HF tensors feed one Megatron parameter and with which
transform (see :mod:`megastart.loader.mapping.transforms`). Megatron names are
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
from functools import cache
from typing import Any

from megastart.loader.mapping.archs import BUILTIN_TABLES
from megastart.loader.mapping.archs.decoder import DENSE_CONFIG_CHECKS, DENSE_DECODER_RULES
from megastart.loader.mapping.archs.llama import LLAMA, MISTRAL
from megastart.loader.mapping.archs.mixtral import MIXTRAL
from megastart.loader.mapping.archs.qwen import QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE
from megastart.loader.mapping.archs.table import (
    VALUE_HEAD,
    VALUE_HEAD_SOURCES,
    VALUE_MODEL_UNCHECKED,
    MappingTable,
    Rule,
)

__all__ = [
    "BUILTIN_TABLES",
    "DENSE_CONFIG_CHECKS",
    "DENSE_DECODER_RULES",
    "LLAMA",
    "MAPPINGS_GROUP",
    "MISTRAL",
    "MIXTRAL",
    "QWEN2",
    "QWEN2_MOE",
    "QWEN3",
    "QWEN3_MOE",
    "VALUE_HEAD",
    "VALUE_HEAD_SOURCES",
    "VALUE_MODEL_UNCHECKED",
    "MappingTable",
    "Rule",
    "architecture_for_model_type",
    "known_architectures",
    "mapping_for",
]

log = logging.getLogger("megastart")

MAPPINGS_GROUP = "megastart.mappings"

_HEAD_ARCHITECTURES = ("ForSequenceClassification", "ForTokenClassification")
"""Architecture suffixes of reward-model checkpoints: the decoder of ``*ForCausalLM`` and a ``score`` head."""


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

    tables = {arch: table for table in BUILTIN_TABLES for arch in table.architectures}
    for ep in sorted(metadata.entry_points(group=MAPPINGS_GROUP), key=lambda e: e.name):
        table: Any = ep.load()
        if not isinstance(table, MappingTable):
            raise TypeError(
                f"entry point {ep.name!r} = {ep.value!r} in group {MAPPINGS_GROUP!r} must name a "
                f"megastart.loader.mapping.mappings.MappingTable, got {type(table).__name__}"
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
