"""The physical limits a loader cannot beat, measured on the machine at hand.

A loader that reads the checkpoint once and broadcasts it needs at least
max(read time, broadcast time); these functions measure both rates, with the
files in the page cache or, after :func:`drop_from_page_cache`, off the storage,
and with CUDA parameters the rate of page-locked memory into the GPU (the link).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_READ_CHUNK = 64 * 2**20


def read_throughput(paths: Sequence[str]) -> tuple[int, float]:
    """Read every file once, start to end, into one reused buffer: (bytes, seconds).

    One reader, plain ``readinto``, no parsing: the fastest the files come off
    this machine's storage (or page cache, when they are cached).
    """
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - start


def drop_from_page_cache(paths: Sequence[str]) -> None:
    """Evict the files' pages from the page cache, as on a node that has not read them yet.

    ``POSIX_FADV_DONTNEED`` needs no privileges (unlike ``drop_caches``) but is a
    request: file systems that keep everything in memory (tmpfs) ignore it.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def broadcast_throughput(nbytes: int, repeats: int = 3) -> float:
    """Rank function: the fastest of ``repeats`` gloo broadcasts of ``nbytes`` from rank 0, in seconds.

    One warm-up broadcast first (gloo connects its pairs lazily); each timed one
    ends with a barrier, so it counts until the last rank has the data. The
    fastest is the limit: slower ones met other processes on the machine.
    """
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    dist.broadcast(buffer, src=0)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(buffer, src=0)
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def leader_broadcast_throughput(nbytes: int, ranks_per_node: int, repeats: int = 3) -> float:
    """Rank function: the fastest of ``repeats`` NCCL broadcasts of ``nbytes`` from rank 0 to
    every node leader (each node's first rank, on GPU ``rank % device_count``), in seconds,
    on the leaders (0.0 on the others).

    Over a group the leaders make alone, as the loader makes its own between node leaders
    (:class:`~megastart.distributed.LocalGroup`): the limit of ``--transport nccl``, what the
    buckets' crossings between nodes cannot beat. Each timed broadcast ends with an
    all-reduce of one element, so it counts until the last leader has the data.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from megastart.distributed import LocalGroup

    rank = dist.get_rank()
    if rank % ranks_per_node:
        return 0.0
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    leaders = range(0, dist.get_world_size(), ranks_per_node)
    store = dist.PrefixStore("megastart-bench/leaders/", _get_default_store())
    group = LocalGroup.make(store, leaders, timeout_s=600.0, backend="nccl")
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    done = torch.zeros(1, device=device)

    def broadcast() -> None:
        group.broadcast(buffer, 0).wait()
        group.all_reduce(done).wait()
        torch.cuda.synchronize(device)

    broadcast()  # NCCL connects the group on its first collective
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        broadcast()
        best = min(best, time.perf_counter() - start)
    group.close(failed=False)
    return best


def host_to_device_throughput(nbytes: int, repeats: int = 3) -> float:
    """Rank function: the fastest of ``repeats`` copies of ``nbytes`` of page-locked host memory
    into this rank's GPU, in GB/s, on rank 0 (0.0 on the others: the ranks of the benchmark
    share one GPU's link, which one rank measures alone).

    The link's rate: what a loader that reads nothing and converts nothing would reach.
    """
    import torch
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # the first copy pays for setting up the path
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del host, device
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


class ReadCap:
    """One process's storage bandwidth, capped as a parallel file system caps one client's
    (``bench loader --read-gbps``): each read of ``n`` bytes waits for its turn, and then for
    ``n / rate``, whatever the page cache holds (simulated nodes share one page cache; real
    ones do not)."""

    def __init__(self, gbps: float) -> None:
        self._bytes_per_s = gbps * 1e9
        self._lock = threading.Lock()
        self._free_at = 0.0

    def charge(self, nbytes: int) -> None:
        """Wait until this process's client has carried ``nbytes`` more (threads take turns)."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self._bytes_per_s
            wait = self._free_at - now
        time.sleep(wait)


@contextmanager
def megastart_reads_capped(cap: ReadCap | None) -> Iterator[None]:
    """megastart's two reads of the storage (into a buffer, into the page cache) charged to
    ``cap`` while in the block (nothing with ``None``)."""
    from megastart.loader.checkpoint import reader
    from megastart.loader.stream import pagecache

    if cap is None:
        yield
        return
    originals = reader.read_exact, pagecache.populate

    def capped(original: Callable[..., None], size: Callable[..., int]) -> Callable[..., None]:
        def read(*args: Any) -> None:
            cap.charge(size(*args))
            original(*args)

        return read

    reader.read_exact = capped(reader.read_exact, lambda fd, entry, out, directory: len(out))
    pagecache.populate = capped(pagecache.populate, lambda entry, data, offset, length: length)
    try:
        yield
    finally:
        reader.read_exact, pagecache.populate = originals
