"""Mixtral: routed experts under ``block_sparse_moe`` (``w1``/``w3``/``w2``), no shared expert."""

from __future__ import annotations

from megastart.loader.mapping.archs.decoder import DENSE_DECODER_RULES, IGNORED
from megastart.loader.mapping.archs.moe import MOE_CONFIG_CHECKS, routed_expert_rules
from megastart.loader.mapping.archs.table import MappingTable

MIXTRAL_EXPERT_RULES = routed_expert_rules("block_sparse_moe", "w1", "w3", "w2")

MIXTRAL = MappingTable(
    ("MixtralForCausalLM",),
    (*DENSE_DECODER_RULES, *MIXTRAL_EXPERT_RULES),
    (*MOE_CONFIG_CHECKS, ("intermediate_size", "moe_ffn_hidden_size")),
    IGNORED,
    ("mixtral",),
)
