"""Warm, cold and in between: a checkpoint partly in the page cache loads bit-exact on both of
the reader node's routes (the ranks copy resident pages without waiting for the reader, and
wait for the rest; by ``pread`` where a piece allows it, else out of their mappings), and a
read error on a range that is not resident, or in a rank's ``pread``, reaches every rank."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest
import torch
from support.loader_faults import load_with_failing_reads
from support.loader_ranks import load_expecting_error, load_parameters

from megastart.bench.limits import drop_from_page_cache
from megastart.harness.launch import RankPool
from megastart.loader.checkpoint import read_metadata
from megastart.loader.stream import preads

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
    partly = rank_pools[2].run(load_counting_preads, str(directory), layout, overrides)
    for (_, expected), (_, loaded, read) in zip(warm, partly, strict=True):
        assert expected.keys() == loaded.keys()
        for name, value in expected.items():
            assert torch.equal(value, loaded[name]), name
        # out of the page cache, contiguous pieces are read; a row-parallel slice is copied
        total = sum(value.numel() * value.element_size() for value in loaded.values())
        assert (0 < read < total) if route == "page_cache" else read == 0, (read, total)


def load_counting_preads(
    checkpoint: str, layout: dict[str, int], overrides: dict[str, object]
) -> tuple[int, dict[str, torch.Tensor], int]:
    """:func:`load_parameters`, and the bytes this rank read into its parameters by ``pread``."""
    original = preads.Descriptors.read
    read = [0]

    def counted(self: preads.Descriptors, file: str, offset: int, target: torch.Tensor) -> None:
        original(self, file, offset, target)
        read[0] += target.numel() * target.element_size()

    preads.Descriptors.read = counted  # type: ignore[method-assign]
    try:
        return (*load_parameters(checkpoint, layout, overrides), read[0])
    finally:
        preads.Descriptors.read = original  # type: ignore[method-assign]


def test_a_kernel_without_cachestat_asks_mincore_and_loads_bit_exact(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path]
) -> None:
    """Where ``cachestat`` is refused (Linux before 6.5, a seccomp filter) the ranks ask
    ``mincore`` of the same ranges, and a partly resident checkpoint still loads bit-exact.
    The reader asks of every bucket; another rank only of the buckets it reaches before the
    reader has read them (none, where the reader runs ahead)."""
    directory, layout = checkpoints["llama-tp2"], MODELS["llama-tp2"][1]
    warm = rank_pools[2].run(load_parameters, str(directory), layout, {})
    files = sorted(directory.glob("*.safetensors"))
    drop(files[::2])
    if resident_fraction(files[0]) > 0.5:
        pytest.skip(f"this file system keeps {files[0]} cached (POSIX_FADV_DONTNEED ignored)")
    partly = rank_pools[2].run(load_without_cachestat, str(directory), layout)
    reader_asked = partly[0][2]
    assert reader_asked > 0, "the reader asked no residency of mincore"
    for (_, expected), (_, loaded, _) in zip(warm, partly, strict=True):
        for name, value in expected.items():
            assert torch.equal(value, loaded[name]), name


def load_without_cachestat(
    checkpoint: str, layout: dict[str, int]
) -> tuple[int, dict[str, torch.Tensor], int]:
    """:func:`load_parameters` as on a kernel that refuses ``cachestat``, and how many times this
    rank asked ``mincore`` instead."""
    from megastart.loader.stream import mappings

    original = mappings.resident
    asked = [0]

    def counted(data: torch.Tensor, offset: int, length: int) -> bool:
        asked[0] += 1
        return original(data, offset, length)

    preads._no_cachestat.set()
    mappings.resident = counted
    try:
        return (*load_parameters(checkpoint, layout, {}), asked[0])
    finally:
        preads._no_cachestat.clear()
        mappings.resident = original


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


def load_with_a_failing_pread(
    checkpoint: str, failing: int, overrides: dict[str, object] | None = None
) -> str:
    """Load with every ``pread`` of rank ``failing`` failing as a disk would (``EIO``)."""
    import torch.distributed as dist

    original = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(5, "Input/output error")

    os.preadv = preadv if dist.get_rank() == failing else original
    try:
        settings = {"reader_node": "page_cache", **(overrides or {})}
        return load_expecting_error(checkpoint, {"tp": 2}, settings)
    finally:
        os.preadv = original


def test_a_read_error_in_a_ranks_pread_reaches_every_rank_naming_the_file(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, Path]
) -> None:
    """A rank that is not the reader reads its resident pieces itself: its read error (a page
    evicted and the storage failing) is one error on every rank, naming the file, not a
    ``SIGBUS`` in that rank."""
    directory = checkpoints["llama-tp2"]
    messages = rank_pools[2].run(load_with_a_failing_pread, str(directory), 1)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("CollectiveError: rank0_loader: streaming")
    assert "failed on rank 1: OSError: reading" in messages[0]
    assert str(directory) in messages[0] and "Input/output error" in messages[0]


def test_a_rank_keeps_few_descriptors_open_for_its_reads(tmp_path: Path) -> None:
    """However many files a checkpoint has, the reads keep at most ``OPEN_AT_ONCE`` of them open
    (``ulimit -n``), return each file's bytes, and leave none open once closed."""
    from safetensors.torch import save_file

    tensors = {f"t{i}": torch.arange(i, i + 300, dtype=torch.bfloat16) for i in range(7)}
    for name, value in tensors.items():
        save_file({name: value}, str(tmp_path / f"{name}.safetensors"))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    meta = read_metadata(tmp_path, allow_pickle=False)
    before = len(os.listdir("/proc/self/fd"))
    files = preads.Descriptors(meta)
    try:
        for name, value in tensors.items():
            entry = meta.tensors[name]
            out = torch.empty_like(value)
            files.read(entry.file, entry.start, out)
            assert torch.equal(out, value), name
            assert len(os.listdir("/proc/self/fd")) - before <= preads.OPEN_AT_ONCE
    finally:
        files.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_rank_tells_resident_ranges_from_dropped_ones(checkpoints: dict[str, Path]) -> None:
    """``cachestat`` through the rank's descriptors agrees with ``mincore``: a file read whole is
    resident, one dropped is not, and neither is a range that reaches into a dropped page."""
    directory = checkpoints["llama-tp2"]
    meta = read_metadata(directory, allow_pickle=False)
    kept, dropped = sorted(f.name for f in directory.glob("*.safetensors"))[:2]
    (directory / kept).read_bytes()
    drop([directory / dropped])
    if resident_fraction(directory / dropped) > 0.5:
        pytest.skip(f"this file system keeps {dropped} cached (POSIX_FADV_DONTNEED ignored)")
    size = (directory / kept).stat().st_size
    files = preads.Descriptors(meta)
    try:
        found = files.in_page_cache(kept, 0, size)
        if found is None:
            pytest.skip("this kernel has no cachestat (the load asks mincore)")
        assert found and files.in_page_cache(kept, 100, size - 1)
        assert not files.in_page_cache(dropped, 0, (directory / dropped).stat().st_size)
        # one page dropped in the middle of a resident file
        fd = os.open(directory / kept, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 2 * mmap.PAGESIZE, mmap.PAGESIZE, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert not files.in_page_cache(kept, 0, size)
        assert files.in_page_cache(kept, 0, 2 * mmap.PAGESIZE)
        assert not files.in_page_cache(kept, 2 * mmap.PAGESIZE + 10, 2 * mmap.PAGESIZE + 20)
    finally:
        files.close()


def fail_to_plan_on(failing: int, checkpoint: str, timeout_s: float) -> tuple[str, float]:
    """Load with ``failing``'s planning raising; the error this rank raised and how long it took."""
    import time

    import torch.distributed as dist

    from megastart.loader.plan import planning

    original = planning.plan_buckets

    def plan_buckets(*args: object, **kwargs: object) -> object:
        if dist.get_rank() == failing:
            raise ValueError("this rank's plan failed")
        return original(*args, **kwargs)

    planning.plan_buckets = plan_buckets
    started = time.monotonic()
    try:
        message = load_expecting_error(checkpoint, {"tp": 2}, {"timeout_s": timeout_s})
    finally:
        planning.plan_buckets = original
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
