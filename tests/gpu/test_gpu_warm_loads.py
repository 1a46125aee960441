"""Warm loads into CUDA parameters (issue #40): bit-exact with part of the checkpoint in the
page cache and part dropped, dense and MoE, through the registered page cache and through
page-locked staging; every block registered is unregistered after a load that failed; a
driver that refuses registration gets the staging fallback, one line each, and the load
still completes. Two ranks share the machine's first GPU over gloo; one rank alone shows
the registered route copying straight out of the page cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.gpu_loads import failing_load_into_cuda, load_into_cuda
from support.loader_ranks import load_parameters

from megastart.bench.limits import drop_from_page_cache
from megastart.harness.launch import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODELS = {"llama-tp2": ("llama", {"tp": 2}), "qwen3_moe-ep2": ("qwen3_moe", {"ep": 2})}
COPIES = ("registered", "staged")
READ_ONLY = 8
"""``cudaHostRegisterReadOnly``: the flag of the page cache's blocks (not the staging ring's)."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from megastart.harness.checkpoints import make_checkpoint

    return {
        name: make_checkpoint(arch, tmp_path_factory.mktemp(name))
        for name, (arch, _) in MODELS.items()
    }


def files_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def warm(directory: Path) -> None:
    for file in files_of(directory):
        file.read_bytes()


def assert_same(expected: list[tuple[int, dict[str, torch.Tensor]]], loaded: list[Any]) -> None:
    for (_, cpu), cuda in zip(expected, loaded, strict=True):
        assert cpu.keys() == cuda["params"].keys()
        for name, value in cpu.items():
            assert torch.equal(value, cuda["params"][name]), name


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("model", MODELS)
def test_cuda_load_partly_in_the_page_cache_is_bit_exact(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path], model: str, copy: str
) -> None:
    directory, layout = checkpoints[model], MODELS[model][1]
    expected = rank_pools[2].run(load_parameters, str(directory), layout, {})  # CPU parameters
    warm(directory)
    files = files_of(directory)
    drop_from_page_cache([str(f) for f in files[::2]])
    loaded = rank_pools[2].run(load_into_cuda, str(directory), layout, {"cuda_copy": copy})
    assert_same(expected, loaded)
    for rank in loaded:  # everything registered went again
        assert sorted(a for a, _ in rank["registered"]) == sorted(
            a for a, _ in rank["unregistered"]
        )
        assert all(error == 0 for _, error in rank["unregistered"])


def test_one_rank_copies_a_warm_checkpoint_straight_from_the_registered_page_cache(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path]
) -> None:
    directory = checkpoints["llama-tp2"]
    expected = rank_pools[1].run(load_parameters, str(directory), {}, {})
    warm(directory)
    loaded = rank_pools[1].run(load_into_cuda, str(directory), {}, {"cuda_copy": "registered"})
    assert_same(expected, loaded)
    routes = [line for line in loaded[0]["lines"] if "straight out of" in line]
    print(*routes, sep="\n")  # for the run's log: how the bytes reached the GPU
    blocks = [a for a, flags in loaded[0]["registered"] if flags & READ_ONLY]
    assert blocks, f"no block of the page cache was registered: {loaded[0]['lines']}"
    assert loaded[0]["straight_bytes"] > 0, routes


def test_every_registered_block_is_unregistered_after_a_failed_load(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path]
) -> None:
    directory = checkpoints["llama-tp2"]
    warm(directory)
    outcomes = rank_pools[2].run(
        failing_load_into_cuda, str(directory), {"tp": 2}, {"cuda_copy": "registered"}, 1
    )
    assert all(o["error"] for o in outcomes), outcomes
    assert len({o["error"] for o in outcomes}) == 1, [o["error"] for o in outcomes]
    assert "injected: applying a bucket failed" in outcomes[0]["error"]
    assert any(flags & READ_ONLY for o in outcomes for _, flags in o["registered"])
    for o in outcomes:
        assert sorted(a for a, _ in o["registered"]) == sorted(a for a, _ in o["unregistered"])
        assert all(error == 0 for _, error in o["unregistered"])


def test_a_refused_registration_falls_back_to_staging_with_one_line_each(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path]
) -> None:
    directory = checkpoints["llama-tp2"]
    expected = rank_pools[2].run(load_parameters, str(directory), {"tp": 2}, {})
    warm(directory)
    loaded = rank_pools[2].run(
        load_into_cuda, str(directory), {"tp": 2}, {"cuda_copy": "registered"}, True
    )
    assert_same(expected, loaded)
    for rank in loaded:
        assert rank["registered"] == [] and rank["straight_bytes"] == 0
        staging = [line for line in rank["lines"] if "pageable memory" in line]
        # the fallback's line, not the rank's summary of its routes (which names both)
        page_cache = [
            line for line in rank["lines"] if "instead of the registered page cache" in line
        ]
        assert len(staging) == 1 and len(page_cache) == 1, rank["lines"]
