"""Qwen3-Next's and Qwen3.5's gated delta nets, their gated attention and zero-centred norms,
and Mamba's convolution: megastart's translation of Megatron-Bridge's own resolved mapping
places, from row blocks of the HF tensors, exactly what the mapping's ``hf_to_megatron``
merges and scatters, on each of two TP ranks.

On tensors only: these layers' specs are Transformer Engine's (and Mamba's mixer needs
mamba-ssm), so no model is built here; the GPU machine runs the models. So are Kimi-K2.5's
INT4 experts (compressed-tensors' ``pack-quantized``), whose model no machine here builds: its
vision tower is the hub's remote code.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.layout_ranks import (
    full_dim_norm,
    gpt_oss_experts,
    mimo_input_proj,
    theirs_and_ours,
)
from support.quantised_ranks import kimi_k25_int4_expert

from megastart.harness.launch import RankPool

LAYER = "decoder.layers.0.self_attention."
GDN_ROWS = 2 * 64 + 2 * 64 + 2 * 8  # q, k (4 heads x 16), v, z (8 heads x 8), b, a
QKV_ROWS = (8 + 2 * 4) * 16  # 8 heads in 4 groups of head dim 16

CASES = {  # bridge (or mapping class), parameter, holding module, rows before TP, HF dtype[, param]
    "qwen3_next-in_proj": (
        "Qwen3NextBridge",
        LAYER + "in_proj.weight",
        "linear",
        GDN_ROWS,
        "float32",
    ),
    "qwen3_5-in_proj": ("Qwen35Bridge", LAYER + "in_proj.weight", "linear", GDN_ROWS, "float32"),
    "gdn-conv1d": ("Qwen3NextBridge", LAYER + "conv1d.weight", "conv1d", 3 * 64, "float32"),
    "gated-qkv": (
        "Qwen3NextBridge",
        LAYER + "linear_qkv.weight",
        "linear",
        QKV_ROWS + 128,
        "float32",
    ),
    "zero_centred-norm": ("Qwen3NextBridge", LAYER + "out_norm.weight", "norm", 16, "bfloat16"),
    # a float32 checkpoint into a bf16 model: one is subtracted before the cast, as the bridge does
    "zero_centred-norm-narrowed": (
        "Qwen3NextBridge",
        LAYER + "out_norm.weight",
        "norm",
        16,
        "float32",
        "bfloat16",
    ),
    "mamba-conv1d": (
        "MambaConv1dMapping",
        "decoder.layers.0.mixer.conv1d.weight",
        "conv1d",
        56,
        "float32",
    ),
    "scalar_gate-qkv": (
        "Step35Bridge",
        LAYER + "linear_qkv.weight",
        "linear",
        QKV_ROWS + 128,
        "float32",
    ),
    "vit-concatenated_qkv": (
        "Qwen3VLBridge",
        "vision_model." + LAYER + "linear_qkv.weight",
        "linear",
        QKV_ROWS,
        "float32",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_megastart_places_what_the_bridges_mapping_makes_on_each_tp_rank(
    rank_pools: dict[int, RankPool], case: str
) -> None:
    bridge, canonical, kind, rows, stored, *param = CASES[case]
    transform = "zero_centred" if kind == "norm" else "interleave"
    for rank, (theirs, ours, name) in enumerate(
        rank_pools[2].run(
            theirs_and_ours, bridge, canonical, kind, rows, stored, *(param or ["float32"])
        )
    ):
        assert name.startswith(transform), name
        assert not ours.isnan().any(), f"rank {rank}: rows left unplaced by {name}"
        assert torch.equal(theirs, ours), f"rank {rank}: {canonical} differs ({name})"


@pytest.mark.parametrize(
    ("which", "key_heads"), [("q", 4), ("k", 4), ("k", 1)], ids=["q", "k", "k-replicated"]
)
def test_minimax_m2_full_dimension_norms_take_the_rows_their_module_declares(
    rank_pools: dict[int, RankPool], which: str, key_heads: int
) -> None:
    """The bridge's own mapping needs CUDA at TP > 1; the module's sharded state dict (what
    Megatron's checkpoints use) says which rows each rank holds, replicas included."""
    for rank, (expected, ours) in enumerate(rank_pools[2].run(full_dim_norm, which, key_heads)):
        assert torch.equal(expected, ours), f"rank {rank}: {which} norm rows differ"


def test_mimo_mtp_input_proj_loads_as_its_bridges_hook_swaps_it(
    rank_pools: dict[int, RankPool],
) -> None:
    for rank, (theirs, ours, name) in enumerate(rank_pools[2].run(mimo_input_proj)):
        assert name.startswith("swapped_halves:"), name
        assert torch.equal(theirs, ours), f"rank {rank}: eh_proj differs ({name})"


@pytest.mark.parametrize("intermediate", [48, 64], ids=["I48", "square"])
def test_gpt_oss_experts_load_as_its_bridge_loads_bf16_releases(
    rank_pools: dict[int, RankPool], intermediate: int
) -> None:
    """Expert tensor parallelism 1 (its bridge aligns gate/up to the local shape); a square
    down_proj is transposed, as its bridge's hook transposes it."""
    for rank, loaded in enumerate(rank_pools[2].run(gpt_oss_experts, intermediate)):
        for theirs, ours, name in loaded:
            assert name.startswith("fused_expert:3:"), name
            assert torch.equal(theirs, ours), f"rank {rank}: {name} differs"


@pytest.mark.parametrize("intermediate", [64, 96], ids=["groups_split_evenly", "a_group_split"])
def test_kimi_k25_int4_experts_load_as_its_bridge_dequantises_them(
    rank_pools: dict[int, RankPool], intermediate: int
) -> None:
    """On tensors (no model: Kimi-K2.5's vision tower is the hub's remote code), expert TP 2:
    ``linear_fc1``'s rows and ``linear_fc2``'s columns of each rank; with 96 columns a rank's
    half of ``down_proj`` starts inside a group of 32 and inside a packed word."""
    for rank, loaded in enumerate(rank_pools[2].run(kimi_k25_int4_expert, intermediate)):
        for theirs, ours, name in loaded:
            assert name.startswith("expert_"), name
            assert not ours.isnan().any(), f"rank {rank}: rows left unplaced by {name}"
            assert torch.equal(theirs, ours), f"rank {rank}: {name} differs"
