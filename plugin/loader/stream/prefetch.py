"""The reader's read-ahead: a background thread reads the next buckets while the current one
is sent and copied.

A background thread on the reader reads bucket *i + 1* while
bucket *i* is sent and copied, the parts of one bucket on up to
:data:`READ_THREADS` threads at once (one thread copies out of the page cache
at one core's speed). It reads in the plan's file order and leaves
read-ahead to the kernel on a cold page cache (an explicit
``POSIX_FADV_WILLNEED`` of the next bucket made cold loads slower; one pass
over each file filling interleaved buckets side by side was no faster).
Headers stay synchronous, and a header announces only a payload that will be
sent: when the reader fails, it first finishes the broadcasts in flight, then
sends the error, so no rank is left waiting on a payload that never comes.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from megastart.distributed import Board
from megastart.loader.checkpoint import TensorReader
from megastart.loader.plan.buckets import Bucket, Plan, Slot

if TYPE_CHECKING:
    import torch

READ_THREADS = min(8, os.cpu_count() or 1)
"""Threads of the reader that read one bucket's parts at once (see :func:`fill`)."""

READ_PART_BYTES = 4 * 2**20
"""Bytes one read thread copies at a time: a bucket's slots are split into row ranges of
about this size and read in parallel."""


Fetched = TypeVar("Fetched")


class Prefetcher(Generic[Fetched]):
    """Fetches the plan's buckets (or those of ``indices``) in a background thread, ahead of
    the sender.

    ``fetch(index, buffer, pool)`` reads bucket ``index`` of the plan, using buffer
    ``buffer`` (if it needs one) and ``pool``'s threads, and returns what the sender
    takes: a buffer's bytes, or the bucket's pages made resident in the page
    cache. The ``buffers`` take turns, in the order they are released: one is
    filled while the others are sent (on CPU, gloo sends straight from them),
    copied to the GPU, or read by the node's other ranks; so the read-ahead is
    at most ``buffers`` buckets.
    """

    def __init__(
        self,
        reader: TensorReader,
        plan: Plan,
        fetch: Callable[[int, int, Executor], Fetched],
        buffers: int,
        *,
        board: Board,
        indices: Sequence[int] | None = None,
    ) -> None:
        self._reader = reader
        self._indices = range(len(plan.buckets)) if indices is None else indices
        self._fetch = fetch
        self._board = board
        self._closed = threading.Event()
        self._free: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self._ready: queue.Queue[tuple[int, Fetched | None, BaseException | None]] = queue.Queue()
        for buffer in range(buffers):
            self._free.put((buffer, None))
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="megastart-read")
        self._thread = threading.Thread(
            target=self._run, name="megastart-rank0-loader-read", daemon=True
        )
        self._thread.start()

    def next(self) -> tuple[int, Fetched]:
        """The next fetched bucket and its buffer; re-raises the read error; a read that stalls
        past ``timeout_s`` raises :class:`~megastart.distributed.Stalled`, naming the tensor."""
        got: list[tuple[int, Fetched | None, BaseException | None]] = []

        def ready(slice_s: float) -> bool:
            try:
                got.append(self._ready.get(timeout=slice_s))
            except queue.Empty:
                return False
            return True

        self._board.wait(ready, self._reading)
        buffer, fetched, error = got[0]
        if error is not None:
            raise error
        assert fetched is not None
        return buffer, fetched

    def release(self, buffer: int, copied: Any = None) -> None:
        """Give ``buffer`` back for the next read, once the CUDA event ``copied`` (if any) has passed.

        A copy to the GPU runs asynchronously; the read thread waits for that
        copy alone, not the sender's whole stream.
        """
        self._free.put((buffer, copied))

    def close(self) -> None:
        """Stop reading. Does not wait: a read stalled in the kernel ends (and the read thread
        closes the files) whenever the storage answers; the load has failed by then."""
        self._closed.set()
        self._free.put(None)

    def _reading(self) -> str:
        entry = self._reader.reading
        what = "the next bucket" if entry is None else f"tensor {entry.name!r} from {entry.file!r}"
        return f"the reader's read of {what} (the storage did not answer)"

    def _run(self) -> None:
        try:
            for index in self._indices:
                free = self._free.get()
                if free is None or self._closed.is_set():
                    return
                buffer, copied = free
                try:
                    if copied is not None:
                        copied.synchronize()
                    fetched = self._fetch(index, buffer, self._pool)
                except BaseException as e:  # handed to the sender, which tells every rank
                    self._ready.put((buffer, None, e))
                    return
                self._ready.put((buffer, fetched, None))
                del fetched  # the sender holds it alone: a mapping goes when the sender is done
        finally:  # the reads of a failed bucket end first: then no read uses the files
            self._pool.shutdown(cancel_futures=True)
            self._reader.close()


def fill(reader: TensorReader, bucket: Bucket, buffer: torch.Tensor, pool: Executor) -> None:
    """Read every slot of ``bucket`` (a tensor or its rows) into ``buffer``, in the slot's dtype.

    The slots are read in row ranges of about :data:`READ_PART_BYTES` by ``pool``'s threads at
    once (the reads release the GIL): one thread copies out of the page cache at a few GB/s,
    a core's memory bandwidth, and a storage device serves several reads in flight faster than
    one. Pickle checkpoints are read one slot at a time.
    """
    if reader.meta.format != "safetensors":
        for slot in bucket.slots:
            reader.read_into(
                reader.meta.tensors[slot.name], slot_view(buffer, slot), slot.rows.start
            )
        return
    reads = []
    for slot in bucket.slots:
        entry, view = reader.meta.tensors[slot.name], slot_view(buffer, slot)
        rows = view.shape[0] if view.dim() else 1
        step = max(1, rows * READ_PART_BYTES // max(slot.nbytes, 1))
        for first in range(0, rows, step):
            part = view[first : first + step] if view.dim() else view
            reads.append(pool.submit(reader.read_into, entry, part, slot.rows.start + first))
    for read in reads:
        read.result()


def slot_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The typed, shaped view of one slot inside a byte buffer."""
    import torch

    raw = buffer[slot.offset : slot.offset + slot.nbytes]
    return raw.view(getattr(torch, slot.dtype)).view(slot.shape)
