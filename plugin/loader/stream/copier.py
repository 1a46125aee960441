"""How a rank copies its slices into its parameters; into one GPU near its link.

Into CPU parameters, a plain copy. Into CUDA parameters, one of three ways per
piece, the fastest that applies:

* from a page-locked buffer of the loader (a contiguous piece): straight, a DMA;
* from the load's mappings of the files, where the piece is contiguous, in the
  parameter's dtype, and its blocks are registered with CUDA already
  (:mod:`megastart.loader.stream.registration`, ``rank0_loader.cuda_copy=registered``):
  straight, a DMA out of the page cache, no CPU copy;
* any other (a strided row-parallel slice, a dtype conversion, a block not
  registered yet or refused): through the rank's staging ring, filled on
  :func:`~megastart.loader.stream.staging.copy_threads` threads
  (:mod:`megastart.loader.stream.staging`).

A contiguous piece the caller knows to be page-locked goes straight; asking CUDA
instead (``Tensor.is_pinned``) costs a round trip to the driver per piece. A
refusal to page-lock the staging ring (the locked-memory limit) is one log line:
the copies then run from pageable memory, slower, and the load goes on.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from megastart.loader.stream import registration
from megastart.loader.stream.landing import Landing
from megastart.loader.stream.staging import CHUNK_BYTES, Fence, Ring, chunk_count

if TYPE_CHECKING:
    import torch

    from megastart.loader.checkpoint import CheckpointMeta
    from megastart.loader.mapping.needs import Need
    from megastart.loader.mapping.transforms import Shard
    from megastart.loader.plan.buckets import Plan, Slot
    from megastart.loader.stream.mappings import FileMappings

log = logging.getLogger("megastart")


class Copier:
    """Copies host pieces into one rank's parameters.

    Use :meth:`batch` around the copies of a bucket: it returns once each of
    them has read its source, so a buffer may be refilled then (the load's file
    mappings stay until the copier closes). Copies into CUDA may still be in
    flight after it; :meth:`close` waits for them.
    """

    def __init__(self, device: torch.device, threads: int) -> None:
        self._device = device
        self._threads = threads
        self._memory: list[torch.Tensor] = []
        """The staging ring's chunks (page-locked unless CUDA refused)."""
        cuda = device.type == "cuda"
        self._pool = ThreadPoolExecutor(threads, "megastart-copy") if cuda and threads > 1 else None
        self._direct = False
        """A copy of this batch reads a page-locked buffer straight from the GPU."""
        self._ring: Ring | None = None
        self._locked: list[torch.Tensor] = []
        self._driver: registration.Driver | None = None
        self._registrations: registration.Registrations | None = None
        self.registered_bytes = 0
        """Bytes copied straight out of registered mappings."""
        if cuda:
            try:
                self._lock_ring(chunk_count(threads))
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> Copier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def driver(self) -> registration.Driver:
        """What registers host memory with CUDA for this rank: the staging ring, the page
        cache's blocks, the node's shared segments (CUDA parameters only)."""
        assert self._driver is not None, "a copier into CPU parameters registers nothing"
        return self._driver

    def register_ahead(
        self, mappings: FileMappings, plan: Plan, mine: Callable[[Any], list[Slot]]
    ) -> None:
        """Start registering the blocks of ``mappings`` holding the slots ``mine`` picks (those a
        copy takes straight: :meth:`~megastart.loader.stream.stream.Stream.straight_slots`), CUDA only."""
        from megastart.loader.stream.mappings import drop_pages, resident

        if self._device.type != "cuda" or self._registrations is not None:
            return
        blocks = registration.blocks_in_order(mappings, plan, mine)
        self._registrations = registration.Registrations(
            self._driver or registration.cuda_driver(self._device),
            blocks,
            lambda block: resident(block.mapping, block.offset, block.nbytes),
            lambda block: drop_pages(block.mapping, block.offset, block.nbytes),
        )

    def landing(
        self,
        meta: CheckpointMeta,
        consumers: dict[str, list[tuple[Need, int]]],
        tensors: dict[tuple[int, str], torch.Tensor],
        shard: Shard,
    ) -> Landing:
        """Where this rank's slots land to be cut on its device, through the staging ring's
        chunks and threads (:mod:`megastart.loader.stream.landing`)."""
        args = (meta, consumers, tensors, shard, self._memory, self._pool, self._threads)
        return Landing(self._device, *args)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Copies made inside have read their sources when it ends (a thread's error is raised
        then, unless the block raised first)."""
        import torch

        try:
            yield
            if self._ring is not None:
                self._ring.flush()
        except BaseException:
            if self._ring is not None:
                self._ring.abandon()
            raise
        if self._direct:
            torch.cuda.current_stream().synchronize()
            self._direct = False

    def copy(self, target: torch.Tensor, source: torch.Tensor, page_locked: bool) -> None:
        """``target[...] = source`` (converting the dtype), inside a :meth:`batch`;
        ``page_locked``: ``source`` is in memory registered with CUDA."""
        if target.device.type != "cuda" or source.device == target.device:
            target.copy_(source)
        elif page_locked and source.is_contiguous():
            target.copy_(source, non_blocking=True)
            self._direct = True
        elif self._from_registered(target, source):
            return
        elif self._ring is None or not self._ring.put(target, source):
            target.copy_(source)  # a row larger than a chunk: from pageable memory

    def close(self) -> None:
        """Wait for every copy, stop the threads, unregister what was registered (on every
        way out) and free the staging ring."""
        import torch

        try:
            if self._ring is not None:
                self._ring.abandon()
            if self._pool is not None:
                self._pool.shutdown()
            if self._device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        finally:
            try:
                if self._registrations is not None:
                    self._registrations.close()
                    self._log_routes(self._registrations)
            finally:
                if self._locked:
                    driver, locked = self.driver, list(self._locked)
                    registration.on_own_thread(
                        lambda: [driver.unregister(chunk.data_ptr()) for chunk in locked]
                    )
                self._locked.clear()
                self._ring = None  # each chunk is unmapped with its last view
                self._memory = []

    def _log_routes(self, registrations: registration.Registrations) -> None:
        """One line: how this rank's bytes reached the GPU, and what registering cost."""
        staged = self._ring.staged_bytes if self._ring is not None else 0
        log.info(
            "megastart: rank0_loader copied %.2f GB straight out of the registered page cache "
            "(%.2f GB registered in %.3f s on its own thread, alongside the copies) and %.2f GB "
            "through page-locked staging",
            self.registered_bytes / 1e9,
            registrations.nbytes / 1e9,
            registrations.seconds,
            staged / 1e9,
        )

    def _from_registered(self, target: torch.Tensor, source: torch.Tensor) -> bool:
        """Copy straight out of a registered mapping, if ``source`` lies in registered blocks
        and needs no conversion."""
        import torch

        registrations = self._registrations
        if (
            registrations is None
            or source.dtype != target.dtype
            or not source.is_contiguous()
            or not target.is_contiguous()
        ):
            return False
        nbytes = source.numel() * source.element_size()
        spans = registrations.covering(source.data_ptr(), nbytes)
        if spans is None:
            return False
        src, dst = source.reshape(-1).view(torch.uint8), target.reshape(-1).view(torch.uint8)
        for offset, length in spans:
            dst[offset : offset + length].copy_(src[offset : offset + length], non_blocking=True)
        self.registered_bytes += nbytes
        return True

    def _lock_ring(self, chunks: int) -> None:
        """The staging ring, page-locked; pageable (one log line) where CUDA refuses."""
        import torch

        # page-aligned memory of its own, unmapped with its last view
        memory = [
            torch.frombuffer(mmap.mmap(-1, CHUNK_BYTES), dtype=torch.uint8) for _ in range(chunks)
        ]
        self._driver = driver = registration.cuda_driver(self._device)
        refused = registration.on_own_thread(lambda: _page_lock_all(driver, memory, self._locked))
        if refused:
            log.warning(
                "megastart: rank0_loader stages its copies into CUDA in pageable memory "
                "(slower): %s (the locked-memory limit, ulimit -l)",
                refused,
            )
        self._memory = memory
        self._ring = Ring(memory, self._pool, _send_to_gpu)


def _page_lock_all(
    driver: registration.Driver, memory: list[torch.Tensor], locked: list[torch.Tensor]
) -> str:
    """Page-lock every chunk of ``memory`` (appending each to ``locked``), or none: the
    refusal (``""``: none)."""
    for chunk in memory:
        error = driver.register(chunk.data_ptr(), chunk.numel(), registration.REGISTER_PORTABLE)
        if error:
            for done in locked:
                driver.unregister(done.data_ptr())
            locked.clear()
            return (
                f"cudaHostRegister of a {chunk.numel()}-byte staging chunk failed (error {error})"
            )
        locked.append(chunk)
    return ""


def _send_to_gpu(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Fence:
    """Start the copies of a full chunk into the GPU; the event after them."""
    import torch

    for target, staged in pairs:
        target.copy_(staged, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return copied
