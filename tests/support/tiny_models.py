"""Tiny checkpoints of architectures the harness's ``make_checkpoint`` does not know, written
with ``transformers``' own classes (config only, no downloads): the language model is the
loader tests' usual 4 layers of hidden size 64; a vision tower is 2 blocks of hidden size 32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megastart.harness.checkpoints import SMALL_SIZE

VISION: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4)

CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        dict(rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        dict(out_hidden_size=64, fullatt_block_indexes=[1], window_size=56),
    ),
}
"""Per vision-language ``model_type``: the architecture, and what its text and vision configs
add."""

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
}


def make_tiny(model_type: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a random ``model_type`` model as a safetensors checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if model_type in TEXT_ONLY:
        architecture, text = TEXT_ONLY[model_type]
        config = AutoConfig.for_model(
            model_type, architectures=[architecture], **SMALL_SIZE, **text, dtype="float32"
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
        )
        auto = AutoModelForImageTextToText
    torch.manual_seed(seed)
    model = auto.from_config(config)
    with torch.no_grad():  # nothing left at a constant initialisation (norms at one)
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    model.save_pretrained(out_dir, max_shard_size=200_000)
    return out_dir
