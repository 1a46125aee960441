"""What the mixture-of-experts tables share (Qwen3-MoE, Qwen2-MoE, Mixtral): routed experts.

An MoE layer is a dense decoder layer whose MLP is replaced by a router
(``mlp.router.weight``), routed experts and, for Qwen2-MoE, a shared expert
with a sigmoid gate. Routed experts appear under both Megatron spellings:
``mlp.experts.local_experts.{expert}.linear_fc{1,2}.weight`` (sequential MLP)
and ``mlp.experts.linear_fc{1,2}.weight{expert}`` (grouped GEMM), with
``{expert}`` the global expert index (see :mod:`megastart.loader.mapping.experts`).
Their gate/up projections fuse into ``linear_fc1`` as in a dense SwiGLU MLP,
split over Megatron's expert-tensor-parallel group instead of TP.

Checkpoints hold one tensor per expert (``mlp.experts.{j}.gate_proj.weight``),
as the hub's files and ``transformers``' ``save_pretrained`` write them.
Layers listed in ``mlp_only_layers`` stay dense and use the dense rules.
"""

from __future__ import annotations

from megastart.loader.mapping.archs.decoder import DENSE_CONFIG_CHECKS, HF_LAYER, LAYER
from megastart.loader.mapping.archs.table import Rule

_EXPERT_FC1 = (
    LAYER + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
    LAYER + "mlp.experts.linear_fc1.weight{expert}",
)
_EXPERT_FC2 = (
    LAYER + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
    LAYER + "mlp.experts.linear_fc2.weight{expert}",
)


def routed_expert_rules(moe: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Router and routed experts of an HF MoE block at ``model.layers.{layer}.{moe}``."""
    block = HF_LAYER + moe + "."
    expert = block + "experts.{expert}."
    return (
        Rule((LAYER + "mlp.router.weight",), (block + "gate.weight",), "replicated"),
        Rule(_EXPERT_FC1, (expert + gate + ".weight", expert + up + ".weight"), "expert_gate_up"),
        Rule(_EXPERT_FC2, (expert + down + ".weight",), "expert_row_parallel"),
    )


# intermediate_size is left out: in an all-MoE model Megatron's ffn_hidden_size
# is unused and hosts set it freely; dense layers' shapes are checked per tensor.
MOE_CONFIG_CHECKS = (
    *(c for c in DENSE_CONFIG_CHECKS if c[0] != "intermediate_size"),
    ("num_experts", "num_moe_experts"),
    ("num_local_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
)
