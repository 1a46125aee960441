"""FP8 block-scaled checkpoints (DeepSeek-V3, Kimi-K2's format) are dequantised by the ranks
that receive them: every parameter equals the block dequantisation of the checkpoint
(float32 weight times its block's scale, rounded once to the model's dtype), bit for bit,
in every layout, on both of the reader node's routes; and the weights travel as FP8."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.loader_ranks import load_parameters
from support.quantise import DEEPSEEK_BLOCK, fp8_and_reference

from megastart.harness.launch import RankPool

ODD_BLOCK = (24, 40)
"""Blocks that no tensor-parallel split, row block or expert boundary lines up with."""

TINY_BUCKETS = {"bucket_mb": 0.01}
"""10 KiB buckets: the larger FP8 weights (:data:`WIDE_MLP`) travel as several row blocks, which
start inside a scale block."""

WIDE_MLP = {
    "llama": {},
    "qwen2": {"intermediate_size": 384},
    "qwen3_moe": {"moe_intermediate_size": 192},
}
"""MLP weights of 24 KiB (dense) and 12 KiB (experts) in FP8: larger than a tiny bucket."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(arch, block) -> (fp8 directory, reference directory)``, each made once, from bf16."""
    from megastart.harness.checkpoints import make_checkpoint

    made: dict[tuple[str, tuple[int, int]], tuple[str, str]] = {}

    def get(arch: str, block: tuple[int, int] = ODD_BLOCK) -> tuple[str, str]:
        if (arch, block) not in made:
            out = tmp_path_factory.mktemp(f"{arch}-fp8-{block[0]}x{block[1]}")
            bf16 = make_checkpoint(arch, out / "bf16", dtype="bfloat16", **WIDE_MLP[arch])
            made[arch, block] = fp8_and_reference(bf16, out, block)
        return made[arch, block]

    return get


def assert_same_parameters(fp8: list[Any], reference: list[Any]) -> None:
    for rank, ((_, got), (_, want)) in enumerate(zip(fp8, reference, strict=True)):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {rank}: {name} differs"


CASES = [
    pytest.param("llama", 2, {"tp": 2}, {"reader_node": "page_cache"}, id="llama-tp2-page_cache"),
    pytest.param("llama", 2, {"tp": 2}, {"reader_node": "shared_memory"}, id="llama-tp2-shm"),
    pytest.param("qwen2", 4, {"tp": 2, "pp": 2}, TINY_BUCKETS, id="qwen2-tp2_pp2-tiny_buckets"),
    pytest.param("qwen3_moe", 2, {"ep": 2}, TINY_BUCKETS, id="qwen3_moe-ep2-tiny_buckets"),
    pytest.param("qwen3_moe", 2, {"tp": 2, "ep": 2, "etp": 1}, {}, id="qwen3_moe-tp2_ep2_etp1"),
]


@pytest.mark.parametrize(("arch", "world", "layout", "overrides"), CASES)
def test_fp8_checkpoint_loads_as_its_block_dequantisation(
    rank_pools: dict[int, RankPool],
    checkpoints: Any,
    arch: str,
    world: int,
    layout: dict[str, int],
    overrides: dict[str, Any],
) -> None:
    fp8, reference = checkpoints(arch)
    pool = rank_pools[world]
    assert_same_parameters(
        pool.run(load_parameters, fp8, layout, overrides),
        pool.run(load_parameters, reference, layout, overrides),
    )


def test_deepseek_block_of_128(rank_pools: dict[int, RankPool], checkpoints: Any) -> None:
    """DeepSeek-V3's own 128x128 blocks, larger than every test tensor: one scale each."""
    fp8, reference = checkpoints("llama", DEEPSEEK_BLOCK)
    pool = rank_pools[2]
    assert_same_parameters(
        pool.run(load_parameters, fp8, {"tp": 2}, {}),
        pool.run(load_parameters, reference, {"tp": 2}, {}),
    )
