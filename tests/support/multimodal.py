"""Tiny vision-language checkpoints, written with ``transformers``' own classes (config only, no
downloads): the language model is the loader tests' usual 4 layers of hidden size 64; the
vision tower is 2 blocks of hidden size 32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEXT: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=128,
)
VISION: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4)

CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        dict(rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        dict(out_hidden_size=64, fullatt_block_indexes=[1], window_size=56),
    ),
}
"""Per ``model_type``: the architecture, and what its text and vision configs add."""


def make_multimodal(model_type: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a random ``model_type`` vision-language model as a safetensors checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    architecture, text, vision = CONFIGS[model_type]
    config = AutoConfig.for_model(
        model_type,
        architectures=[architecture],
        text_config={**TEXT, **text},
        vision_config={**VISION, **vision},
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # nothing left at a constant initialisation (norms at one)
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    model.save_pretrained(out_dir, max_shard_size=200_000)
    return out_dir
