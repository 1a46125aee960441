"""Qwen2 (QKV biases), Qwen3 (Q/K norms), and their MoE models (Qwen2-MoE with a gated shared expert)."""

from __future__ import annotations

from megastart.loader.mapping.archs.decoder import (
    DENSE_CONFIG_CHECKS,
    DENSE_DECODER_RULES,
    HF_LAYER,
    IGNORED,
    LAYER,
    QK_NORM_RULES,
    QKV_BIAS_RULES,
)
from megastart.loader.mapping.archs.moe import MOE_CONFIG_CHECKS, routed_expert_rules
from megastart.loader.mapping.archs.table import MappingTable, Rule

QWEN2 = MappingTable(
    ("Qwen2ForCausalLM",),
    DENSE_DECODER_RULES + QKV_BIAS_RULES,
    DENSE_CONFIG_CHECKS,
    IGNORED,
    ("qwen2",),
)
QWEN3 = MappingTable(
    ("Qwen3ForCausalLM",),
    DENSE_DECODER_RULES + QK_NORM_RULES,
    DENSE_CONFIG_CHECKS,
    IGNORED,
    ("qwen3",),
)

QWEN_EXPERT_RULES = routed_expert_rules("mlp", "gate_proj", "up_proj", "down_proj")

SHARED_EXPERT_RULES = (
    Rule(
        (LAYER + "mlp.shared_experts.linear_fc1.weight",),
        (
            HF_LAYER + "mlp.shared_expert.gate_proj.weight",
            HF_LAYER + "mlp.shared_expert.up_proj.weight",
        ),
        "gate_up",
    ),
    Rule(
        (LAYER + "mlp.shared_experts.linear_fc2.weight",),
        (HF_LAYER + "mlp.shared_expert.down_proj.weight",),
        "row_parallel",
    ),
    Rule(
        (LAYER + "mlp.shared_experts.gate_weight",),
        (HF_LAYER + "mlp.shared_expert_gate.weight",),
        "replicated",
    ),
)

QWEN3_MOE = MappingTable(
    ("Qwen3MoeForCausalLM",),
    (*DENSE_DECODER_RULES, *QK_NORM_RULES, *QWEN_EXPERT_RULES),
    (*MOE_CONFIG_CHECKS, ("moe_intermediate_size", "moe_ffn_hidden_size")),
    IGNORED,
    ("qwen3_moe",),
)
QWEN2_MOE = MappingTable(
    ("Qwen2MoeForCausalLM",),
    (*DENSE_DECODER_RULES, *QKV_BIAS_RULES, *QWEN_EXPERT_RULES, *SHARED_EXPERT_RULES),
    (
        *MOE_CONFIG_CHECKS,
        ("moe_intermediate_size", "moe_ffn_hidden_size"),
        ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
    ),
    IGNORED,
    ("qwen2_moe",),
)
