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
of them. Each rank maps each file once for the whole load
(:class:`~megastart.loader.stream.mappings.FileMappings`) and copies what is resident at
once; only the ranges not resident wait for the reader, whose progress is a word of the
node's page (:class:`~megastart.loader.stream.frontier.Frontier`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from errno import EINTR
from typing import TYPE_CHECKING

from megastart.loader.checkpoint import ITEMSIZE, TensorEntry, TensorReader
from megastart.loader.plan.buckets import Slot
from megastart.loader.stream.mappings import (
    FAULT_AROUND,
    MADV_POPULATE_READ,
    FileMappings,
    drop_pages,
    libc,
    resident,
)
from megastart.loader.stream.preads import source_of

if TYPE_CHECKING:
    import torch


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
    while libc().madvise(address, ctypes.c_size_t(length), MADV_POPULATE_READ):
        errno = ctypes.get_errno()
        if errno != EINTR:
            raise OSError(
                errno,
                f"reading tensor {entry.name!r} from {entry.file!r} into the page cache "
                f"failed: {os.strerror(errno)}",
            )
