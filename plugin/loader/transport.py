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
rank raises that message rather than waiting for bytes that never come. Every
wait is bounded by the group's timeout.

**Overlap.** A background thread reads bucket *i + 1* into the second of two
host buffers (pinned when the parameters are on CUDA) while bucket *i* is
being broadcast, and asks the kernel to read bucket *i + 2* ahead
(``POSIX_FADV_WILLNEED``), so a cold page cache keeps the storage busy.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megastart.distributed import new_group
from megastart.loader.checkpoint import TensorReader
from megastart.loader.plan import Bucket, Plan, Slot

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_OK, _FAILED = 0, 1


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


def open_data_groups(
    groups: list[list[int]], *, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """Create every group's process group (collective over WORLD); return this rank's."""
    import torch.distributed as dist

    if len(groups) == 1:
        return new_group(None, backend=backend, timeout_s=timeout_s)
    mine = None
    for ranks in groups:
        group = new_group(ranks, backend=backend, timeout_s=timeout_s)
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None
    return mine


def open_receiver_groups(
    receiver_sets: list[tuple[int, ...]], *, backend: str, timeout_s: float
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group per set of global ranks (collective over WORLD); this rank's, by set.

    Every rank passes the same sets in the same order. Sets of one rank need no group.
    """
    import torch.distributed as dist

    mine = {}
    for ranks in receiver_sets:
        if len(ranks) > 1:
            group = new_group(ranks, backend=backend, timeout_s=timeout_s)
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

    def send(self, payload: torch.Tensor, ranks: tuple[int, ...]) -> None:
        self._header(_OK, payload.numel())
        if ranks in self.receivers:  # the reader alone in a group of one too: NCCL exercised
            self._broadcast(payload, self.receivers[ranks])

    def send_error(self, message: str) -> None:
        import torch

        data = torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8).to(self.device)
        self._header(_FAILED, data.numel())
        self._broadcast(data, self.group)

    def receive(self, buffer: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor | None:
        """The next payload, in ``buffer`` (``None`` if it is not for this rank).

        Raises :class:`ReaderError` if the reader failed: every rank of the group
        hears every header, so an error reaches the ranks a bucket skips too.
        """
        import torch

        status, nbytes = self._header(_OK, 0)
        if status == _FAILED:
            data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._broadcast(data, self.group)
            raise ReaderError(bytes(data.cpu().numpy()).decode(errors="replace"))
        if ranks not in self.receivers:
            return None
        payload = buffer[:nbytes]
        self._broadcast(payload, self.receivers[ranks])
        return payload

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
        self._broadcast(header, self.group)
        if dist.get_rank() == self.src:
            return status, nbytes
        received = header.tolist()
        return received[0], received[1]

    def _broadcast(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, src=self.src, group=group)


class Prefetcher:
    """Reads the plan's buckets in a background thread, one bucket ahead of the sender."""

    def __init__(self, reader: TensorReader, plan: Plan, *, pin: bool, timeout_s: float) -> None:
        import torch

        self._reader = reader
        self._plan = plan
        self._timeout_s = timeout_s
        self._free: queue.Queue[tuple[torch.Tensor, Any] | None] = queue.Queue()
        self._ready: queue.Queue[tuple[torch.Tensor | None, BaseException | None]] = queue.Queue()
        for _ in range(min(2, len(plan.buckets))):
            buffer = torch.empty(plan.max_bucket_bytes, dtype=torch.uint8, pin_memory=pin)
            self._free.put((buffer, None))
        self._thread = threading.Thread(
            target=self._run, name="megastart-rank0-loader-read", daemon=True
        )
        self._thread.start()

    def next(self) -> torch.Tensor:
        """The next filled buffer; re-raises the read error; bounded by ``timeout_s``."""
        try:
            buffer, error = self._ready.get(timeout=self._timeout_s)
        except queue.Empty:
            raise ReaderError(
                f"reading one bucket took longer than timeout_s={self._timeout_s:g}"
            ) from None
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
        self._free.put(None)
        self._thread.join(timeout=self._timeout_s)
        self._reader.close()

    def _run(self) -> None:
        buckets = self._plan.buckets
        for index, bucket in enumerate(buckets):
            free = self._free.get()
            if free is None:
                return
            buffer, copied = free
            try:
                if copied is not None:
                    copied.synchronize()
                if index + 1 < len(buckets):
                    read_ahead(self._reader, buckets[index + 1])
                fill(self._reader, bucket, buffer)
            except BaseException as e:  # handed to the sender, which tells every rank
                self._ready.put((None, e))
                return
            self._ready.put((buffer, None))


def fill(reader: TensorReader, bucket: Bucket, buffer: torch.Tensor) -> None:
    """Read every slot of ``bucket`` (a tensor or its rows) into ``buffer``, in the slot's dtype."""
    for slot in bucket.slots:
        reader.read_into(reader.meta.tensors[slot.name], slot_view(buffer, slot), slot.rows.start)


def read_ahead(reader: TensorReader, bucket: Bucket) -> None:
    """Let the kernel read ``bucket``'s bytes into the page cache while this one is copied."""
    for slot in bucket.slots:
        reader.read_ahead(reader.meta.tensors[slot.name], slot.rows.start, slot.rows.stop)


def slot_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The typed, shaped view of one slot inside a byte buffer."""
    import torch

    raw = buffer[slot.offset : slot.offset + slot.nbytes]
    return raw.view(getattr(torch, slot.dtype)).view(slot.shape)
