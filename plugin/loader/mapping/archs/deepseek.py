"""DeepSeek-V3 (also DeepSeek-R1 and Kimi-K2, the same layout) and GLM-4.5/4.6: MoE layers
with a sigmoid router whose ``e_score_correction_bias`` is Megatron's router
``expert_bias`` (a buffer, loaded as the parameters are), always-on shared experts, and the
first ``first_k_dense_replace`` layers dense.

DeepSeek's attention is multi-latent (MLA): the query either straight
(``q_proj``, no ``q_lora_rank``) or through a low-rank pair with a norm between
(``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), the keys and values through one
compressed projection (``kv_a_proj_with_mqa``: the latent and the shared rotary key,
in that order), its norm and ``kv_b_proj``. Megatron-core's MLA keeps the same row
orders (per head: the no-rope part, then the rope part; key, then value), so each
projection is a plain row split over tensor parallelism. The down projections are
split like that in the local layer spec and held whole on every rank in
Transformer Engine's (``column_parallel`` takes both).

A DeepSeek-V3 or GLM-4.5 checkpoint from the hub also holds its multi-token-prediction
layers after the decoder's (``model.layers.{num_hidden_layers}`` on): a model built with
them (``mtp_num_layers``) loads them (:data:`MTP_RULES`); one without leaves them unread
(:attr:`MappingTable.extra_layers_key`).
"""

from __future__ import annotations

from megastart.loader.mapping.archs.decoder import (
    DENSE_DECODER_RULES,
    HF_LAYER,
    IGNORED,
    LAYER,
    QK_NORM_RULES,
    QKV_BIAS_RULES,
)
from megastart.loader.mapping.archs.moe import routed_expert_rules
from megastart.loader.mapping.archs.table import MappingTable, Rule

ATTENTION = LAYER + "self_attention."
HF_ATTENTION = HF_LAYER + "self_attn."

_DECODER_RULES = tuple(
    r for r in DENSE_DECODER_RULES if not r.megatron[0].endswith("self_attention.linear_qkv.weight")
)

MLA_RULES = (
    Rule(
        (ATTENTION + "linear_q_proj.weight",), (HF_ATTENTION + "q_proj.weight",), "column_parallel"
    ),
    Rule(
        (ATTENTION + "linear_q_down_proj.weight",),
        (HF_ATTENTION + "q_a_proj.weight",),
        "column_parallel",
    ),
    Rule(
        (ATTENTION + "q_layernorm.weight", ATTENTION + "linear_q_up_proj.layer_norm_weight"),
        (HF_ATTENTION + "q_a_layernorm.weight",),
        "replicated",
    ),
    Rule(
        (ATTENTION + "linear_q_up_proj.weight",),
        (HF_ATTENTION + "q_b_proj.weight",),
        "column_parallel",
    ),
    Rule(
        (ATTENTION + "linear_kv_down_proj.weight",),
        (HF_ATTENTION + "kv_a_proj_with_mqa.weight",),
        "column_parallel",
    ),
    Rule(
        (ATTENTION + "kv_layernorm.weight", ATTENTION + "linear_kv_up_proj.layer_norm_weight"),
        (HF_ATTENTION + "kv_a_layernorm.weight",),
        "replicated",
    ),
    Rule(
        (ATTENTION + "linear_kv_up_proj.weight",),
        (HF_ATTENTION + "kv_b_proj.weight",),
        "column_parallel",
    ),
)

MTP = "mtp.layers.{layer}."
MTP_RULES = (
    Rule((MTP + "enorm.weight",), (HF_LAYER + "enorm.weight",), "replicated"),
    Rule((MTP + "hnorm.weight",), (HF_LAYER + "hnorm.weight",), "replicated"),
    Rule((MTP + "eh_proj.weight",), (HF_LAYER + "eh_proj.weight",), "column_parallel"),
    Rule((MTP + "final_layernorm.weight",), (HF_LAYER + "shared_head.norm.weight",), "replicated"),
)
"""A multi-token-prediction layer's own parameters (``{layer}``: its checkpoint layer,
``num_hidden_layers`` on; :meth:`MappingTable.resolve`); its transformer layer is a decoder
layer of that number, and it shares the embedding and the output layer with the model.
``eh_proj`` takes ``[enorm(embedding); hnorm(hidden)]`` in both."""

SIGMOID_MOE_RULES = (
    *routed_expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
    Rule(
        (LAYER + "mlp.router.expert_bias",),
        (HF_LAYER + "mlp.gate.e_score_correction_bias",),
        "replicated",
    ),
    Rule(
        (LAYER + "mlp.shared_experts.linear_fc1.weight",),
        (
            HF_LAYER + "mlp.shared_experts.gate_proj.weight",
            HF_LAYER + "mlp.shared_experts.up_proj.weight",
        ),
        "gate_up",
    ),
    Rule(
        (LAYER + "mlp.shared_experts.linear_fc2.weight",),
        (HF_LAYER + "mlp.shared_experts.down_proj.weight",),
        "row_parallel",
    ),
)

_MOE_CHECKS = (
    ("hidden_size", "hidden_size"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"),
    ("n_routed_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("tie_word_embeddings", "share_embeddings_and_output_weights"),
)

DEEPSEEK_V3 = MappingTable(
    ("DeepseekV3ForCausalLM",),
    (*_DECODER_RULES, *MLA_RULES, *SIGMOID_MOE_RULES, *MTP_RULES),
    (
        *_MOE_CHECKS,
        ("q_lora_rank", "q_lora_rank"),
        ("kv_lora_rank", "kv_lora_rank"),
        ("qk_nope_head_dim", "qk_head_dim"),
        ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
        ("v_head_dim", "v_head_dim"),
    ),
    IGNORED,
    ("deepseek_v3", "kimi_k2"),
    extra_layers_key="num_nextn_predict_layers",
)

GLM4_MOE = MappingTable(
    ("Glm4MoeForCausalLM",),
    (*DENSE_DECODER_RULES, *QKV_BIAS_RULES, *QK_NORM_RULES, *SIGMOID_MOE_RULES, *MTP_RULES),
    (
        *_MOE_CHECKS,
        ("num_key_value_heads", "num_query_groups"),
        ("head_dim", "kv_channels"),
    ),
    IGNORED,
    ("glm4_moe",),
    extra_layers_key="num_nextn_predict_layers",
)
