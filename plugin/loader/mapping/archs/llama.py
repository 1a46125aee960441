"""Llama and Mistral: the dense decoder as it is."""

from __future__ import annotations

from megastart.loader.mapping.archs.decoder import DENSE_CONFIG_CHECKS, DENSE_DECODER_RULES, IGNORED
from megastart.loader.mapping.archs.table import MappingTable

LLAMA = MappingTable(
    ("LlamaForCausalLM",), DENSE_DECODER_RULES, DENSE_CONFIG_CHECKS, IGNORED, ("llama",)
)
MISTRAL = MappingTable(
    ("MistralForCausalLM",), DENSE_DECODER_RULES, DENSE_CONFIG_CHECKS, IGNORED, ("mistral",)
)
