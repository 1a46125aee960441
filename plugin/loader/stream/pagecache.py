"""The reader's node reads from the page cache: each rank takes its slices of a bucket from the files.

On the node that holds the checkpoint's reader, a bucket's bytes are already in
memory the whole node shares once the reader has read them: the page cache.
Copying them into a shared-memory buffer first and out of it again moves every
byte twice; here each rank copies its slices straight out of the page cache, the
way AReaL's per-rank slices do (``megastart bench loader``, docs/performance.md):
by ``pread`` where a piece allows it (:mod:`megastart.loader.stream.preads`), else out of
its own read-only mapping of the files. Other nodes still receive into shared
memory (:mod:`megastart.loader.stream.shm`).

The reader remains the only rank that reads the storage: before it announces
a bucket it makes the bucket's pages resident (``MADV_POPULATE_READ``, on
several threads), so the node's ranks find them cached, and a read error is
the reader's, an exception it announces to every rank, not a ``SIGBUS`` in one
of them. Each rank maps each file once for the whole load (:class:`FileMappings`:
a mapping holds no file descriptor, so ``ulimit -n`` bounds nothing here) and
copies what is resident at once; only the ranges not resident wait for the reader,
whose progress is a word of the node's page (:class:`Frontier`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from errno import EINTR
from typing import TYPE_CHECKING, Any

from megastart.distributed import Board, CollectiveError, polled_locally
from megastart.loader.checkpoint import (
    ITEMSIZE,
    CheckpointMeta,
    TensorEntry,
    TensorReader,
    open_shard,
)
from megastart.loader.plan.buckets import Plan, Slot
from megastart.loader.stream.preads import Descriptors, source_of
from megastart.loader.stream.transport import ReaderError

if TYPE_CHECKING:
    import torch

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
"""``madvise`` advice that faults a range in for reading and waits (Linux 5.14 and later)."""
FAULT_AROUND = 2 << 20
"""How far beyond a range its faults may have mapped pages: fault-around, a large folio (2 MiB)."""


@functools.cache
def supported() -> bool:
    """Whether this kernel populates mappings on request (the route needs it)."""
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(MADV_POPULATE_READ, 0, mmap.PAGESIZE)
    except (OSError, ValueError):
        return False
    finally:
        probe.close()
    return True


class FileMappings:
    """Each of the checkpoint's files mapped whole and read-only, once per rank for the load
    (on first use, from any thread), unmapped when the last view of it goes; with a few
    descriptors of them for the copies read rather than mapped (:mod:`megastart.loader.stream.preads`),
    closed by :meth:`close`."""

    def __init__(self, meta: CheckpointMeta) -> None:
        self.meta = meta
        self._maps: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.files = Descriptors(meta)

    def close(self) -> None:
        """Close the descriptors (the mappings go with their last view)."""
        self.files.close()

    def __getitem__(self, file: str) -> torch.Tensor:
        """The file's mapping, as bytes."""
        with self._lock:
            data = self._maps.get(file)
            if data is None:
                meta = self.meta
                fd = open_shard(meta.directory, file, meta.shards[file])
                try:
                    data = self._maps[file] = map_file(fd, 0, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
            return data

    def in_page_cache(self, file: str, first: int, end: int) -> bool:
        """Whether bytes ``[first, end)`` of ``file`` are all in the page cache: ``cachestat``
        (:meth:`Descriptors.in_page_cache`), else one ``mincore`` over that range alone."""
        found = self.files.in_page_cache(file, first, end)
        if found is not None:
            return found
        low = first // mmap.PAGESIZE * mmap.PAGESIZE
        return resident(self[file], low, end - low)


class Window:
    """Slots of one bucket as read-only views of the checkpoint's files (the load's mappings)."""

    page_locked = False
    """The files' pages are pageable memory."""

    def __init__(self, mappings: FileMappings, slots: Iterable[Slot]) -> None:
        meta = mappings.meta
        self.entries = {
            slot.name: meta.tensors[slot.name].row_range(slot.rows.start, slot.rows.stop)
            for slot in slots
        }
        self.mappings = mappings
        self._maps = {
            entry.file: mappings[entry.file]
            for entry in self.entries.values()
            if entry.end > entry.start
        }
        """Per file: its mapping, as bytes."""

    def read_into(self, target: torch.Tensor, piece: torch.Tensor) -> bool:
        """``target[...] = piece`` (a view of :meth:`view`) by ``pread`` where it allows it
        (:func:`~megastart.loader.stream.preads.source_of`); ``False``: copy it."""
        found = source_of(self._maps, target, piece)
        if found is not None:
            self.mappings.files.read(*found, target)
        return found is not None

    def view(self, slot: Slot) -> torch.Tensor:
        """The slot's rows as the file holds them (the checkpoint's dtype), shaped as the slot."""
        import torch

        entry = self.entries[slot.name]
        dtype = getattr(torch, entry.dtype)
        if entry.end <= entry.start:
            return torch.empty(slot.shape, dtype=dtype)
        raw = self._maps[entry.file][entry.start : entry.end]
        if entry.start % ITEMSIZE[entry.dtype]:  # safetensors does not promise aligned tensors
            raw = raw.clone()
        return raw.view(dtype).view(slot.shape)

    def release(self) -> None:
        """Drop the slots' pages from this process's page tables (``MADV_DONTNEED``; the mapping
        and the page cache stay): a rank's memory counts a bucket's pages only while it copies
        them. Per file, from the first slot's start to the last one's end, and
        :data:`FAULT_AROUND` beyond (a fault maps the pages around it too). Best effort: a range
        the kernel will not drop (a locked one) stays mapped, costing memory accounting only."""
        for _, (data, low, high) in self._spans():
            low = max(0, low - low % FAULT_AROUND - FAULT_AROUND)
            high = min(-(-high // FAULT_AROUND) * FAULT_AROUND + FAULT_AROUND, data.numel())
            drop_pages(data, low, high - low)

    def resident_slots(self, slots: Iterable[Slot]) -> tuple[list[Slot], list[Slot]]:
        """``slots`` split into those whose pages are all in the page cache
        (:meth:`FileMappings.in_page_cache`: a warm load's) and the others, which the reader
        reads."""
        here: list[Slot] = []
        not_yet: list[Slot] = []
        waiting: set[str] = set()
        for slot in slots:
            entry = self.entries[slot.name]
            cached = entry.end <= entry.start or self.mappings.in_page_cache(
                entry.file, entry.start, entry.end
            )
            # a quantised weight is dequantised with its scales: it waits with them
            quantisation = self.mappings.meta.quantisation
            if quantisation and quantisation.scale_of(slot.name, entry.dtype) in waiting:
                cached = False
            (here if cached else not_yet).append(slot)
            if not cached:
                waiting.add(slot.name)
        return here, not_yet

    def populate(self, reader: TensorReader, pool: Executor, part_bytes: int) -> None:
        """Make every slot's pages resident, parts of ``part_bytes`` on ``pool``'s threads at once,
        counted as ``reader``'s reads; a read error raises, naming the tensor. A bucket resident
        already (warm) costs one look per file and no thread (per part: 6 ms more CPU, 1 GB)."""
        nbytes = sum(entry.end - entry.start for entry in self.entries.values())
        if all(
            self.mappings.in_page_cache(file, low, high) for file, (_, low, high) in self._spans()
        ):
            reader.count(nbytes)
            return
        reads = [
            pool.submit(_read_part, reader, entry, data, offset, min(part_bytes, end - offset))
            for entry, data, first, end in self._pages()
            for offset in range(first, end, part_bytes)
        ]
        for read in reads:
            read.result()
        reader.count(nbytes)

    def _spans(self) -> Iterable[tuple[str, tuple[torch.Tensor, int, int]]]:
        """Per file: its mapping, and the range of it from the slots' first page to their end."""
        spans: dict[str, tuple[torch.Tensor, int, int]] = {}
        for entry, data, first, end in self._pages():
            _, low, high = spans.get(entry.file, (data, first, end))
            spans[entry.file] = data, min(low, first), max(high, end)
        return spans.items()

    def _pages(self) -> Iterator[tuple[TensorEntry, torch.Tensor, int, int]]:
        """Each slot that holds bytes, its file's mapping, and the range of the mapping that
        holds them (from the first page of the slot's bytes to their end)."""
        for entry in self.entries.values():
            if entry.end > entry.start:
                first = entry.start // mmap.PAGESIZE * mmap.PAGESIZE
                yield entry, self._maps[entry.file], first, entry.end


def map_file(fd: int, offset: int, length: int) -> torch.Tensor:
    """``length`` bytes of the file open as ``fd`` from ``offset`` (a multiple of the page size)
    on, mapped as a ``uint8`` tensor that holds no file descriptor (``mmap.mmap`` keeps a
    duplicate per mapping: a load's mappings would count against ``ulimit -n``); unmapped
    when the tensor's memory is freed. Read-only: a write would fault rather than copy a
    page out of the page cache, and CUDA may register it read-only
    (:mod:`megastart.loader.stream.registration`)."""
    import torch

    libc = _libc()
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if address == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mapping {length} bytes of a shard failed: {os.strerror(errno)}")
    mapping: Any = type("Mapping", (ctypes.c_ubyte * length,), {})  # weak-referenceable
    pages = mapping.from_address(address)
    weakref.finalize(pages, libc.munmap, address, length)  # torch keeps ``pages`` alive
    return torch.frombuffer(pages, dtype=torch.uint8)


_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def _read_part(
    reader: TensorReader, entry: TensorEntry, data: torch.Tensor, offset: int, length: int
) -> None:
    with reader.tracking(entry):
        populate(entry, data, offset, length)


def populate(entry: TensorEntry, data: torch.Tensor, offset: int, length: int) -> None:
    """Make ``length`` bytes of ``data`` (a mapping of ``entry``'s file) from ``offset`` on resident."""
    # Through ctypes, which releases the GIL (mmap.madvise holds it): the parts are read in parallel.
    if resident(data, offset, length):
        return  # cached already (a warm start): populating would only fill this process's page tables
    address = ctypes.c_void_p(data.data_ptr() + offset)
    while _libc().madvise(address, ctypes.c_size_t(length), MADV_POPULATE_READ):
        errno = ctypes.get_errno()
        if errno != EINTR:
            raise OSError(
                errno,
                f"reading tensor {entry.name!r} from {entry.file!r} into the page cache "
                f"failed: {os.strerror(errno)}",
            )


def resident(data: torch.Tensor, offset: int, length: int) -> bool:
    """Whether ``length`` bytes of the mapping ``data`` from ``offset`` (page-aligned) are all in
    the page cache (``mincore``: asks the kernel, reads nothing)."""
    return 0 not in residency(data, offset, length)


def drop_pages(data: torch.Tensor, offset: int, length: int) -> None:
    """Drop ``length`` bytes of the mapping ``data`` from ``offset`` (page-aligned) from this
    process's page tables (``MADV_DONTNEED``): the mapping and the page cache stay, and a
    page pinned for CUDA stays pinned. Best effort (see :meth:`Window.release`)."""
    length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    address, dontneed = ctypes.c_void_p(data.data_ptr() + offset), mmap.MADV_DONTNEED
    _libc().madvise(address, ctypes.c_size_t(length), dontneed)


def residency(data: torch.Tensor, offset: int, length: int) -> bytes:
    """Per page of ``length`` bytes of the mapping ``data`` from ``offset`` (page-aligned): 1 if
    it is in the page cache, else 0 (all 0 where the kernel cannot tell)."""
    address = ctypes.c_void_p(data.data_ptr() + offset)
    pages = (ctypes.c_ubyte * ((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    if _libc().mincore(address, ctypes.c_size_t(length), pages) != 0:
        return bytes(len(pages))
    return bytes(pages)


class Frontier:
    """How many of the plan's buckets the reader has read into the page cache, or its error,
    in :data:`NBYTES` of the node's page (:attr:`~megastart.loader.stream.node.NodeBoard.spare`) that
    the node's ranks poll (a gloo header per bucket took milliseconds each on a busy node).

    Only the reader writes it, only after the bucket's pages are resident; what the
    ranks then read is the files', never bytes the reader wrote, so no memory order
    between the word and other data is needed.
    """

    NBYTES = 4096
    """``[read, failed, buckets, bytes, plan]`` (five int64: the reader's plan's buckets and
    bytes, and a word of both that says they are there), then the error message (UTF-8, cut
    to fit)."""

    _TEXT = 40

    def __init__(self, data: torch.Tensor, sender: str) -> None:
        import torch

        self._bytes = data[: self.NBYTES]
        self._words = self._bytes[: self._TEXT].view(torch.int64)
        self._sender = sender

    def plan(self, plan: Plan) -> None:
        """The reader's plan, which the ranks :meth:`check` against theirs."""
        self._words[2], self._words[3] = len(plan.buckets), plan.nbytes
        self._words[4] = _fingerprint(plan)  # one word: read alone, it says it all

    def check(self, plan: Plan, board: Board) -> None:
        """Once the reader has said its plan (watching the board), raise a
        :class:`~megastart.distributed.CollectiveError` if ``plan`` is not the reader's: each
        rank takes its slices by its own plan, and would wait for buckets that never come."""
        board.wait(
            polled_locally(lambda: bool(int(self._words[4]))),
            f"{self._sender} to say its plan",
            peer=True,
        )
        if int(self._words[4]) != _fingerprint(plan):
            theirs = int(self._words[2]), int(self._words[3])
            raise CollectiveError(
                f"{self._sender} planned {theirs[0]} buckets of {theirs[1]} bytes where this rank "
                f"planned {len(plan.buckets)} of {plan.nbytes}: the ranks' plans differ; nothing "
                "was copied"
            )

    def reached(self, read: int) -> bool:
        """Whether the reader has said the first ``read`` buckets are in the page cache (one
        look, no wait)."""
        return int(self._words[0]) >= read

    def publish(self, read: int) -> None:
        """The first ``read`` buckets of the plan are in the page cache."""
        self._words[0] = read

    def fail(self, message: str) -> None:
        """The reader failed: every rank waiting raises ``message`` as a :class:`ReaderError`."""
        import torch

        data = message.encode()[: self.NBYTES - self._TEXT]
        start = self._TEXT
        self._bytes[start : start + len(data)] = torch.frombuffer(
            bytearray(data), dtype=torch.uint8
        )
        self._words[1] = len(data)

    def wait(self, read: int, board: Board) -> None:
        """Until the first ``read`` buckets are in the page cache (watching the board).

        Polled every 50 microseconds at first, then less often, up to every 2 ms
        (:func:`~megastart.distributed.polled_locally`): a rank waits here only when it is
        ahead of the reader.
        """

        def reached() -> bool:
            if int(self._words[0]) >= read:
                return True
            failed = int(self._words[1])
            if failed:
                start = self._TEXT
                text = bytes(self._bytes[start : start + failed].numpy()).decode(errors="replace")
                raise ReaderError(text)
            return False

        board.wait(
            polled_locally(reached),
            f"{self._sender} to read bucket {read} of the plan",
            peer=True,
        )


def _fingerprint(plan: Plan) -> int:
    """A plan's buckets and bytes in one non-zero word (ints hash alike in every process)."""
    return (hash((len(plan.buckets), plan.nbytes)) & (2**62 - 1)) | 2**62
