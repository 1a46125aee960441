"""Packed 4-bit releases are told from their config and headers alone: dequantised (where the
host's Megatron-Bridge loads them) only where every tensor that is not floating point is the
packing's own, refused otherwise."""

from __future__ import annotations

import pytest

from megastart.loader.checkpoint.quantised import find_quantisation

INT4_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
MXFP4_CONFIG = {"quant_method": "mxfp4"}
EXPERT = "language_model.model.layers.1.mlp.experts.0.down_proj.weight"
INT4 = {
    EXPERT + "_packed": ("int32", (64, 12)),
    EXPERT + "_scale": ("bfloat16", (64, 3)),
    EXPERT + "_shape": ("int32", (2,)),
    "language_model.model.norm.weight": ("bfloat16", (64,)),
}
EXPERTS = "model.layers.0.mlp.experts.down_proj"
MXFP4 = {
    EXPERTS + "_blocks": ("uint8", (4, 64, 3, 16)),
    EXPERTS + "_scales": ("uint8", (4, 64, 3)),
    EXPERTS + "_bias": ("bfloat16", (4, 64)),
}
GPTQ = {"x.qweight": ("int32", (8, 8))}


@pytest.mark.parametrize(
    ("config", "headers", "packing"),
    [
        ({"quantization_config": INT4_CONFIG}, INT4, "int4"),
        ({"text_config": {"quantization_config": INT4_CONFIG}}, INT4, "int4"),
        ({"quantization_config": INT4_CONFIG}, {**INT4, **GPTQ}, ""),
        ({"quantization_config": MXFP4_CONFIG}, MXFP4, "mxfp4"),
        (
            {"quantization_config": MXFP4_CONFIG},
            {**MXFP4, EXPERTS + "_scales": ("uint8", (4, 64))},
            "",
        ),
        ({"quantization_config": MXFP4_CONFIG}, INT4, ""),
    ],
    ids=[
        "int4",
        "int4-in_text_config",
        "int4-with_gptq",
        "mxfp4",
        "mxfp4-scales_misfit",
        "mxfp4-int4_tensors",
    ],
)
def test_packed_releases_are_told_from_their_headers(
    config: dict, headers: dict, packing: str
) -> None:
    """Dequantised only where every non-float tensor is the packing's (else refused)."""
    found = find_quantisation(config, headers)
    assert found is not None and found.packing == packing, found
