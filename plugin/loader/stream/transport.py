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

The reader's read-ahead: :mod:`megastart.loader.stream.prefetch`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from megastart.distributed import Board, CollectiveError, LocalGroup, OwnGroups
from megastart.errors import MegastartError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_OK, _FAILED = 0, 1

IN_FLIGHT = 2
"""Payload broadcasts a rank has in flight at once; each holds a bucket-sized buffer."""


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
