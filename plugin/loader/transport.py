"""Moving buckets from the reader to the ranks: reader groups, prefetch, broadcast.

**Why broadcast, and to whom.** Only some ranks need a given tensor (a TP
shard, one pipeline stage), so a scatter of per-rank slices looks cheaper, but
it makes the reader's link carry the model once per data-parallel replica and
per TP-shard overlap. A ring/tree broadcast carries each byte over the
reader's link once and reaches every rank in about the time one link needs,
whatever the group size. Each bucket holds tensors that the same ranks need
(a pipeline stage's, an expert-parallel rank's) and is broadcast to those
ranks only, in a process group of their own; where a backend broadcasts from
the root to each receiver (gloo), that divides the reader's traffic by the
number of stages. The plan only includes tensors some rank of the group needs.

**Protocol.** Per bucket, the reader broadcasts a two-element header
``[status, nbytes]`` to the whole reader group and then the payload to the
bucket's ranks. A reader that fails to read (I/O error, file changed under it)
sends ``status = 1`` and the error message to the whole group instead, so every
rank raises that message rather than waiting for bytes that never come. A
receiver checks the announced size against its plan before it posts a receive
(gloo aborts the process on a size mismatch). On gloo every wait is sliced
and looks at the load's :class:`~megastart.distributed.Board` in between: a
failure on any rank (a receiver out of memory) stops it within a slice, and a
wait longer than ``timeout_s`` is announced naming what it waited for; NCCL's
own watchdog bounds its waits.

**Overlap.** Payloads are broadcast asynchronously, :data:`IN_FLIGHT` at a
time: while bucket *i* travels, a receiver copies bucket *i - 1* into its
parameters, and a background thread on the reader reads bucket *i + 1* (into
host buffers, pinned when the parameters are on CUDA). It reads in the plan's
file order and leaves read-ahead to the kernel on a cold page cache (an
explicit ``POSIX_FADV_WILLNEED`` of the next bucket made cold loads slower;
one pass over each file filling interleaved buckets side by side was no
faster). Headers stay synchronous, and a header announces only a payload that
will be sent: when the reader fails, it first finishes the broadcasts in
flight, then sends the error, so no rank is left waiting on a payload that
never comes.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megastart.distributed import Board, CollectiveError, OwnGroups
from megastart.loader.checkpoint import TensorReader
from megastart.loader.plan import Bucket, Plan, Slot

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_OK, _FAILED = 0, 1

IN_FLIGHT = 2
"""Payload broadcasts a rank has in flight at once; each holds a bucket-sized buffer."""


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


def open_data_groups(groups: list[list[int]], own: OwnGroups, *, backend: str) -> dist.ProcessGroup:
    """Create every group's process group (collective over WORLD); return this rank's."""
    import torch.distributed as dist

    if len(groups) == 1:
        return own.new(None, backend=backend)
    mine = None
    for ranks in groups:
        group = own.new(ranks, backend=backend)
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None
    return mine


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
    board: Board
    """The load's board: where failures are announced and waits look."""

    def send(self, payload: torch.Tensor, ranks: tuple[int, ...]) -> dist.Work | None:
        """Announce ``payload`` to the whole group, then start its broadcast to ``ranks``.

        Returns the broadcast in flight (``None`` if no group holds ``ranks``):
        ``payload`` must stay untouched until it has been waited for.
        """
        self._header(_OK, payload.numel())
        if ranks in self.receivers:  # the reader alone in a group of one too: NCCL exercised
            return self._broadcast(payload, self.receivers[ranks], async_op=True)
        return None

    def send_error(self, message: str) -> None:
        import torch

        data = torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8).to(self.device)
        self._header(_FAILED, data.numel())
        self.wait(self._broadcast(data, self.group, async_op=True), "the reader's error message")

    def receive(
        self, buffer: torch.Tensor, ranks: tuple[int, ...], nbytes: int
    ) -> tuple[torch.Tensor, dist.Work] | None:
        """Start receiving the next payload, of ``nbytes``, into ``buffer`` (``None`` if it is
        not for this rank).

        Returns the payload's view of ``buffer`` and the broadcast in flight,
        which must be waited for before the payload is read. Raises
        :class:`ReaderError` if the reader failed: every rank of the group hears
        every header, so an error reaches the ranks a bucket skips too; and a
        :class:`~megastart.distributed.CollectiveError` if the reader announces
        another size than this rank planned, before any byte is received.
        """
        import torch

        status, announced = self._header(_OK, 0)
        if status == _FAILED:
            data = torch.empty(announced, dtype=torch.uint8, device=self.device)
            self.wait(
                self._broadcast(data, self.group, async_op=True), "the reader's error message"
            )
            raise ReaderError(bytes(data.cpu().numpy()).decode(errors="replace"))
        if announced != nbytes or announced > buffer.numel():
            raise CollectiveError(
                f"the reader (rank {self.src}) announced a bucket of "
                f"{announced} bytes where this rank planned {nbytes} (buffer of {buffer.numel()}): "
                "the ranks' plans differ; nothing was received"
            )
        if ranks not in self.receivers:
            return None
        payload = buffer[:announced]
        return payload, self._broadcast(payload, self.receivers[ranks], async_op=True)

    def wait(self, work: Any, what: str) -> None:
        """Wait for a broadcast of this channel: sliced and watching the board on gloo."""
        if self.device.type == "cpu":
            sender = "to its receivers" if self.board.rank == self.src else f"from rank {self.src}"
            self.board.wait_work(work, f"{what} {sender}")
        else:
            work.wait()

    def _header(self, status: int, nbytes: int) -> tuple[int, int]:
        """Broadcast ``[status, nbytes]`` from the reader; what the reader sent, on every rank.

        Filled in place rather than built from a list: on CUDA, a copy from
        pageable host memory would wait for the stream, and the reader, which
        knows what it sent, never reads the header back; so its loop does not
        wait for the GPU once per bucket.
        """
        import torch
        import torch.distributed as dist

        header = torch.empty(2, dtype=torch.int64, device=self.device)
        header[0], header[1] = status, nbytes
        self.wait(self._broadcast(header, self.group, async_op=True), "a bucket's header")
        if dist.get_rank() == self.src:
            return status, nbytes
        received = header.tolist()
        return received[0], received[1]

    def _broadcast(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
    ) -> Any:
        import torch.distributed as dist

        return dist.broadcast(tensor, src=self.src, group=group, async_op=async_op)


class Prefetcher:
    """Reads the plan's buckets in a background thread, ahead of the sender.

    ``buffers`` host buffers take turns: one is filled while the others are
    sent (on CPU, gloo sends straight from them) or copied to the GPU.
    """

    def __init__(
        self, reader: TensorReader, plan: Plan, *, buffers: int, pin: bool, board: Board
    ) -> None:
        import torch

        self._reader = reader
        self._plan = plan
        self._board = board
        self._free: queue.Queue[tuple[torch.Tensor, Any] | None] = queue.Queue()
        self._ready: queue.Queue[tuple[torch.Tensor | None, BaseException | None]] = queue.Queue()
        for _ in range(min(buffers, len(plan.buckets))):
            buffer = torch.empty(plan.max_bucket_bytes, dtype=torch.uint8, pin_memory=pin)
            self._free.put((buffer, None))
        self._thread = threading.Thread(
            target=self._run, name="megastart-rank0-loader-read", daemon=True
        )
        self._thread.start()

    def next(self) -> torch.Tensor:
        """The next filled buffer; re-raises the read error; a read that stalls past
        ``timeout_s`` raises :class:`~megastart.distributed.Stalled`, naming the tensor."""
        got: list[tuple[torch.Tensor | None, BaseException | None]] = []

        def ready(slice_s: float) -> bool:
            try:
                got.append(self._ready.get(timeout=slice_s))
            except queue.Empty:
                return False
            return True

        self._board.wait(ready, self._reading)
        buffer, error = got[0]
        if error is not None:
            raise error
        assert buffer is not None
        return buffer

    def release(self, buffer: torch.Tensor, copied: Any = None) -> None:
        """Give ``buffer`` back for the next read, once the CUDA event ``copied`` (if any) has passed.

        The reader copies a pinned buffer to the GPU asynchronously; the read
        thread waits for that copy alone, not the sender's whole stream.
        """
        self._free.put((buffer, copied))

    def close(self) -> None:
        """Stop reading. Does not wait: a read stalled in the kernel ends (and the thread
        closes the files) whenever the storage answers; the load has failed by then."""
        self._free.put(None)

    def _reading(self) -> str:
        entry = self._reader.reading
        what = "the next bucket" if entry is None else f"tensor {entry.name!r} from {entry.file!r}"
        return f"the reader's read of {what} (the storage did not answer)"

    def _run(self) -> None:
        try:
            for bucket in self._plan.buckets:
                free = self._free.get()
                if free is None:
                    return
                buffer, copied = free
                try:
                    if copied is not None:
                        copied.synchronize()
                    fill(self._reader, bucket, buffer)
                except BaseException as e:  # handed to the sender, which tells every rank
                    self._ready.put((None, e))
                    return
                self._ready.put((buffer, None))
        finally:
            self._reader.close()


def fill(reader: TensorReader, bucket: Bucket, buffer: torch.Tensor) -> None:
    """Read every slot of ``bucket`` (a tensor or its rows) into ``buffer``, in the slot's dtype."""
    for slot in bucket.slots:
        reader.read_into(reader.meta.tensors[slot.name], slot_view(buffer, slot), slot.rows.start)


def slot_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The typed, shaped view of one slot inside a byte buffer."""
    import torch

    raw = buffer[slot.offset : slot.offset + slot.nbytes]
    return raw.view(getattr(torch, slot.dtype)).view(slot.shape)
