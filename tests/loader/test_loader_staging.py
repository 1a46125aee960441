"""The CUDA copy path's host side, on CPU: the staging ring packs and fills pieces of every
shape bit-exact on several threads within its bounded chunks, and the registration of the
load's file mappings registers each block once, in order, only what is in the page cache,
splits copies at block boundaries, and unregisters everything on every way out; a refusal
stops it with one log line. The node's shared segments page-lock through the same driver.

The GPU suite (tests/gpu/test_gpu_warm_loads.py) runs the same code against CUDA; here the
ring's chunks and targets are CPU tensors, and the driver records what a GPU's would be
asked (it is the boundary to hardware this machine lacks, not the thing under test).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from megastart.loader.checkpoint import read_metadata
from megastart.loader.plan.buckets import build_plan
from megastart.loader.stream.mappings import FileMappings, resident
from megastart.loader.stream.registration import (
    BLOCK_BYTES,
    LEAD_BLOCKS,
    Block,
    Registrations,
    blocks_in_order,
)
from megastart.loader.stream.staging import Ring, chunk_count, copy_threads


def ring(chunk_bytes: int, chunks: int, pool: Any, sent: list[int]) -> Ring:
    def send(pairs: Any) -> None:
        for target, staged in pairs:
            target.copy_(staged)
        sent.append(len(pairs))

    return Ring([torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(chunks)], pool, send)


@pytest.mark.parametrize("threads", [0, 3])
def test_staging_ring_copies_pieces_of_every_shape_bit_exact(threads: int) -> None:
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(300, 70, generator=generator).to(torch.bfloat16)
    sources = [
        whole,  # many chunks' worth, in row blocks
        whole[:, 10:45],  # a strided column slice (row-parallel)
        whole[5:6],  # one row
        whole[0, :3].clone(),  # a vector: rows of one element
        torch.randn(40, 8, generator=generator),  # float32 into bfloat16: converted in the fill
    ]
    targets = [torch.zeros(s.shape, dtype=torch.bfloat16) for s in sources]
    sent: list[int] = []
    pool = ThreadPoolExecutor(threads) if threads else None
    staging = ring(4096, 4, pool, sent)
    for target, source in zip(targets, sources, strict=True):
        assert staging.put(target, source)
    staging.flush()
    staging.wait()
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target, source.to(torch.bfloat16))
    assert len(sent) > 4  # the ring went round: chunks were refilled once sent
    assert staging.staged_bytes == sum(s.numel() * 2 for s in sources)  # as bfloat16
    if pool is not None:
        pool.shutdown()


def test_staging_ring_leaves_a_row_larger_than_a_chunk_to_the_caller() -> None:
    staging = ring(256, 2, None, [])
    assert not staging.put(torch.zeros(2, 200), torch.ones(2, 200))
    assert not staging.put(torch.zeros(()), torch.ones(()))


def test_staging_ring_raises_a_fill_error_at_flush_and_reads_nothing_after_abandon() -> None:
    pool = ThreadPoolExecutor(2)
    staging = ring(1024, 2, pool, [])
    good = torch.ones(8, 8)
    staging.put(torch.zeros(8, 8), good)
    staging.put(torch.zeros(4, 4), torch.empty(4, 4, device="meta"))  # no bytes to copy
    with pytest.raises((RuntimeError, NotImplementedError)):
        staging.flush()
    staging.abandon()  # waits for fills under way; nothing left packed
    staging.flush()
    pool.shutdown()


def test_copy_threads_follow_the_ranks_share_of_the_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    assert copy_threads(1) == max(1, min(8, cores))
    assert copy_threads(cores * 4) == 1
    assert chunk_count(copy_threads(1)) == 2 * copy_threads(1)


class Recorder:
    """A driver that grants (or refuses) every registration and records each call."""

    def __init__(self, refuse_after: int | None = None) -> None:
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.refuse_after = refuse_after

    def register(self, address: int, nbytes: int, flags: int) -> int:
        if self.refuse_after is not None and len(self.registered) >= self.refuse_after:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((address, nbytes, flags))
        return 0

    def unregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megastart.harness.checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("registration"))


def all_blocks(directory: Path) -> list[Block]:
    """Every block of the checkpoint's files, in a plan of every tensor (each block keeps
    its mapping)."""
    meta = read_metadata(str(directory), allow_pickle=False)
    mappings = FileMappings(meta)
    demands = [((name,), meta.tensors[name].dtype) for name in meta.tensors]
    plan = build_plan([demands], meta, bucket_bytes=1 << 20)
    return blocks_in_order(mappings, plan, lambda bucket: list(bucket.slots))


def registered_in_the_page_cache(block: Block) -> bool:
    return resident(block.mapping, block.offset, block.nbytes)


def test_registration_registers_each_block_once_read_only_and_unregisters_them_all(
    checkpoint: Path,
) -> None:
    blocks = all_blocks(checkpoint)
    for block in blocks:  # in the page cache, as in a warm load
        bytes(block.mapping[block.offset : block.offset + block.nbytes].numpy()[:: mmap.PAGESIZE])
    driver = Recorder()
    registrations = Registrations(driver, blocks, registered_in_the_page_cache)
    for block in blocks:  # the copies, in order: each block registered by the time one asks
        deadline = time.monotonic() + 10
        while registrations.covering(block.address + 8, 64) is None:
            assert time.monotonic() < deadline, "the registration did not keep up"
            time.sleep(0.001)
        assert len(driver.registered) <= blocks.index(block) + 1 + LEAD_BLOCKS
    assert [(a, n) for a, n, _ in driver.registered] == [(b.address, b.nbytes) for b in blocks]
    assert len({a for a, _, _ in driver.registered}) == len(blocks)
    assert {flags for _, _, flags in driver.registered} == {1 | 8}  # portable, read-only
    first = blocks[0]
    assert registrations.covering(first.address + 8, 64) == [(0, 64)]
    registrations.close()
    assert sorted(driver.unregistered) == sorted(a for a, _, _ in driver.registered)
    assert registrations.covering(first.address + 8, 64) is None


def test_registration_runs_at_most_its_lead_ahead_of_the_copies() -> None:
    data = torch.zeros(8 * BLOCK_BYTES, dtype=torch.uint8)
    blocks = [Block(data.data_ptr() + i * BLOCK_BYTES, BLOCK_BYTES, data, 0) for i in range(8)]
    driver = Recorder()
    registrations = Registrations(driver, blocks, lambda block: True)
    time.sleep(0.2)
    assert len(driver.registered) == LEAD_BLOCKS  # no copy asked yet
    registrations.covering(blocks[3].address, 8)
    time.sleep(0.2)
    assert len(driver.registered) == 3 + LEAD_BLOCKS + 1
    registrations.close()  # stops it waiting
    assert len(driver.unregistered) == len(driver.registered)


def test_registered_blocks_leave_the_page_tables_once_registered() -> None:
    data = torch.zeros(3 * BLOCK_BYTES, dtype=torch.uint8)
    blocks = [Block(data.data_ptr() + i * BLOCK_BYTES, BLOCK_BYTES, data, 0) for i in range(3)]
    unmapped: list[Block] = []
    registrations = Registrations(Recorder(refuse_after=2), blocks, lambda b: True, unmapped.append)
    registrations.close()
    assert unmapped == blocks[:2]  # the refused one was never registered


def rss_file_kb() -> int:
    """This process's resident pages of mapped files (``RssFile``), in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_dropped_pages_leave_the_process_and_stay_readable(tmp_path: Path) -> None:
    from megastart.loader.stream.mappings import drop_pages, map_file

    path = tmp_path / "shard.bin"
    expected = torch.randint(0, 255, (32 << 20,), dtype=torch.uint8)
    path.write_bytes(expected.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        data = map_file(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)
    assert torch.equal(data, expected)  # every page touched: in this process's page tables
    touched = rss_file_kb()
    drop_pages(data, 0, data.numel())
    assert rss_file_kb() <= touched - 24 * 1024  # most of the 32 MiB left the process
    assert torch.equal(data, expected)  # and the mapping still reads the file


def test_a_copy_across_blocks_is_split_at_their_boundary() -> None:
    data = torch.zeros(2 * BLOCK_BYTES, dtype=torch.uint8)
    base = data.data_ptr()
    blocks = [Block(base, BLOCK_BYTES, data, 0), Block(base + BLOCK_BYTES, BLOCK_BYTES, data, 0)]
    registrations = Registrations(Recorder(), blocks, lambda block: True)
    registrations._work.result()
    start = base + BLOCK_BYTES - 100
    assert registrations.covering(start, 300) == [(0, 100), (100, 200)]
    assert registrations.covering(base + 2 * BLOCK_BYTES - 10, 20) is None  # past the last
    registrations.close()


def test_registration_leaves_pages_not_in_the_page_cache_to_the_reader() -> None:
    data = torch.zeros(2 * BLOCK_BYTES, dtype=torch.uint8)
    base = data.data_ptr()
    blocks = [Block(base, BLOCK_BYTES, data, 0), Block(base + BLOCK_BYTES, BLOCK_BYTES, data, 0)]
    driver = Recorder()
    registrations = Registrations(driver, blocks, lambda block: block.address == base)
    registrations.close()
    assert [a for a, _, _ in driver.registered] == [base]
    assert registrations.covering(base + BLOCK_BYTES, 10) is None


def test_a_refused_registration_falls_back_with_one_line_and_unregisters_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = torch.zeros(4 * BLOCK_BYTES, dtype=torch.uint8)
    blocks = [Block(data.data_ptr() + i * BLOCK_BYTES, BLOCK_BYTES, data, 0) for i in range(4)]
    driver = Recorder(refuse_after=1)
    with caplog.at_level(logging.WARNING, logger="megastart"):
        registrations = Registrations(driver, blocks, lambda block: True)
        registrations._work.result()
    lines = [r.getMessage() for r in caplog.records if "registered page cache" in r.getMessage()]
    assert len(lines) == 1 and "error 2" in lines[0]
    assert registrations.refused
    assert registrations.covering(blocks[2].address, 8) is None  # staged instead
    registrations.close()
    assert driver.unregistered == [blocks[0].address]


def test_registration_unregisters_what_it_registered_when_its_thread_fails() -> None:
    data = torch.zeros(3 * BLOCK_BYTES, dtype=torch.uint8)
    blocks = [Block(data.data_ptr() + i * BLOCK_BYTES, BLOCK_BYTES, data, 0) for i in range(3)]
    driver = Recorder()

    def resident_then_failing(block: Block) -> bool:
        if block is blocks[1]:
            raise OSError("mincore failed")
        return True

    registrations = Registrations(driver, blocks, resident_then_failing)
    with pytest.raises(OSError, match="mincore failed"):
        registrations.close()
    assert driver.unregistered == [blocks[0].address]


class ThreadRecorder(Recorder):
    """A :class:`Recorder` that also notes the thread of each call."""

    def __init__(self, refuse_after: int | None = None) -> None:
        super().__init__(refuse_after)
        self.threads: list[int] = []

    def register(self, address: int, nbytes: int, flags: int) -> int:
        self.threads.append(threading.get_ident())
        return super().register(address, nbytes, flags)

    def unregister(self, address: int) -> int:
        self.threads.append(threading.get_ident())
        return super().unregister(address)


def test_a_shared_segment_is_page_locked_through_the_ranks_driver_off_the_callers_thread() -> None:
    """The node's shared buckets register with CUDA where the staging ring and the page cache
    do (the rank's driver), on a thread of their own: a refused call's CUDA error is not left
    on the caller's thread, where torch would raise it at its next kernel launch."""
    from megastart.loader.stream.shm import Segment

    driver = ThreadRecorder()
    segment = Segment.create(3 * mmap.PAGESIZE)
    try:
        assert segment.tensor is not None
        address = segment.tensor.data_ptr()
        segment.pin(driver)
        assert driver.registered == [(address, 3 * mmap.PAGESIZE, 0)]
    finally:
        segment.unlink()
        segment.close()
    assert driver.unregistered == [address]
    assert threading.get_ident() not in driver.threads and len(driver.threads) == 2


def test_a_refused_page_lock_of_a_shared_segment_names_the_fix() -> None:
    from megastart.loader.stream.shm import Segment

    segment = Segment.create(mmap.PAGESIZE)
    try:
        with pytest.raises(RuntimeError, match=r"shared-memory segment.*ulimit -l"):
            segment.pin(Recorder(refuse_after=0))
    finally:
        segment.unlink()
        segment.close()
