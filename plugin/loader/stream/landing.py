"""Into CUDA parameters: a rank's ranges of a bucket cross the link whole and are cut on the GPU.

For each slot of a bucket the rank takes, the bytes its pieces lie in (from the first
to the last byte any of its transforms' pieces views: a column-parallel rank's rows,
a row-parallel rank's rows whole, its columns among them) are read by ``pread``
(:class:`~megastart.loader.stream.preads.Descriptors`: the files' pages never enter
the rank's page tables) into the rank's page-locked chunks, on several threads, in
ranges of up to a chunk, and copied into one device buffer of the rank's bucket
(a buffer of the node, page-locked already, is copied from straight). The
transforms then run on that buffer as they run on a host one: the strided columns,
QKV and gate/up interleaving, dtype conversion and FP8 / MXFP4 dequantisation are
torch operations on the GPU, into the parameters (:meth:`Landed.view`).

The device buffer holds one bucket of the rank's slots in the files' dtype (a bucket,
more only where the checkpoint's dtype is wider than the one its slots travel in);
it and the chunks are freed by :meth:`Landing.close`. The link carries the rows a
row-parallel rank's columns lie in whole: torch has no pitched copy, and a ``pread``
of each row's columns would be a system call per row.

The same code runs on CPU tensors (``rank0_loader.cuda_copy=preads`` with CPU
parameters): the chunks are plain memory, and the copies are plain copies.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from megastart.loader.checkpoint import ITEMSIZE, CheckpointMeta
from megastart.loader.mapping.needs import Need
from megastart.loader.mapping.transforms import TRANSFORMS, Shard
from megastart.loader.stream.pagecache import Window
from megastart.loader.stream.staging import _ALIGN, CHUNK_BYTES, Fence

if TYPE_CHECKING:
    import torch

    from megastart.loader.plan.buckets import Slot
    from megastart.loader.stream.preads import Descriptors

log = logging.getLogger("megastart")

Read = tuple[str, int, int, int, int]
"""One ``pread`` of a chunk: file, offset in it, bytes, offset in the chunk, offset on the device."""


def spans(
    slot: Slot,
    dtype: str,
    consumers: Sequence[tuple[Need, int]],
    tensors: dict[tuple[int, str], torch.Tensor],
    shard: Shard,
) -> tuple[int, int]:
    """Bytes ``[first, end)`` of ``slot`` (held in ``dtype``) that this rank's pieces of it lie
    in, worked out on meta tensors; the whole slot where a piece is not a view of it (scales,
    a quantised weight, a computed piece)."""
    import torch

    held = torch.empty(slot.shape, dtype=getattr(torch, dtype), device="meta")
    size = held.element_size()
    whole = (0, held.numel() * size)
    first, end = whole[1], 0
    for need, index in consumers:
        if index >= len(need.hf) or (need.scales and need.scales[index]):
            return whole
        param = tensors[(need.param.chunk, need.param.local_name)]
        for _, _, piece in TRANSFORMS[need.transform].blocks(
            index, held, slot.rows, need.param.shape, shard
        ):
            if (piece is not held and piece._base is not held) or piece.dtype != held.dtype:
                return whole
            if piece.numel() == 0 or param.numel() == 0:
                continue
            extent = 1 + sum((n - 1) * s for n, s in zip(piece.shape, piece.stride(), strict=True))
            first = min(first, piece.storage_offset() * size)
            end = max(end, (piece.storage_offset() + extent) * size)
    return (first, end) if end > first else (0, 0)


@dataclass(frozen=True, slots=True)
class Landed:
    """A bucket's slots on the parameters' device (:meth:`Landing.land`): a source of
    :meth:`~megastart.loader.stream.stream.Stream.apply`."""

    data: torch.Tensor
    places: dict[str, tuple[int, str]]
    """Per slot: where its bytes start in :attr:`data`, and the dtype they are held in."""
    page_locked: ClassVar[bool] = False

    def read_into(self, target: torch.Tensor, piece: torch.Tensor) -> bool:
        return False

    def view(self, slot: Slot) -> torch.Tensor:
        import torch

        at, dtype = self.places[slot.name]
        nbytes = math.prod(slot.shape) * ITEMSIZE[dtype]
        return self.data[at : at + nbytes].view(getattr(torch, dtype)).view(slot.shape)


class Landing:
    """A rank's device buffer of one bucket, and the chunks its reads cross in.

    :param chunks: page-locked chunks (CUDA), or none: plain ones of its own (CPU).
    :param pool: the threads that read into the chunks (``None``: this one).
    """

    def __init__(
        self,
        device: torch.device,
        meta: CheckpointMeta,
        consumers: dict[str, list[tuple[Need, int]]],
        tensors: dict[tuple[int, str], torch.Tensor],
        shard: Shard,
        chunks: list[torch.Tensor],
        pool: Executor | None,
        threads: int,
    ) -> None:
        import torch

        self.device, self.meta, self.consumers = device, meta, consumers
        self._spans = functools.cache(
            lambda slot, dtype: spans(slot, dtype, consumers[slot.name], tensors, shard)
        )
        self._own_pool = None
        if not chunks:  # CPU parameters: plain memory, threads of its own
            chunks = [torch.empty(CHUNK_BYTES, dtype=torch.uint8) for _ in range(2 * threads)]
            pool = self._own_pool = (
                ThreadPoolExecutor(threads, "megastart-read") if threads > 1 else None
            )
        self._chunks, self._pool = chunks, pool
        self._threads = threads if pool is not None else 1
        self._fences: list[Fence | None] = [None] * len(chunks)
        self._next = 0
        self._data: torch.Tensor | None = None
        self.peak_bytes = 0
        """The device buffer's size at its largest."""
        self.crossed_bytes = 0
        """Bytes copied into the device buffer."""

    def land(self, slots: Iterable[Slot], source: Any) -> Landed:
        """The ranges of ``slots`` this rank's pieces lie in, from ``source`` (a
        :class:`~megastart.loader.stream.pagecache.Window`: read from the files; a buffer:
        copied) into the device buffer; returns once ``source`` has been read."""
        window = source if isinstance(source, Window) else None
        places: dict[str, tuple[int, str]] = {}
        ranges: list[tuple[int, int, int, int, Slot]] = []  # at, first, end, held bytes, slot
        total = 0
        for slot in slots:
            if slot.name not in self.consumers or slot.name in places:
                continue
            entry = window.entries[slot.name] if window is not None else None
            dtype = entry.dtype if entry is not None else slot.dtype
            first, end = self._spans(slot, dtype)
            held = entry.end - entry.start if entry is not None else slot.nbytes
            places[slot.name] = (total, dtype)
            ranges.append((total, first, end, held, slot))
            total += -(-held // _ALIGN) * _ALIGN
        data = self._buffer(total)
        if window is not None:
            reads = [
                (window.entries[slot.name].file, window.entries[slot.name].start, first, end, at)
                for at, first, end, _, slot in ranges
            ]
            self._read(window.mappings.files, reads, data)
        else:
            self._copy(
                source.data,
                [(slot.offset, first, end, at) for at, first, end, _, slot in ranges],
                data,
            )
        return Landed(data, places)

    def close(self) -> None:
        """Wait for the copies; free the device buffer; stop the threads of its own."""
        import torch

        try:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            self._data = None
            log.info(
                "megastart: rank0_loader landed %.2f GB on %s (%d read threads) and cut it "
                "there, in a buffer of %.1f MiB at its peak",
                self.crossed_bytes / 1e9,
                self.device,
                self._threads,
                self.peak_bytes / 2**20,
            )
            if self._own_pool is not None:
                self._own_pool.shutdown()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        import torch

        if self._data is None or self._data.numel() < nbytes:
            self._data = None  # freed first: the peak is one buffer
            self._data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.peak_bytes = max(self.peak_bytes, nbytes)
        return self._data

    def _copy(
        self, host: torch.Tensor, ranges: list[tuple[int, int, int, int]], data: torch.Tensor
    ) -> None:
        """From a page-locked buffer of the node, straight; back once the copies have read it."""
        import torch

        for offset, first, end, at in ranges:
            data[at + first : at + end].copy_(
                host[offset + first : offset + end], non_blocking=True
            )
            self.crossed_bytes += end - first
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _read(
        self, files: Descriptors, reads: list[tuple[str, int, int, int, int]], data: torch.Tensor
    ) -> None:
        """By ``pread`` into the chunks, on the pool's threads, each chunk copied to the device
        once read (its next read waits for that copy); a read error is raised here, once no
        thread writes a chunk any more."""
        pending: deque[tuple[int, Future[Any] | None, list[Read]]] = deque()
        try:
            for job in _jobs(reads, self._chunks[0].numel()):
                if len(pending) == len(self._chunks):
                    self._send(*pending.popleft(), data)
                chunk, self._next = self._next, (self._next + 1) % len(self._chunks)
                fence, self._fences[chunk] = self._fences[chunk], None
                if fence is not None:
                    fence.synchronize()
                target = self._chunks[chunk]
                if self._pool is None:
                    _pread(files, target, job)
                    pending.append((chunk, None, job))
                else:
                    pending.append((chunk, self._pool.submit(_pread, files, target, job), job))
            while pending:
                self._send(*pending.popleft(), data)
        except BaseException:
            wait_all([fill for _, fill, _ in pending if fill is not None])
            raise

    def _send(
        self, chunk: int, fill: Future[Any] | None, job: list[Read], data: torch.Tensor
    ) -> None:
        import torch

        if fill is not None:
            fill.result()
        staged = self._chunks[chunk]
        for _, _, nbytes, offset, at in job:
            data[at : at + nbytes].copy_(staged[offset : offset + nbytes], non_blocking=True)
            self.crossed_bytes += nbytes
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
            self._fences[chunk] = copied


def _jobs(reads: list[tuple[str, int, int, int, int]], chunk_bytes: int) -> Iterator[list[Read]]:
    """The reads packed into chunks, back to back (a range larger than a chunk in parts)."""
    job: list[Read] = []
    used = 0
    for file, start, first, end, at in reads:
        while first < end:
            if used == chunk_bytes:
                yield job
                job, used = [], 0
            nbytes = min(end - first, chunk_bytes - used)
            job.append((file, start + first, nbytes, used, at + first))
            used = min(chunk_bytes, -(-(used + nbytes) // _ALIGN) * _ALIGN)
            first += nbytes
    if job:
        yield job


def _pread(files: Descriptors, chunk: torch.Tensor, job: list[Read]) -> None:
    for file, offset, nbytes, into, _ in job:
        files.read(file, offset, chunk[into : into + nbytes])
