"""Mapping tables of the mixture-of-experts architectures: Qwen3-MoE, Qwen2-MoE, Mixtral.

An MoE layer is a dense decoder layer whose MLP is replaced by a router
(``mlp.router.weight``), routed experts and, for Qwen2-MoE, a shared expert
with a sigmoid gate. Routed experts appear under both Megatron spellings:
``mlp.experts.local_experts.{expert}.linear_fc{1,2}.weight`` (sequential MLP)
and ``mlp.experts.linear_fc{1,2}.weight{expert}`` (grouped GEMM), with
``{expert}`` the global expert index (see :mod:`megastart.loader.experts`).
Their gate/up projections fuse into ``linear_fc1`` as in a dense SwiGLU MLP,
split over Megatron's expert-tensor-parallel group instead of TP.

Checkpoints hold one tensor per expert (``mlp.experts.{j}.gate_proj.weight``),
as the hub's files and ``transformers``' ``save_pretrained`` write them.
Layers listed in ``mlp_only_layers`` stay dense and use the dense rules.
"""

from __future__ import annotations

from megastart.loader.mappings import (
    _HF_LAYER,
    _IGNORED,
    _LAYER,
    DENSE_CONFIG_CHECKS,
    DENSE_DECODER_RULES,
    QK_NORM_RULES,
    QKV_BIAS_RULES,
    MappingTable,
    Rule,
)

_EXPERT_FC1 = (
    _LAYER + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
    _LAYER + "mlp.experts.linear_fc1.weight{expert}",
)
_EXPERT_FC2 = (
    _LAYER + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
    _LAYER + "mlp.experts.linear_fc2.weight{expert}",
)


def routed_expert_rules(moe: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Router and routed experts of an HF MoE block at ``model.layers.{layer}.{moe}``."""
    block = _HF_LAYER + moe + "."
    expert = block + "experts.{expert}."
    return (
        Rule((_LAYER + "mlp.router.weight",), (block + "gate.weight",), "replicated"),
        Rule(_EXPERT_FC1, (expert + gate + ".weight", expert + up + ".weight"), "expert_gate_up"),
        Rule(_EXPERT_FC2, (expert + down + ".weight",), "expert_row_parallel"),
    )


QWEN_EXPERT_RULES = routed_expert_rules("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_RULES = routed_expert_rules("block_sparse_moe", "w1", "w3", "w2")

SHARED_EXPERT_RULES = (
    Rule(
        (_LAYER + "mlp.shared_experts.linear_fc1.weight",),
        (
            _HF_LAYER + "mlp.shared_expert.gate_proj.weight",
            _HF_LAYER + "mlp.shared_expert.up_proj.weight",
        ),
        "gate_up",
    ),
    Rule(
        (_LAYER + "mlp.shared_experts.linear_fc2.weight",),
        (_HF_LAYER + "mlp.shared_expert.down_proj.weight",),
        "row_parallel",
    ),
    Rule(
        (_LAYER + "mlp.shared_experts.gate_weight",),
        (_HF_LAYER + "mlp.shared_expert_gate.weight",),
        "replicated",
    ),
)

# intermediate_size is left out: in an all-MoE model Megatron's ffn_hidden_size
# is unused and hosts set it freely; dense layers' shapes are checked per tensor.
MOE_CONFIG_CHECKS = (
    *(c for c in DENSE_CONFIG_CHECKS if c[0] != "intermediate_size"),
    ("num_experts", "num_moe_experts"),
    ("num_local_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
)

QWEN3_MOE = MappingTable(
    ("Qwen3MoeForCausalLM",),
    (*DENSE_DECODER_RULES, *QK_NORM_RULES, *QWEN_EXPERT_RULES),
    (*MOE_CONFIG_CHECKS, ("moe_intermediate_size", "moe_ffn_hidden_size")),
    _IGNORED,
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
    _IGNORED,
    ("qwen2_moe",),
)
MIXTRAL = MappingTable(
    ("MixtralForCausalLM",),
    (*DENSE_DECODER_RULES, *MIXTRAL_EXPERT_RULES),
    (*MOE_CONFIG_CHECKS, ("intermediate_size", "moe_ffn_hidden_size")),
    _IGNORED,
    ("mixtral",),
)

MOE_TABLES = (QWEN3_MOE, QWEN2_MOE, MIXTRAL)
