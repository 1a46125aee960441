"""The dense decoder every table starts from: embedding, attention, SwiGLU MLP, norms, LM head.

Each Megatron pattern lists every spelling a layer spec uses (local spec
``input_layernorm.weight``, Transformer-Engine spec
``linear_qkv.layer_norm_weight``); a table matches whichever the model has.
"""

from __future__ import annotations

from megastart.loader.mapping.archs.table import Rule

LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."

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
        (LAYER + "input_layernorm.weight", LAYER + "self_attention.linear_qkv.layer_norm_weight"),
        (HF_LAYER + "input_layernorm.weight",),
        "replicated",
    ),
    Rule(
        (LAYER + "self_attention.linear_qkv.weight",),
        tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv",
    ),
    Rule(
        (LAYER + "self_attention.linear_proj.weight",),
        (HF_LAYER + "self_attn.o_proj.weight",),
        "row_parallel",
    ),
    Rule(
        (LAYER + "pre_mlp_layernorm.weight", LAYER + "mlp.linear_fc1.layer_norm_weight"),
        (HF_LAYER + "post_attention_layernorm.weight",),
        "replicated",
    ),
    Rule(
        (LAYER + "mlp.linear_fc1.weight",),
        (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"),
        "gate_up",
    ),
    Rule((LAYER + "mlp.linear_fc2.weight",), (HF_LAYER + "mlp.down_proj.weight",), "row_parallel"),
)

QKV_BIAS_RULES = (
    Rule(
        (LAYER + "self_attention.linear_qkv.bias",),
        tuple(HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
        "qkv",
    ),
)

QK_NORM_RULES = (
    Rule(
        (LAYER + "self_attention.q_layernorm.weight",),
        (HF_LAYER + "self_attn.q_norm.weight",),
        "replicated",
    ),
    Rule(
        (LAYER + "self_attention.k_layernorm.weight",),
        (HF_LAYER + "self_attn.k_norm.weight",),
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

IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
