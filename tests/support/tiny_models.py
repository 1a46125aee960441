"""Tiny checkpoints of architectures the harness's ``make_checkpoint`` does not know, written
with ``transformers``' own classes (config only, no downloads): the language model is the
loader tests' usual 4 layers of hidden size 64; a vision tower is 2 blocks of hidden size 32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megastart.harness.checkpoints import SMALL_SIZE

VISION: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4)

MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
GATED_DELTA_NET: dict[str, Any] = dict(  # three linear-attention layers, then a full one
    head_dim=16,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
"""Qwen3-Next's and Qwen3.5's: the tests' gated delta nets have 4 key and 8 value heads."""
MROPE: dict[str, Any] = dict(
    head_dim=16, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}
)

CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        dict(rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        dict(out_hidden_size=64, fullatt_block_indexes=[1], window_size=56),
    ),
    # Transformer Engine's specs only (gated delta nets, fused experts): the GPU suite's
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", GATED_DELTA_NET, dict(out_hidden_size=64)),
    "qwen3_5_moe": (
        "Qwen3_5MoeForConditionalGeneration",
        dict(GATED_DELTA_NET, **MOE, shared_expert_intermediate_size=32),
        dict(out_hidden_size=64),
    ),
    "qwen3_vl": (
        "Qwen3VLForConditionalGeneration",
        MROPE,
        dict(out_hidden_size=64, deepstack_visual_indexes=[0]),
    ),
    "qwen3_vl_moe": (  # experts fused: gate_up_proj [E, H, 2I], down_proj [E, I, H]
        "Qwen3VLMoeForConditionalGeneration",
        dict(MROPE, **MOE),
        dict(out_hidden_size=64, deepstack_visual_indexes=[0]),
    ),
    "gemma3": (  # the projector a permuted AutoMapping (mm_input_projection_weight [in, out])
        "Gemma3ForConditionalGeneration",
        dict(head_dim=16),
        dict(num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14),
    ),
    "mistral3": (  # Ministral 3: its bridge's hook returns plain weights as loaded
        "Mistral3ForConditionalGeneration",
        dict(head_dim=16, model_type="ministral3"),
        dict(num_hidden_layers=2, num_attention_heads=4, head_dim=8, image_size=28, patch_size=14),
    ),
    "glm4v_moe": (  # first layer dense, a shared expert, partial rotary
        "Glm4vMoeForConditionalGeneration",
        dict(
            MROPE,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            partial_rotary_factor=0.5,
            use_qk_norm=False,  # Megatron-Bridge 0.6.2's provider reads it; the config lacks it
        ),
        dict(out_hidden_size=64),
    ),
    "ernie4_5_vl_moe": (  # layer 0 dense, layer 1 a text and a vision pool of 4 experts each
        "Ernie4_5_VLMoeForConditionalGeneration",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=[32, 16],  # text, vision experts
            moe_num_shared_experts=1,
            rope_parameters={"rope_type": "default", "mrope_section": [3, 3, 2]},
        ),
        {},
    ),
}
"""Per vision-language ``model_type``: the architecture, and what its text and vision configs
add."""

TOP: dict[str, dict[str, Any]] = {
    "gemma3": dict(mm_tokens_per_image=4),
    "mistral3": dict(tie_word_embeddings=False),  # as the text config (an untied head)
}
"""What a vision-language config sets beside its text and vision configs."""

TEXT_ONLY: dict[str, tuple[str, dict[str, Any]]] = {
    "ernie4_5_moe": (  # shared expert, first layer dense, a [1, E] expert bias
        "Ernie4_5_MoeForCausalLM",
        dict(
            head_dim=16,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        ),
    ),
    # Transformer Engine's specs only: the GPU suite's
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        dict(GATED_DELTA_NET, **MOE, shared_expert_intermediate_size=32, decoder_sparse_step=1),
    ),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", GATED_DELTA_NET),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeForCausalLM",
        dict(GATED_DELTA_NET, **MOE, shared_expert_intermediate_size=32),
    ),
    "nemotron_h": (  # Mamba, attention, Mamba, MLP: in_proj groups split over TP
        "NemotronHForCausalLM",
        dict(
            head_dim=16,
            layers_block_type=["mamba", "attention", "mamba", "mlp"],
            mamba_num_heads=16,
            mamba_head_dim=4,
            n_groups=2,
            ssm_state_size=16,
            expand=1,
            use_mamba_kernels=False,
        ),
    ),
    "gemma4_text": (  # K = V on full-attention layers (no v_proj), the last two share KV
        "Gemma4ForCausalLM",
        dict(
            head_dim=16,
            global_head_dim=16,
            num_global_key_value_heads=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=300,
            sliding_window=32,
        ),
    ),
    "gemma4_moe_text": (  # Gemma 4's MoE block (Transformer Engine's specs only: the GPU's)
        "Gemma4ForCausalLM",
        dict(
            head_dim=16,
            global_head_dim=16,
            num_global_key_value_heads=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            sliding_window=32,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    ),
    "minimax_m2": (  # partial rotary, per-layer QK norms over all heads
        "MiniMaxM2ForCausalLM",
        dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
    ),
}


def make_tiny(model_type: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a random ``model_type`` model as a safetensors checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if model_type in TEXT_ONLY:
        architecture, text = TEXT_ONLY[model_type]
        config = AutoConfig.for_model(
            KIND.get(model_type, model_type),
            architectures=[architecture],
            **{**SMALL_SIZE, **text},
            dtype="float32",
        )
        auto: Any = AutoModelForCausalLM
    else:
        architecture, text, vision = CONFIGS[model_type]
        config = AutoConfig.for_model(
            model_type,
            architectures=[architecture],
            text_config={**SMALL_SIZE, **text},
            vision_config={**VISION, **vision},
            dtype="float32",
            **TOP.get(model_type, {}),
        )
        auto = AutoModelForImageTextToText
    torch.manual_seed(seed)
    model = auto.from_config(config)
    with torch.no_grad():  # nothing left at a constant initialisation (norms at one)
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    model.save_pretrained(out_dir, max_shard_size=200_000)
    for old, new in RELEASED_NAMES.get(model_type, {}).items():
        _rename(out_dir, old, new)
    return out_dir


KIND = {"gemma4_moe_text": "gemma4_text"}
"""The ``model_type`` of a tiny model named otherwise (one variant of a model type)."""

RELEASED_NAMES = {"nemotron_h": {"backbone.embedding.weight": "backbone.embeddings.weight"}}
"""Where ``transformers`` writes a tensor under another name than the released checkpoints
(and Megatron-Bridge's mapping) use: NVIDIA's Nemotron-H releases say ``embeddings``."""


def _rename(directory: Path, old: str, new: str) -> None:
    """Rename tensor ``old`` to ``new`` in the checkpoint's shard and index."""
    import json

    from safetensors.torch import load_file, save_file

    index = directory / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    shard = directory / files.get(old, "model.safetensors")
    tensors = load_file(shard)
    tensors[new] = tensors.pop(old)
    save_file(tensors, shard, metadata={"format": "pt"})
    if files:
        data = json.loads(index.read_text())
        data["weight_map"][new] = data["weight_map"].pop(old)
        index.write_text(json.dumps(data, indent=2))
