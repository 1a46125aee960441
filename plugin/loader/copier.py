"""How a rank copies its slices into CUDA parameters: through page-locked chunks, filled on a few threads.

Into CUDA parameters, a copy from pageable memory (a mapping of the files, or
a strided row-parallel slice of any buffer) runs at the driver's staging rate,
several times below what the same bytes reach from page-locked memory
(docs/performance.md has the figures). So each piece goes through :data:`CHUNKS` page-locked chunks of :data:`CHUNK_BYTES`
in turn, each filled on a thread of its own (:func:`copy_threads`: a rank
runs with ``torch.set_num_threads(1)``, torchrun's default, so one thread
would fill at a single core's rate) while the GPU copies those filled before;
the dtype conversion, if any, happens in the fill. A contiguous piece
the caller knows to be page-locked already (the loader's buffers are, with CUDA
parameters) goes straight; asking CUDA instead (``Tensor.is_pinned``) costs a
round trip to the driver per piece.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 8 << 20
"""Size of one page-locked chunk."""
CHUNKS = 4
"""Page-locked chunks per rank (32 MiB in all): up to this many filled at once."""


def copy_threads(ranks_on_node: int) -> int:
    """Threads filling chunks for each of ``ranks_on_node`` ranks: the cores this process
    may use, shared among the node's ranks, at most one per chunk."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(CHUNKS, cores // max(1, ranks_on_node)))


def page_lock(tensor: torch.Tensor, what: str) -> None:
    """Register ``tensor``'s host memory with CUDA (``cudaHostRegister``), so copies to
    the GPU read it at the link's rate with no staging copy of the driver's."""
    import torch

    nbytes = tensor.numel() * tensor.element_size()
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(error) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {what} ({nbytes} bytes) failed ({error}): raise the "
            "locked-memory limit (ulimit -l) or lower rank0_loader.bucket_mb"
        )


def page_unlock(tensor: torch.Tensor) -> None:
    """Undo :func:`page_lock` (the memory stays mapped)."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class Copier:
    """Copies host pieces into one rank's parameters (into CPU ones: a plain copy).

    Use :meth:`batch` around the copies of a bucket: it returns once each of
    them has read its source, so the source may be unmapped or refilled then.
    Copies into CUDA may still be in flight on the current stream after it;
    ``torch.cuda.current_stream().synchronize()`` waits for them.
    """

    def __init__(self, device: torch.device, threads: int) -> None:
        cuda = device.type == "cuda"
        self._pool = ThreadPoolExecutor(threads, "megastart-copy") if cuda and threads > 1 else None
        self._direct = False
        """A copy of this batch reads its page-locked source straight from the GPU."""
        self._chunks: list[torch.Tensor] = []
        self._filling: deque[_Fill] = deque()
        """Chunks being filled, in turn, each to be copied to the GPU once it is full."""
        self._copied: list[Any] = [None] * CHUNKS
        """Per chunk, the CUDA event of the last copy out of it (``None``: none yet)."""
        self._turn = 0
        if cuda:
            try:
                self._lock_chunks()
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> Copier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Copies made inside have read their sources when it ends (a thread's error is raised
        then, unless the block raised first)."""
        import torch

        try:
            yield
            while self._filling:
                self._send_oldest()
        except BaseException:
            self._abandon()
            raise
        if self._direct:
            torch.cuda.current_stream().synchronize()
            self._direct = False

    def copy(self, target: torch.Tensor, source: torch.Tensor, page_locked: bool) -> None:
        """``target[...] = source`` (converting the dtype), inside a :meth:`batch`;
        ``page_locked``: ``source`` is in memory registered with CUDA."""
        if target.device.type != "cuda":
            target.copy_(source)
        elif page_locked and source.is_contiguous():
            target.copy_(source, non_blocking=True)
            self._direct = True
        else:
            self._staged(target, source)

    def close(self) -> None:
        """Wait for every copy, stop the threads, free the page-locked chunks."""
        import torch

        self._abandon()
        if self._pool is not None:
            self._pool.shutdown()
        if self._chunks:
            torch.cuda.current_stream().synchronize()
            for chunk in self._chunks:
                page_unlock(chunk)
            self._chunks.clear()  # each is unmapped with its last view

    def _lock_chunks(self) -> None:
        import torch

        for _ in range(CHUNKS):  # page-aligned memory of its own, unmapped with its last view
            chunk = torch.frombuffer(mmap.mmap(-1, CHUNK_BYTES), dtype=torch.uint8)
            page_lock(chunk, "a staging chunk of the loader")
            self._chunks.append(chunk)

    def _staged(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy through the page-locked chunks, a chunk of rows at a time."""
        per_chunk = (
            CHUNK_BYTES // (source[0].numel() * target.element_size()) if source.dim() else 0
        )
        if per_chunk == 0:  # a scalar, or a row larger than a chunk: from pageable memory
            target.copy_(source)
            return
        for first in range(0, len(source), per_chunk):
            block = source[first : first + per_chunk]
            if len(self._filling) == CHUNKS:
                self._send_oldest()
            turn = self._turn
            self._turn = (turn + 1) % CHUNKS
            if self._copied[turn] is not None:
                self._copied[turn].synchronize()
            nbytes = block.numel() * target.element_size()
            staged = self._chunks[turn][:nbytes].view(target.dtype).view(block.shape)
            filled = self._pool.submit(staged.copy_, block) if self._pool else None
            if filled is None:
                staged.copy_(block)
            self._filling.append(_Fill(filled, staged, target[first : first + len(block)], turn))

    def _send_oldest(self) -> None:
        """Wait for the oldest chunk to be full; start its copy to the GPU."""
        import torch

        fill = self._filling.popleft()
        if fill.filled is not None:
            fill.filled.result()
        fill.target.copy_(fill.chunk, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._copied[fill.turn] = copied

    def _abandon(self) -> None:
        """Drop the chunks not sent to the GPU (the batch failed), once their fills have
        ended: then no thread reads a source any more. Their errors are the batch's echo."""
        wait_all([fill.filled for fill in self._filling if fill.filled is not None])
        self._filling.clear()


@dataclass(frozen=True, slots=True)
class _Fill:
    """A page-locked chunk being filled with a block of a piece, for ``target``."""

    filled: Future[Any] | None
    """The fill on a thread (``None``: filled already)."""
    chunk: torch.Tensor
    target: torch.Tensor
    turn: int
    """Which chunk."""
