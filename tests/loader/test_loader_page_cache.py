"""Warm, cold and in between: a checkpoint partly in the page cache loads bit-exact on both of
the reader node's routes (the ranks copy resident pages without waiting for the reader, and
wait for the rest), and a read error on a range that is not resident reaches every rank."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest
import torch
from support.loader_faults import load_with_failing_reads
from support.loader_ranks import load_parameters

from megastart.bench.limits import drop_from_page_cache
from megastart.harness.launch import RankPool

ROUTES = ("page_cache", "shared_memory")
MODELS = {"llama-tp2": ("llama", {"tp": 2}), "qwen3_moe-ep2": ("qwen3_moe", {"ep": 2})}


def resident_fraction(path: Path) -> float:
    """The share of the file's pages in the page cache (``mincore``: reads nothing)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        pages = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        anchor = ctypes.c_char.from_buffer(mapped)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), size, pages) == 0
        finally:
            del anchor
        return sum(1 for page in pages if page & 1) / len(pages)


def drop(files: list[Path]) -> None:
    """Write the files' dirty pages back, then evict them (``POSIX_FADV_DONTNEED``)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    drop_from_page_cache([str(f) for f in files])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from megastart.harness.checkpoints import make_checkpoint

    return {
        name: make_checkpoint(arch, tmp_path_factory.mktemp(name))
        for name, (arch, _) in MODELS.items()
    }


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("model", MODELS)
def test_a_checkpoint_partly_in_the_page_cache_loads_bit_exact(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path], model: str, route: str
) -> None:
    directory, layout = checkpoints[model], MODELS[model][1]
    overrides = {"reader_node": route}
    warm = rank_pools[2].run(load_parameters, str(directory), layout, overrides)
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) >= 2 and all(resident_fraction(f) == 1.0 for f in files)
    drop(files[::2])
    if resident_fraction(files[0]) > 0.5:
        pytest.skip(f"this file system keeps {files[0]} cached (POSIX_FADV_DONTNEED ignored)")
    partly = rank_pools[2].run(load_parameters, str(directory), layout, overrides)
    for (_, expected), (_, loaded) in zip(warm, partly, strict=True):
        assert expected.keys() == loaded.keys()
        for name, value in expected.items():
            assert torch.equal(value, loaded[name]), name


@pytest.mark.parametrize("route", ROUTES)
def test_a_read_error_on_a_range_not_in_the_page_cache_reaches_every_rank(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path], route: str
) -> None:
    directory = checkpoints["llama-tp2"]
    files = sorted(directory.glob("*.safetensors"))
    drop(files)
    if resident_fraction(files[-1]) > 0.5:
        pytest.skip(f"this file system keeps {files[-1]} cached (POSIX_FADV_DONTNEED ignored)")
    messages = rank_pools[2].run(
        load_with_failing_reads, str(directory), {"tp": 2}, 5, None, {"reader_node": route}
    )
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("CollectiveError: rank0_loader: streaming")
    assert "Input/output error" in messages[0]


def fail_to_plan_on(failing: int, checkpoint: str, timeout_s: float) -> tuple[str, float]:
    """Load with ``failing``'s planning raising; the error this rank raised and how long it took."""
    import time

    import torch.distributed as dist
    from support.loader_ranks import load_expecting_error

    from megastart.loader import api

    original = api.plan_buckets

    def plan_buckets(*args: object, **kwargs: object) -> object:
        if dist.get_rank() == failing:
            raise ValueError("this rank's plan failed")
        return original(*args, **kwargs)

    api.plan_buckets = plan_buckets
    started = time.monotonic()
    try:
        message = load_expecting_error(checkpoint, {"tp": 2}, {"timeout_s": timeout_s})
    finally:
        api.plan_buckets = original
    return message, time.monotonic() - started


def test_a_rank_failing_to_plan_for_the_page_cache_stops_every_rank_at_once(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path]
) -> None:
    """One node taking its slices out of the page cache plans inside the stream's phase (no
    process group waits on a rank that failed to plan): the failure still reaches every rank
    as one error, not after the timeout."""
    results = rank_pools[2].run(fail_to_plan_on, 1, str(checkpoints["llama-tp2"]), 30.0)
    messages = [message for message, _ in results]
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("CollectiveError: rank0_loader: streaming")
    assert "failed on rank 1: ValueError: this rank's plan failed" in messages[0]
    assert all(waited < 30.0 for _, waited in results), results
