"""Cut on the GPU (``rank0_loader.cuda_copy=preads``, :mod:`megastart.loader.stream.landing`):
into CUDA parameters, bit-exact with the CPU load with part of the checkpoint dropped from the
page cache, dense TP2 and MoE EP2, on both of the reader node's routes; a failed load frees
the device buffer and unregisters every page-locked chunk. Two ranks share the first GPU."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from support.gpu_loads import failing_load_into_cuda, load_into_cuda
from support.loader_ranks import load_parameters
from test_gpu_warm_loads import MODELS, assert_same, checkpoints, files_of, warm

from megastart.bench.limits import drop_from_page_cache
from megastart.harness.launch import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PREADS = {"cuda_copy": "preads"}
__all__ = ["checkpoints"]  # the module's fixture, shared


@pytest.mark.parametrize("route", ["page_cache", "shared_memory"])
@pytest.mark.parametrize("model", MODELS)
def test_slices_cut_on_the_gpu_equal_the_cpu_load_partly_in_the_page_cache(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path], model: str, route: str
) -> None:
    directory, layout = checkpoints[model], MODELS[model][1]
    expected = rank_pools[2].run(load_parameters, str(directory), layout, {})  # CPU parameters
    warm(directory)
    drop_from_page_cache([str(f) for f in files_of(directory)[::2]])
    overrides = {**PREADS, "reader_node": route}
    loaded = rank_pools[2].run(load_into_cuda, str(directory), layout, overrides)
    assert_same(expected, loaded)
    for cuda in loaded:  # the staging chunks, page-locked and let go again
        assert cuda["registered"]
        assert sorted(a for a, _ in cuda["registered"]) == sorted(
            a for a, _ in cuda["unregistered"]
        )


def failing_load_freeing(checkpoint: str, layout: dict[str, int]) -> dict[str, Any]:
    """:func:`failing_load_into_cuda` (rank 1 fails its third bucket), and the GPU memory this
    rank's load held at its peak and still holds after it."""
    torch.cuda.set_device(0)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outcome = failing_load_into_cuda(checkpoint, layout, PREADS, 1)
    gc.collect()
    torch.cuda.synchronize()
    outcome["held_after"] = torch.cuda.memory_allocated() - before
    outcome["peak"] = torch.cuda.max_memory_allocated() - before
    return outcome


def test_a_failed_load_frees_the_device_buffer_and_every_page_locked_chunk(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path]
) -> None:
    outcomes = rank_pools[2].run(failing_load_freeing, str(checkpoints["llama-tp2"]), {"tp": 2})
    assert len({o["error"] for o in outcomes}) == 1, [o["error"] for o in outcomes]
    assert "injected: applying a bucket failed" in outcomes[0]["error"]
    for o in outcomes:
        assert o["peak"] > 0 and o["held_after"] == 0, (o["peak"], o["held_after"])
        assert o["registered"]
        assert sorted(a for a, _ in o["registered"]) == sorted(a for a, _ in o["unregistered"])
        assert all(error == 0 for _, error in o["unregistered"])
