"""The node's page of the load's board (:class:`NodeBoard`): what a node's ranks tell each other
without torch.distributed's store.

At 8,192 ranks every look at the store counts: a TCPStore serves 10-50k requests a
second. So once the planning phase has told every rank its node, the leader of each
node makes one page of shared memory for the rest of the load, and the board
(:meth:`~megastart.distributed.Board.attach`) has the node's other ranks look
there while they wait instead of at the store: whether a failure was announced (its
text stays in the store, read once), the load's progress as the leader last saw it,
the node's arrivals at a barrier and the gate its leader opens, and which of the
node's shared segments each rank has mapped (:func:`~megastart.loader.stream.shm.node_segment`).
Only leaders wait on the store: 1,024 of them at 8,192 ranks of 8 per node.

Every word has one writer (a rank's own counts; the leader's gate and progress; the
failure flag is only ever set), and a reader acts on one word alone, never on other
bytes it would order (a failure's text is read from the store): no memory order
between the words is needed.

A node's other ranks wait on the page, so a leader killed without a word would leave
them waiting there for the whole ``timeout_s``. So the leader holds a POSIX lock on the
page's file while it lives (the kernel drops it when the process ends, however it ends,
and across PID namespaces), and the others, looking at the page, test it: a leader gone
is announced on the store within a slice of their wait.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from megastart.distributed import Board, polled_locally
from megastart.loader.stream.shm import SHM_DIR, Segment

_FAILED, _PROGRESS, _GATE = 0, 1, 2
_HEAD = 4
"""Words before the per-rank counts: failed, progress, gate, and one spare."""

SPARE_BYTES = 4096
"""Bytes of the page after the board's words, for one record the node's ranks share in the load
(the reader's :class:`~megastart.loader.stream.frontier.Frontier`): no segment of its own to make,
map and wait for."""


class NodeBoard:
    """One node's page: a :class:`~megastart.distributed.Node` for the load's board.

    Position 0 of the node is its leader. The page holds, per rank of the node, how many
    barriers it arrived at and how many of the node's segments it mapped.
    """

    def __init__(
        self, segment: Segment, size: int, index: int, *, leader: int = 0, lock: int | None = None
    ) -> None:
        """:param leader: the leader's global rank. :param lock: (on the others) a descriptor of
        the page's file, which the leader holds locked while it lives (:func:`node_board`)."""
        import torch

        assert segment.tensor is not None
        self.name = segment.name
        """The page's name in ``/dev/shm`` (gone once mapped); the node's segments derive theirs."""
        self.size = size
        self.index = index
        self.leader = leader
        self._lock = lock
        words = 8 * (_HEAD + 2 * size)
        self._words = segment.tensor[:words].view(torch.int64)
        self.spare = segment.tensor[words : words + SPARE_BYTES]
        """:data:`SPARE_BYTES` of the page, zero until a rank writes them."""
        self._barriers = self._words[_HEAD : _HEAD + size]
        self._maps = self._words[_HEAD + size : _HEAD + 2 * size]
        self._segments = 1
        """The node's segments this rank has made or mapped, the page itself included."""

    @staticmethod
    def nbytes(size: int) -> int:
        return 8 * (_HEAD + 2 * size) + SPARE_BYTES

    @property
    def leads(self) -> bool:
        return self.index == 0

    def leader_gone(self) -> bool:
        """Whether the leader's lock on the page is free: its process ended (a request to the
        kernel, none to the store)."""
        if self._lock is None:
            return False
        try:
            fcntl.lockf(self._lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # the leader holds it
            return False
        fcntl.lockf(self._lock, fcntl.LOCK_UN)
        return True

    def failed(self) -> bool:
        return bool(self._words[_FAILED])

    def fail(self) -> None:
        self._words[_FAILED] = 1

    def progress(self) -> int:
        return int(self._words[_PROGRESS])

    def advanced(self) -> None:
        self._words[_PROGRESS] += 1

    def arrive(self) -> None:
        self._barriers[self.index] += 1

    def arrived(self, count: int) -> bool:
        return bool((self._barriers[1:] >= count).all())

    def gate(self) -> int:
        return int(self._words[_GATE])

    def open(self, count: int) -> None:
        self._words[_GATE] = count

    def next_segment(self) -> str:
        """The name of the node's next segment (the same sequence on every rank of the node)."""
        self._segments += 1
        return f"{self.name}-{self._segments}"

    def mapped(self) -> None:
        """This rank mapped the node's latest segment."""
        self._maps[self.index] = self._segments

    def all_mapped(self) -> bool:
        """Whether every other rank of the node mapped the latest segment the leader made."""
        return bool((self._maps[1:] >= self._segments).all())


@contextmanager
def node_board(board: Board, members: Sequence[int], *, nodes: int) -> Iterator[NodeBoard | None]:
    """The page of the node of ``members`` (global ranks, the leader first), attached to
    ``board`` for the block (``None`` for a node of one rank, which needs none) as the page of
    one of ``nodes``.

    The leader makes it, locks it (:meth:`NodeBoard.leader_gone`) and posts its name on the
    store; the others read the name (one blocking request each), open and map it; once all
    have, its name is removed. Every rank then meets the others at a barrier of the board,
    so a node whose page could not be made stops every node here, before the groups of
    the stream are made (its ranks would never come to them).
    """
    if len(members) == 1:
        board.attach(None, leaders=nodes)
        board.barrier("every node's page")
        yield None
        return
    index = list(members).index(board.rank)
    key = f"node/{members[0]}"
    if index == 0:
        try:
            segment, lock = _made_and_locked(len(members))
        except BaseException as e:
            board.withdraw(key, e)
            board.announce(e)
            raise
    else:
        name = board.read(key, f"the page of node leader rank {members[0]}")
        lock = os.open(SHM_DIR / name, os.O_RDWR)  # before the leader removes the name
    try:
        if index == 0:
            board.post(key, segment.name)
        else:
            segment = Segment.open(name)
        page = NodeBoard(
            segment, len(members), index, leader=members[0], lock=lock if index else None
        )
        with _shared(board, page, segment, members):
            board.attach(page, leaders=nodes)
            try:
                with board.announcing():  # on the page too, while the node's ranks look there
                    board.barrier("every node's page")
                    yield page
            finally:
                board.attach(None, leaders=nodes)
    finally:
        os.close(lock)


def _made_and_locked(size: int) -> tuple[Segment, int]:
    """A node's new page, and a descriptor of its file that this process holds locked (the
    lock goes with the descriptor, or with the process)."""
    segment = Segment.create(NodeBoard.nbytes(size))
    try:
        lock = os.open(SHM_DIR / segment.name, os.O_RDWR)
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(lock)
            raise
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    return segment, lock


@contextmanager
def node_segment(
    board: Board,
    page: NodeBoard,
    members: Sequence[int],
    *,
    nbytes: int,
    fill: Callable[[Segment], None] | None = None,
) -> Iterator[Segment]:
    """The node's shared segment for one use in a load: made by the leader (``members[0]``),
    who ``fill`` s it before it takes its name, mapped whole by the node's other ranks (who
    look for the name on the file system, not the store), its name removed once all have
    mapped it (a killed process leaks nothing), unmapped when the block ends. A leader that
    fails is announced on the board, and the others stop."""
    name = page.next_segment()
    if page.leads:
        segment = Segment.create(nbytes, name=name, fill=fill)
    else:
        what = f"node leader rank {members[0]}'s shared segment {name!r}"
        board.wait(polled_locally(lambda: Segment.exists(name)), what, peer=True)
        segment = Segment.open(name)
    with _shared(board, page, segment, members):
        yield segment


@contextmanager
def _shared(
    board: Board, page: NodeBoard, segment: Segment, members: Sequence[int]
) -> Iterator[None]:
    """``segment`` for the block, once mapped on every rank of the node: the leader waits
    until the others say they mapped it, then removes its name; unmapped at the end."""
    try:
        if page.leads:
            what = f"node ranks {list(members)} to map the shared segment"
            board.wait(polled_locally(page.all_mapped), what, peer=True)
            segment.unlink()
        else:
            page.mapped()
        yield
    finally:
        if page.leads:
            segment.unlink()
        segment.close()
