"""The load's file mappings registered with CUDA, read-only, ahead of the copies out of them.

A copy into CUDA from a registered range is one DMA at the link's rate, with no
CPU copy; registering costs about as long again (issue #40, an H100: copies at
55.6 GB/s, 26-27 GB/s with the registration counted, serially). So a thread of
its own registers the blocks of the files holding the pieces this rank copies
straight, in the order it copies them, while the copies run: a copy whose blocks are
registered goes straight, any other through the staging ring (:mod:`megastart.loader.stream.staging`).

Only pages in the page cache are registered: pinning the others would read them
from the storage outside the reader, who reads each byte once and owns its errors. So
the route serves warm loads; a block not resident when its turn comes is left to the
staging ring. Only contiguous pieces in the checkpoint's dtype go straight (a row-parallel
slice's columns, or a conversion, go through the ring): only their slots' blocks are
registered (:meth:`~megastart.loader.stream.stream.Stream.straight_slots`), no page pinned that no
copy reads.

Every block registered is unregistered when the load ends, whichever way it ends
(:meth:`Registrations.close`, from the copier's close). A driver that refuses (a
locked-memory limit, a platform without read-only registration) stops the
registration with one log line: the copies go through the staging ring and the
load goes on. Every CUDA runtime call is made on the registration thread: a
refused call sets its thread's last CUDA error, which torch would otherwise raise
at that thread's next kernel launch.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from megastart.loader.plan.buckets import Plan, Slot
    from megastart.loader.stream.mappings import FileMappings

log = logging.getLogger("megastart")

BLOCK_BYTES = 64 << 20
"""The unit of registration: each file's mapping in blocks of this size (the last one
shorter), each registered at most once, so no two registrations overlap."""
LEAD_BLOCKS = 2
"""Blocks registered ahead of the last one a copy reached: the lead bounds how far the
registration runs ahead of the copies. Blocks stay registered (their page-cache pages pinned)
until the load ends: up to every block holding this rank's rows."""
REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context, whichever thread registered."""
REGISTER_READ_ONLY = 8
"""``cudaHostRegisterReadOnly``: the GPU only reads it; the pages stay the page cache's."""


class Block(NamedTuple):
    """A block of a file's mapping."""

    address: int
    nbytes: int
    mapping: Any
    """The mapping it is part of (a ``uint8`` tensor), kept alive while it is registered."""
    offset: int
    """Where the block starts in the mapping."""


class Driver(Protocol):
    """Registers host memory with the GPU: each call returns the CUDA error code (0: done)."""

    def register(self, address: int, nbytes: int, flags: int) -> int: ...

    def unregister(self, address: int) -> int: ...


class CudaDriver:
    """``cudaHostRegister`` and ``cudaHostUnregister`` through torch's bindings of the CUDA
    runtime, with ``device`` current on the calling thread (a thread with none would make
    a context on the first GPU)."""

    def __init__(self, device: int) -> None:
        self._device = device
        self._bound = threading.local()
        """Whether the calling thread has made ``device`` current (a thread's id is reused by
        the next thread once it ends: a set of ids would skip the new thread's binding)."""

    def register(self, address: int, nbytes: int, flags: int) -> int:
        import torch

        self._bind()
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags))

    def unregister(self, address: int) -> int:
        import torch

        self._bind()
        return int(torch.cuda.cudart().cudaHostUnregister(address))

    def _bind(self) -> None:
        import torch

        if not getattr(self._bound, "done", False):
            torch.cuda.set_device(self._device)
            self._bound.done = True


T = TypeVar("T")


def on_own_thread(call: Callable[[], T]) -> T:
    """``call()`` (CUDA runtime calls) on a thread of its own: a refused call sets its thread's
    last CUDA error, which torch would raise at the caller's next kernel launch."""
    with ThreadPoolExecutor(1, "megastart-page-lock") as thread:
        return thread.submit(call).result()


def cuda_driver(device: torch.device) -> Driver:
    """The driver the loader registers with, for parameters on ``device``."""
    import torch

    return CudaDriver(device.index if device.index is not None else torch.cuda.current_device())


def blocks_in_order(
    mappings: FileMappings, plan: Plan, mine: Callable[[Any], list[Slot]]
) -> list[Block]:
    """The blocks of the files holding this rank's slots, in the order the stream copies them."""
    seen: set[tuple[str, int]] = set()
    out: list[Block] = []
    meta = mappings.meta
    for bucket in plan.buckets:
        for slot in mine(bucket):
            entry = meta.tensors[slot.name].row_range(slot.rows.start, slot.rows.stop)
            if entry.end <= entry.start:
                continue
            data = mappings[entry.file]
            length = -(-data.numel() // mmap.PAGESIZE) * mmap.PAGESIZE
            for index in range(entry.start // BLOCK_BYTES, (entry.end - 1) // BLOCK_BYTES + 1):
                if (entry.file, index) in seen:
                    continue
                seen.add((entry.file, index))
                offset = index * BLOCK_BYTES
                nbytes = min(BLOCK_BYTES, length - offset)
                out.append(Block(data.data_ptr() + offset, nbytes, data, offset))
    return out


class Registrations:
    """:class:`Block` s registered on a thread of their own, in order, while the copies run.

    :param resident: whether a block's pages are all in the page cache (the others are
        left unregistered).
    :param unmap: drops a block's pages from the process's page tables once registered
        (pinning maps them all, the other ranks' rows too: a rank's memory would count
        every block it registered until the load ends; the pages stay pinned).
    """

    def __init__(
        self,
        driver: Driver,
        blocks: Sequence[Block],
        resident: Callable[[Block], bool],
        unmap: Callable[[Block], None] = lambda block: None,
    ) -> None:
        self._driver = driver
        self._by_address = sorted(blocks, key=lambda block: block.address)
        self._starts = [block.address for block in self._by_address]
        self._order = {block.address: i for i, block in enumerate(blocks)}
        self._registered: dict[int, Block] = {}
        self._reached = -1
        """The furthest block, in the order of use, that a copy has asked for."""
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self.refused = ""
        """The driver's refusal (``""``: none)."""
        self.nbytes = 0
        """Bytes registered."""
        self.seconds = 0.0
        """Time spent registering (on the registration thread, overlapped with the copies)."""
        self._worker = ThreadPoolExecutor(1, "megastart-register")
        self._unmap = unmap
        self._work = self._worker.submit(self._register, list(blocks), resident)

    def covering(self, address: int, nbytes: int) -> list[tuple[int, int]] | None:
        """``[address, address + nbytes)`` as (offset, length) spans, one per registered block
        it crosses; ``None`` where any part of it is not registered (yet): the copy then goes
        through the staging ring, which paces the copies while the registration catches up
        (a DMA is queued in microseconds, a block registered in milliseconds), so the two
        routes share the work."""
        index = bisect.bisect_right(self._starts, address) - 1
        spans: list[tuple[int, int]] = []
        position, end = address, address + nbytes
        while position < end:
            if index < 0 or index >= len(self._by_address):
                return None
            block = self._by_address[index]
            stop = block.address + block.nbytes
            if not block.address <= position < stop:
                return None
            self._reach(block)
            if block.address not in self._registered:
                return None
            spans.append((position - address, min(end, stop) - position))
            position = min(end, stop)
            index += 1
        return spans

    def _reach(self, block: Block) -> None:
        """A copy asked for ``block``: the registration may go :data:`LEAD_BLOCKS` past it."""
        order = self._order[block.address]
        if order > self._reached:
            with self._progress:
                self._reached = order
                self._progress.notify()

    def close(self) -> None:
        """Stop registering and unregister every block registered: call it once no copy out
        of them is in flight. Unregisters even when the registration thread failed, whose
        error is raised then."""
        self._stop.set()
        with self._progress:
            self._progress.notify()
        try:
            self._work.result()
        finally:
            try:
                self._worker.submit(self._unregister_all).result()
            finally:
                self._worker.shutdown()

    def _register(self, blocks: Iterable[Block], resident: Callable[[Block], bool]) -> None:
        for order, block in enumerate(blocks):
            with self._progress:
                while order > self._reached + LEAD_BLOCKS and not self._stop.is_set():
                    self._progress.wait()
            if self._stop.is_set():
                return
            self._register_one(block, resident)
            if self.refused:
                return

    def _register_one(self, block: Block, resident: Callable[[Block], bool]) -> None:
        """Register ``block`` if its pages are resident (a refusal: :attr:`refused`)."""
        if not resident(block):
            return
        start = time.perf_counter()
        flags = REGISTER_PORTABLE | REGISTER_READ_ONLY
        error = self._driver.register(block.address, block.nbytes, flags)
        self.seconds += time.perf_counter() - start
        if error:
            self.refused = f"cudaHostRegister of {block.nbytes} bytes failed (error {error})"
            log.warning(
                "megastart: rank0_loader copies through page-locked staging instead of "
                "the registered page cache: %s (the locked-memory limit, ulimit -l, or a "
                "platform without read-only registration)",
                self.refused,
            )
            return
        self._registered[block.address] = block
        self.nbytes += block.nbytes
        self._unmap(block)

    def _unregister_all(self) -> None:
        failed = []
        for address in list(self._registered):
            if self._driver.unregister(address):
                failed.append(address)
            del self._registered[address]
        if failed:
            log.warning(
                "megastart: rank0_loader could not unregister %d block(s) of the page cache "
                "from CUDA",
                len(failed),
            )
