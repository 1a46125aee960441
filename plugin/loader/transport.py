"""Moving buckets between ranks: reader groups, headers, broadcasts between nodes, read-ahead.

**Why broadcast between nodes, and to whom.** Only some nodes need a given
tensor (a pipeline stage's, an expert-parallel rank's), so a scatter of
per-rank slices looks cheaper, but it makes the reader's link carry the
model once per data-parallel replica. A ring/tree broadcast carries each byte
over the reader's link once and reaches every node in about the time one link
needs. Each bucket holds tensors the same ranks need and is broadcast to the
leaders of their nodes only, in a process group of their own. Inside a node
no bytes travel over a socket: see :mod:`megastart.loader.route`.

**Protocol.** Per bucket, the sender broadcasts a header ``[status, nbytes,
slot]`` to its whole group (every node leader of the reader group; inside a
node, every rank of it), then, between nodes, the payload to the leaders
that need it. A reader that fails to read (I/O error, file changed under it,
a read that stalls) sends ``status = 1`` and the error message instead, so
every rank raises that message rather than waiting for bytes that never
come. A receiver checks every announced size against the plan's and its
buffer. Every wait is bounded by the group's timeout.

**Overlap.** A background thread on the reader reads bucket *i + 1* while
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
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megastart.distributed import OwnGroups
from megastart.loader.checkpoint import TensorReader
from megastart.loader.plan import Bucket, Plan, Slot

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_OK, _FAILED = 0, 1

IN_FLIGHT = 2
"""Payload broadcasts a rank has in flight at once; each holds a bucket-sized buffer."""

READ_THREADS = min(8, os.cpu_count() or 1)
"""Threads of the reader that read one bucket's parts at once (see :func:`fill`)."""


class ReaderError(RuntimeError):
    """The reader rank could not read a bucket; raised on every rank of its group."""


def node_key() -> tuple[str, int]:
    """This rank's node: host name and the global rank of the node's local rank 0.

    Honours ``LOCAL_RANK`` (torchrun, Ray, RankPool), so several "nodes" can be
    simulated on one host; without it, the host name alone decides.
    """
    import torch.distributed as dist

    local_rank = os.environ.get("LOCAL_RANK")
    first = dist.get_rank() - int(local_rank) if local_rank is not None else -1
    return socket.gethostname(), first


def reader_groups(reader: str, keys: Sequence[tuple[str, int]]) -> list[list[int]]:
    """Global ranks of each reader group, the reader first: one group, or one per node."""
    if reader == "global":
        return [list(range(len(keys)))]
    by_node: dict[tuple[str, int], list[int]] = {}
    for rank, key in enumerate(keys):
        by_node.setdefault(key, []).append(rank)
    return sorted(by_node.values())


def open_receiver_groups(
    receiver_sets: list[tuple[int, ...]], own: OwnGroups, *, backend: str
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group per set of global ranks (collective over WORLD); this rank's, by set.

    Every rank passes the same sets in the same order. Sets of one rank need no group.
    """
    import torch.distributed as dist

    mine = {}
    for ranks in receiver_sets:
        if len(ranks) > 1:
            group = own.new(ranks, backend=backend)
            if dist.get_rank() in ranks:
                mine[ranks] = group
    return mine


@dataclass(slots=True)
class Channel:
    """Broadcasts of one reader group: headers to all of it, payloads to a bucket's ranks."""

    group: dist.ProcessGroup
    """The loader's process group over the whole reader group: headers and errors."""
    src: int
    """Global rank of the group's reader."""
    device: torch.device
    """Where the collective's buffers live (CUDA for NCCL, CPU for gloo)."""
    receivers: dict[tuple[int, ...], dist.ProcessGroup]
    """The process groups this rank is in, by their global ranks (the reader first)."""

    def send(self, payload: torch.Tensor, ranks: tuple[int, ...]) -> dist.Work | None:
        """Announce ``payload`` to the whole group, then start its broadcast to ``ranks``.

        Returns the broadcast in flight (``None`` if no group holds ``ranks``):
        ``payload`` must stay untouched until it has been waited for.
        """
        self._header(_OK, payload.numel())
        if ranks in self.receivers:  # the reader alone in a group of one too: NCCL exercised
            return self._broadcast(payload, self.receivers[ranks], async_op=True)
        return None

    def announce(self, nbytes: int, slot: int) -> None:
        """Tell the group that a bucket of ``nbytes`` waits in shared slot ``slot`` (no payload)."""
        self._header(_OK, nbytes, slot)

    def send_error(self, message: str) -> None:
        import torch

        data = torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8).to(self.device)
        self._header(_FAILED, data.numel())
        self._broadcast(data, self.group)

    def receive(
        self, buffer: torch.Tensor, ranks: tuple[int, ...], nbytes: int
    ) -> tuple[torch.Tensor, dist.Work] | None:
        """Start receiving the next payload, of the plan's ``nbytes``, into ``buffer``
        (``None`` if it is not for this rank).

        Returns the payload's view of ``buffer`` and the broadcast in flight,
        which must be waited for before the payload is read. Raises
        :class:`ReaderError` if the reader failed, or announced another size:
        every rank of the group hears every header, so an error reaches the
        ranks a bucket skips too.
        """
        status, announced, _ = self._header(_OK, 0)
        self._check(status, announced, nbytes, buffer.numel())
        if ranks not in self.receivers:
            return None
        payload = buffer[:nbytes]
        return payload, self._broadcast(payload, self.receivers[ranks], async_op=True)

    def announced(self, nbytes: int, slots: int) -> int:
        """Wait for the next :meth:`announce` of a bucket of the plan's ``nbytes``; its slot.

        Raises :class:`ReaderError` if the leader sent an error, another size or
        a slot outside ``range(slots)``.
        """
        status, announced, slot = self._header(_OK, 0)
        self._check(status, announced, nbytes, nbytes)
        if not 0 <= slot < slots:
            raise ReaderError(f"the node leader announced slot {slot}, outside the {slots} slots")
        return slot

    def _check(self, status: int, announced: int, nbytes: int, capacity: int) -> None:
        import torch

        if status == _FAILED:
            data = torch.empty(announced, dtype=torch.uint8, device=self.device)
            self._broadcast(data, self.group)
            raise ReaderError(bytes(data.cpu().numpy()).decode(errors="replace"))
        if status != _OK or announced != nbytes or nbytes > capacity:
            raise ReaderError(
                f"rank {self.src} announced a bucket of {announced} bytes (status {status}), "
                f"the plan's holds {nbytes} and the buffer {capacity}: the ranks disagree on the plan"
            )

    def _header(self, status: int, nbytes: int, slot: int = 0) -> tuple[int, int, int]:
        """Broadcast ``[status, nbytes, slot]`` from the sender; what it sent, on every rank.

        Filled in place rather than built from a list: on CUDA, a copy from
        pageable host memory would wait for the stream, and the sender, which
        knows what it sent, never reads the header back; so its loop does not
        wait for the GPU once per bucket.
        """
        import torch
        import torch.distributed as dist

        header = torch.empty(3, dtype=torch.int64, device=self.device)
        header[0], header[1], header[2] = status, nbytes, slot
        self._broadcast(header, self.group)
        if dist.get_rank() == self.src:
            return status, nbytes, slot
        received = header.tolist()
        return received[0], received[1], received[2]

    def _broadcast(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
    ) -> Any:
        import torch.distributed as dist

        return dist.broadcast(tensor, src=self.src, group=group, async_op=async_op)


class Prefetcher:
    """Reads the plan's buckets in a background thread, ahead of the sender.

    The ``buffers`` take turns, in the order they are released: one is filled
    while the others are sent (on CPU, gloo sends straight from them), copied
    to the GPU, or read by the node's other ranks (shared-memory slots).
    """

    def __init__(
        self, reader: TensorReader, plan: Plan, buffers: list[torch.Tensor], *, timeout_s: float
    ) -> None:
        self._reader = reader
        self._plan = plan
        self._buffers = buffers
        self._timeout_s = timeout_s
        self._stalled = False
        self._free: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self._ready: queue.Queue[tuple[int, BaseException | None]] = queue.Queue()
        for index in range(len(buffers)):
            self._free.put((index, None))
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="megastart-read")
        self._thread = threading.Thread(
            target=self._run, name="megastart-rank0-loader-read", daemon=True
        )
        self._thread.start()

    def next(self) -> tuple[int, torch.Tensor]:
        """The next filled buffer and its index; re-raises the read error; bounded by ``timeout_s``."""
        try:
            index, error = self._ready.get(timeout=self._timeout_s)
        except queue.Empty:
            self._stalled = True
            raise ReaderError(
                f"reading one bucket took longer than {self._timeout_s:g} s "
                "(half of rank0_loader.timeout_s): the storage stalled"
            ) from None
        if error is not None:
            raise error
        return index, self._buffers[index]

    def release(self, index: int, copied: Any = None) -> None:
        """Give buffer ``index`` back for the next read, once the CUDA event ``copied`` (if any) has passed.

        A copy to the GPU runs asynchronously; the read thread waits for that
        copy alone, not the sender's whole stream.
        """
        self._free.put((index, copied))

    def close(self) -> None:
        """Stop the read thread. One stalled in a read is left to finish on its own (a daemon,
        holding its file open): waiting for it would add another ``timeout_s`` to the failure."""
        self._free.put(None)
        if self._stalled:
            self._pool.shutdown(wait=False)
            return
        self._thread.join(timeout=self._timeout_s)
        self._pool.shutdown()
        self._reader.close()

    def _run(self) -> None:
        for bucket in self._plan.buckets:
            free = self._free.get()
            if free is None:
                return
            index, copied = free
            try:
                if copied is not None:
                    copied.synchronize()
                fill(self._reader, bucket, self._buffers[index], self._pool)
            except BaseException as e:  # handed to the sender, which tells every rank
                self._ready.put((index, e))
                return
            self._ready.put((index, None))


READ_PART_BYTES = 4 * 2**20
"""Bytes one read thread copies at a time: a bucket's slots are split into row ranges of
about this size and read in parallel."""


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
