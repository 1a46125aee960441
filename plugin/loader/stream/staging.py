"""Copies into one GPU through a rank's bounded staging chunks, filled on several threads.

From pageable memory (the page cache's pages, a strided row-parallel slice, a
dtype conversion) a copy into CUDA runs at the driver's staging rate, a fifth of
the link's. So the pieces of a bucket are packed, back to back, into a ring of
page-locked chunks of :data:`CHUNK_BYTES`; each full chunk is filled on a thread
of its own (a rank runs with ``torch.set_num_threads(1)``, torchrun's default:
one thread would fill at one core's rate) while the GPU copies the chunks filled
before; a chunk is refilled once its copies are done. Small pieces share a chunk,
so a bucket of norms costs a few copies, not one round trip each.

The ring knows nothing of CUDA: it takes its chunks and a function that sends a
full chunk's blocks to their targets (a non-blocking copy and an event on CUDA;
a plain copy into CPU tensors, which is how it is tested on a machine without a
GPU).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_all
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 4 << 20
"""Size of one staging chunk. A bucket (32 MiB by default) ends in a flush that waits for
its chunks' fills, so a bucket must span as many chunks as there are fill threads: 8 of
4 MiB. (On an H100 node 8 MiB chunks through rotating page-locked buffers ran at
10 / 38 / 52 GB/s on 1 / 4 / 8 threads, issue #40.)"""
MAX_THREADS = 8
"""Fill threads per rank at most: 8 threads reach the link's rate on one GPU."""
_ALIGN = 64
"""Byte alignment of each block in a chunk, so every dtype view of it is aligned."""


def copy_threads(ranks_on_node: int) -> int:
    """Fill threads of each of ``ranks_on_node`` ranks: its share of the cores this process
    may use, at least one, at most :data:`MAX_THREADS`."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(MAX_THREADS, cores // max(1, ranks_on_node)))


def chunk_count(threads: int) -> int:
    """Chunks in a rank's ring: two per thread, so that each thread fills one while the GPU
    copies the other (the staging's memory: ``chunk_count * CHUNK_BYTES`` per rank)."""
    return 2 * max(1, threads)


class Fence(Protocol):
    """What a send returns: waited for before its chunk is refilled (a CUDA event)."""

    def synchronize(self) -> None: ...


Send = Callable[[Sequence[tuple["torch.Tensor", "torch.Tensor"]]], Fence | None]
"""Copies each ``(target, staged)`` of a full chunk; returns what to wait for before the
chunk is refilled (``None``: the copies are done)."""


class Ring:
    """A rank's staging ring: :meth:`put` pieces, :meth:`flush` at the end of each bucket.

    After :meth:`flush` every source put has been read (its memory may be unmapped or
    refilled); the sends may still be in flight until :meth:`wait`.
    """

    def __init__(self, chunks: list[torch.Tensor], pool: Executor | None, send: Send) -> None:
        self._chunks = chunks
        self._pool = pool
        self._send = send
        self._blocks: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [
            [] for _ in chunks
        ]
        """Per chunk: (staged view, source block, target) of each block packed in it."""
        self._fills: list[Future[Any] | None] = [None] * len(chunks)
        self._fences: list[Fence | None] = [None] * len(chunks)
        self._sealed: deque[int] = deque()
        """Chunks being filled, in turn, each sent once it is full."""
        self._open: int | None = None
        self._offset = 0
        self._next = 0
        self.staged_bytes = 0
        """Bytes put through the ring."""

    def put(self, target: torch.Tensor, source: torch.Tensor) -> bool:
        """Stage ``target[...] = source`` (converting the dtype); ``False`` where a row does
        not fit a chunk (the caller copies it itself)."""
        row_bytes = source[0].numel() * target.element_size() if source.dim() else 0
        chunk_bytes = self._chunks[0].numel()
        if row_bytes == 0 or row_bytes > chunk_bytes:
            return False
        first, rows = 0, len(source)
        while first < rows:
            chunk = self._current()
            room = (chunk_bytes - self._offset) // row_bytes
            if room == 0:
                self._seal()
                continue
            count = min(room, rows - first)
            nbytes = count * row_bytes
            staged = self._chunks[chunk][self._offset : self._offset + nbytes]
            staged = staged.view(target.dtype).view((count, *source.shape[1:]))
            block = source[first : first + count]
            self._blocks[chunk].append((staged, block, target[first : first + count]))
            self._offset = -(-(self._offset + nbytes) // _ALIGN) * _ALIGN
            first += count
        self.staged_bytes += rows * row_bytes
        return True

    def flush(self) -> None:
        """Fill and send every chunk packed so far; a fill's error is raised here."""
        self._seal()
        while self._sealed:
            self._send_oldest()

    def wait(self) -> None:
        """Until every send is done."""
        for index, fence in enumerate(self._fences):
            if fence is not None:
                fence.synchronize()
                self._fences[index] = None

    def abandon(self) -> None:
        """Drop what is packed and not sent (the bucket failed), once the fills under way have
        ended: then no thread reads a source any more. Their errors are the bucket's echo."""
        wait_all([fill for fill in self._fills if fill is not None])
        for index in (*self._sealed, *(() if self._open is None else (self._open,))):
            self._blocks[index] = []
            self._fills[index] = None
        self._sealed.clear()
        self._open = None

    def _current(self) -> int:
        """The chunk being packed, opening the next one of the ring (once it is sent and its
        copies done) if none is."""
        if self._open is not None:
            return self._open
        chunk = self._next
        self._next = (chunk + 1) % len(self._chunks)
        while chunk in self._sealed:
            self._send_oldest()
        fence = self._fences[chunk]
        if fence is not None:
            fence.synchronize()
            self._fences[chunk] = None
        self._open, self._offset = chunk, 0
        return chunk

    def _seal(self) -> None:
        """Start filling the chunk being packed (on a thread, or here without a pool)."""
        chunk, self._open = self._open, None
        if chunk is None or not self._blocks[chunk]:
            return
        blocks = self._blocks[chunk]
        if self._pool is None:
            _fill(blocks)
        else:
            self._fills[chunk] = self._pool.submit(_fill, blocks)
        self._sealed.append(chunk)

    def _send_oldest(self) -> None:
        """Wait for the oldest sealed chunk to be full; send its blocks."""
        chunk = self._sealed.popleft()
        fill, self._fills[chunk] = self._fills[chunk], None
        blocks, self._blocks[chunk] = self._blocks[chunk], []
        if fill is not None:
            fill.result()
        self._fences[chunk] = self._send([(target, staged) for staged, _, target in blocks])


def _fill(blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    for staged, block, _ in blocks:
        staged.copy_(block)
