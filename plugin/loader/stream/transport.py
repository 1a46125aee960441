"""Moving buckets between ranks: reader groups, headers, broadcasts between nodes, read-ahead.

**Why broadcast between nodes, and to whom.** Only some nodes need a given
tensor (a pipeline stage's, an expert-parallel rank's), so a scatter of
per-rank slices looks cheaper, but it makes the reader's link carry the
model once per data-parallel replica. A ring/tree broadcast carries each byte
over the reader's link once and reaches every node in about the time one link
needs. Each bucket holds tensors the same ranks need and is broadcast to the
leaders of their nodes only, in a process group of their own. Inside a node
no bytes travel over a socket: see :mod:`megastart.loader.stream.route`.

**Protocol.** Per bucket, the sender broadcasts a header ``[status, nbytes,
buffer]`` to its whole group (every node leader of the reader group; inside a
node, every rank of it), then, between nodes, the payload to the leaders
that need it. A reader that fails to read (I/O error, file changed under it)
sends ``status = 1`` and the error message instead, so every rank raises
that message rather than waiting for bytes that never come. A receiver
checks every announced size against its plan and its buffer before it posts
a receive (gloo aborts the process on a size mismatch). On gloo every wait
is sliced and looks at the load's :class:`~megastart.distributed.Board` in
between: a failure on any rank (a receiver out of memory, a rank killed)
stops it within a slice, and a wait longer than ``timeout_s`` is announced
naming what it waited for; NCCL's own watchdog bounds its waits. The
reader's wait for its read-ahead watches the board too: a read that stalls
past ``timeout_s`` is named, tensor and file.

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

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from megastart.distributed import Board, CollectiveError, LocalGroup, OwnGroups
from megastart.errors import MegastartError
from megastart.loader.checkpoint import TensorReader
from megastart.loader.plan.buckets import Bucket, Plan, Slot

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_OK, _FAILED = 0, 1

IN_FLIGHT = 2
"""Payload broadcasts a rank has in flight at once; each holds a bucket-sized buffer."""

READ_THREADS = min(8, os.cpu_count() or 1)
"""Threads of the reader that read one bucket's parts at once (see :func:`fill`)."""

READ_PART_BYTES = 4 * 2**20
"""Bytes one read thread copies at a time: a bucket's slots are split into row ranges of
about this size and read in parallel."""


class ReaderError(MegastartError, RuntimeError):
    """The reader rank could not read a bucket; raised on every rank of its group."""


def open_leader_groups(
    leader_sets: Sequence[tuple[int, ...]], own: OwnGroups, store: dist.Store, *, backend: str
) -> dict[tuple[int, ...], LocalGroup]:
    """A group of ``backend`` per set of global ranks, made by its ranks alone under
    ``store`` (the load's): no collective over WORLD, nothing registered with
    torch.distributed. This rank's groups, by set.

    Pass the sets this rank is in, in the order every rank that makes them sees them
    (:func:`~megastart.loader.stream.route.leader_sets`): each rank makes its sets in one total
    order, so no two ranks wait on each other's next group.
    """
    import torch.distributed as dist

    return {
        ranks: own.local(
            dist.PrefixStore(f"leaders/{_set_key(ranks)}/", store), ranks, backend=backend
        )
        for ranks in leader_sets
    }


def _set_key(ranks: tuple[int, ...]) -> str:
    """A short key of its own for a set of ranks (a stage's leaders are thousands of digits)."""
    return hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:20]


@dataclass(slots=True)
class Channel:
    """Broadcasts of one reader group: headers to all of it, payloads to a bucket's ranks."""

    group: LocalGroup
    """The loader's group over every node leader of the reader group (or a node's ranks):
    headers and errors."""
    src: int
    """Global rank of the group's reader."""
    device: torch.device
    """Where the collective's buffers live (CUDA for NCCL, CPU for gloo)."""
    receivers: dict[tuple[int, ...], LocalGroup]
    """The groups between node leaders this rank is in, by their global ranks."""
    board: Board
    """The load's board: where failures are announced and waits look."""
    sender: str = "the reader"
    """Who ``src`` is, for messages: the reader, or a node leader passing buckets on."""

    def sent_by(self, src: int) -> Channel:
        """The same groups with ``src`` sending (striped readers: each bucket's reader)."""
        return replace(self, src=src, sender="the bucket's reader")

    def send(self, payload: torch.Tensor, ranks: tuple[int, ...]) -> dist.Work | None:
        """Announce ``payload`` to the whole group, then start its broadcast to ``ranks``.

        Returns the broadcast in flight (``None`` if no group holds ``ranks``):
        ``payload`` must stay untouched until it has been waited for.
        """
        self._header(_OK, payload.numel())
        if ranks in self.receivers:  # the reader alone in a group of one too: NCCL exercised
            return self._broadcast(payload, self.receivers[ranks])
        return None

    def announce(self, nbytes: int, buffer: int) -> dist.Work:
        """Tell the group that a bucket of ``nbytes`` waits in shared buffer ``buffer`` (no payload).

        Returns the header's broadcast in flight, for the sender to wait for later
        (:meth:`wait`): it goes on reading while the ranks are still copying the
        buckets before, rather than waiting for each to take its header.
        """
        return self._broadcast(self._header_tensor(_OK, nbytes, buffer), self.group)

    def send_error(self, message: str) -> None:
        """Tell the group that the sender failed, and why; each rank raises it as a :class:`ReaderError`."""
        import torch

        data = torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8).to(self.device)
        self._header(_FAILED, data.numel())
        self.wait(self._broadcast(data, self.group), "the error message")

    def receive(
        self, buffer: torch.Tensor, ranks: tuple[int, ...], nbytes: int
    ) -> tuple[torch.Tensor, dist.Work] | None:
        """Start receiving the next payload, of the plan's ``nbytes``, into ``buffer``
        (``None`` if it is not for this rank).

        Returns the payload's view of ``buffer`` and the broadcast in flight,
        which must be waited for before the payload is read. Raises
        :class:`ReaderError` if the reader failed: every rank of the group hears
        every header, so an error reaches the ranks a bucket skips too; and a
        :class:`~megastart.distributed.CollectiveError` if the reader announces
        another size than this rank planned, before any byte is received.
        """
        status, announced, _ = self._header(_OK, 0)
        self._check(status, announced, nbytes, buffer.numel())
        if ranks not in self.receivers:
            return None
        payload = buffer[:nbytes]
        return payload, self._broadcast(payload, self.receivers[ranks])

    def announced(self, nbytes: int, capacity: int, buffers: int) -> int:
        """Wait for the next :meth:`announce` of a bucket of the plan's ``nbytes``; its buffer.

        Raises :class:`ReaderError` if the leader sent an error, and a
        :class:`~megastart.distributed.CollectiveError` if it announced another
        size, one larger than a buffer's ``capacity``, or a buffer outside ``range(buffers)``.
        """
        status, announced, buffer = self._header(_OK, 0)
        self._check(status, announced, nbytes, capacity)
        if not 0 <= buffer < buffers:
            raise CollectiveError(
                f"{self.sender} (rank {self.src}) announced buffer {buffer}, outside the {buffers} buffers"
            )
        return buffer

    def wait(self, work: Any, what: str) -> None:
        """Wait for a broadcast of this channel: sliced and watching the board on gloo."""
        if self.device.type == "cpu":
            sender = "to its receivers" if self.board.rank == self.src else f"from rank {self.src}"
            self.board.wait_work(work, f"{what} {sender}")
        else:
            work.wait()

    def _check(self, status: int, announced: int, nbytes: int, capacity: int) -> None:
        if status == _FAILED:
            raise ReaderError(self._receive_text(announced))
        if status != _OK or announced != nbytes or announced > capacity:
            raise CollectiveError(
                f"{self.sender} (rank {self.src}) announced a bucket of {announced} bytes where "
                f"this rank planned {nbytes} (buffer of {capacity}): the ranks' plans differ; "
                "nothing was received"
            )

    def _receive_text(self, nbytes: int) -> str:
        import torch

        data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.wait(self._broadcast(data, self.group), "the error message")
        return bytes(data.cpu().numpy()).decode(errors="replace")

    def _header(self, status: int, nbytes: int, buffer: int = 0) -> tuple[int, int, int]:
        """Broadcast ``[status, nbytes, buffer]`` from the sender; what it sent, on every rank."""
        import torch.distributed as dist

        header = self._header_tensor(status, nbytes, buffer)
        self.wait(self._broadcast(header, self.group), "a bucket's header")
        if dist.get_rank() == self.src:
            return status, nbytes, buffer
        received = header.tolist()
        return received[0], received[1], received[2]

    def _header_tensor(self, status: int, nbytes: int, buffer: int) -> torch.Tensor:
        """Filled in place rather than built from a list: on CUDA, a copy from pageable host
        memory would wait for the stream, and the sender, which knows what it sent, never
        reads the header back; so its loop does not wait for the GPU once per bucket."""
        import torch

        header = torch.empty(3, dtype=torch.int64, device=self.device)
        header[0], header[1], header[2] = status, nbytes, buffer
        return header

    def _broadcast(self, tensor: torch.Tensor, group: LocalGroup) -> Any:
        """Start broadcasting ``tensor`` from the sender over ``group``; the work in flight."""
        return group.broadcast(tensor, self.src)


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
