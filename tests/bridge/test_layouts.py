"""Qwen3-Next's and Qwen3.5's gated delta nets, their gated attention and zero-centred norms,
and Mamba's convolution: megastart's translation of Megatron-Bridge's own resolved mapping
places, from row blocks of the HF tensors, exactly what the mapping's ``hf_to_megatron``
merges and scatters, on each of two TP ranks.

On tensors only: these layers' specs are Transformer Engine's (and Mamba's mixer needs
mamba-ssm), so no model is built here; the GPU machine runs the models.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.layout_ranks import theirs_and_ours

from megastart.harness.launch import RankPool

LAYER = "decoder.layers.0.self_attention."
GDN_ROWS = 2 * 64 + 2 * 64 + 2 * 8  # q, k (4 heads x 16), v, z (8 heads x 8), b, a


@pytest.mark.parametrize(
    ("bridge", "param", "kind", "rows", "stored", "dtype", "transform"),
    [
        (
            "Qwen3NextBridge",
            "in_proj.weight",
            "linear",
            GDN_ROWS,
            "float32",
            "float32",
            "interleave",
        ),
        ("Qwen35Bridge", "in_proj.weight", "linear", GDN_ROWS, "float32", "float32", "interleave"),
        (
            "Qwen3NextBridge",
            "conv1d.weight",
            "conv1d",
            2 * 64 + 64,
            "float32",
            "float32",
            "interleave",
        ),
        (
            "Qwen3NextBridge",
            "linear_qkv.weight",
            "linear",
            8 * 32 + 2 * 4 * 16,
            "float32",
            "float32",
            "interleave",
        ),
        ("Qwen3NextBridge", "out_norm.weight", "norm", 16, "bfloat16", "float32", "zero_centred"),
        (
            "MambaConv1dMapping",
            "conv1d.weight",
            "conv1d",
            32 + 2 * 12,
            "float32",
            "float32",
            "interleave",
        ),
    ],
    ids=[
        "qwen3_next-in_proj",
        "qwen3_5-in_proj",
        "gdn-conv1d",
        "gated-qkv",
        "zero_centred-norm",
        "mamba-conv1d",
    ],
)
def test_megastart_places_what_the_bridges_mapping_makes_on_each_tp_rank(
    rank_pools: dict[int, RankPool],
    bridge: str,
    param: str,
    kind: str,
    rows: int,
    stored: str,
    dtype: str,
    transform: str,
) -> None:
    canonical = ("decoder.layers.0.mixer." if bridge.startswith("Mamba") else LAYER) + param
    for rank, (theirs, ours, name) in enumerate(
        rank_pools[2].run(theirs_and_ours, bridge, canonical, kind, rows, stored, dtype)
    ):
        assert name.startswith(transform), name
        assert not ours.isnan().any(), f"rank {rank}: rows left unplaced by {name}"
        assert torch.equal(theirs, ours), f"rank {rank}: {canonical} differs ({name})"
