"""What the ranks of one collective call tell each other in torch.distributed's store, outside
any collective: a failure announced at once, the readers' progress, values posted by name.
The bounded waits that look at it are :class:`~megastart.distributed.board.Board`'s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from megastart.distributed.errors import LeaderGone, PeerFailed, describe
from megastart.distributed.polling import POLL_S

if TYPE_CHECKING:
    from megastart.distributed.page import Node

LOOKS_PER_S = 1000.0
"""The store requests a second the ranks waiting at a board may make together to look for
failures (a TCPStore serves 10-50k): at 8,192 ranks of 8 per node, each of the 1,024 leaders
looks about once a second; on a few nodes, every :data:`POLL_S`."""

PROGRESS_LOOK_S = 5.0
"""How often a wait on a peer looks at the call's progress (:meth:`Board.advance`): a stall is
named within this much of ``timeout_s`` after the last progress, at a store round trip per
look on every waiting leader (a node's other ranks look at their :class:`Node`)."""

GO, FAILED = "go", "failed:"
"""The values of a board's ``start`` key besides a reason why the ranks did not all start."""

_calls: dict[str, int] = {}
"""How many :class:`Board` s this process made per call name."""


class BoardKeys:
    """A call's keys in the store (under ``megastart/<what>/<n>/``, ``n`` counting this
    process's calls of ``what``: the same on every rank while the ranks call together), and
    what a rank posts there; with a node attached (:meth:`attach`), its node's page."""

    _node: Node | None
    _barriers: int

    def __init__(self, what: str) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        number = _calls[what] = _calls.get(what, 0) + 1
        self.what = what
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = float("inf")
        """What bounds the call's waits: set by :meth:`check_in` (a wait before it raises)."""
        self._advanced = -float("inf")
        self._store = dist.PrefixStore(f"megastart/{what}/{number}/", _get_default_store())
        self._node = None
        self._lookers = self.world
        self._seen = 0
        """The readers' progress this rank last saw on the store."""
        self._barriers = 0
        """How many :meth:`barrier` s this rank has passed."""

    @property
    def store(self) -> Any:
        """The call's keys in torch.distributed's store: a prefix of it is the call's alone."""
        return self._store

    def attach(self, node: Node | None, *, leaders: int) -> None:
        """Share this call's failures, progress and barriers with the node's ranks through
        ``node`` (``None``: a rank alone on its node, or the end of the node's page).

        :param leaders: how many ranks of the call look at the store from now on (one per
            node): they share :data:`LOOKS_PER_S` between them.
        """
        self._node = node
        self._lookers = leaders

    @property
    def _progress_look_s(self) -> float:
        """:data:`PROGRESS_LOOK_S`, or less where ``timeout_s`` is shorter than a few looks."""
        return min(PROGRESS_LOOK_S, self.timeout_s / 4)

    @property
    def _on_page(self) -> bool:
        """Whether this rank waits on its node's page, not on the store (not a leader)."""
        return self._node is not None and not self._node.leads

    @property
    def look_s(self) -> float:
        """How often a rank that looks at the store looks for failures while it waits: every
        :data:`POLL_S`, less often when so many ranks look that the store would serve more
        than :data:`LOOKS_PER_S`."""
        return max(POLL_S, self._lookers / LOOKS_PER_S)

    def announce(self, error: BaseException) -> None:
        """Tell every rank that this one failed; the first failure announced is the one named.

        Ranks still checking in hear it too: they stop waiting for this one; and ranks
        waiting at a :meth:`barrier` this one has not passed are released with it.
        """
        if self._node is not None:
            self._node.fail()
        if isinstance(error, PeerFailed):
            return
        failure = f"rank {self.rank}: {describe(error)}"
        released = f"{FAILED}{self.what} failed on {failure}"
        try:
            self._store.compare_set("failed", "", failure)
            self._store.compare_set("start", "", released)
            self._store.compare_set(gate_key(self._barriers), "", released)
        except Exception as e:  # the error stays this rank's own; the others hear of it late
            error.add_note(
                f"megastart could not announce it to the other ranks: the store failed "
                f"({type(e).__name__}: {e}; its server, on rank 0's process, may be gone)"
            )

    def failure(self, *, leader_gone: bool | None = None) -> str | None:
        """``"rank R: error"`` of the first failure announced, or ``None``.

        A node's other ranks look at its page first, and at the store only for the text, or
        once their leader is gone (it no longer copies the store's failures to the page).

        :param leader_gone: whether the node's leader is gone, where the caller asked already
            (the answer it acted on: asked again, the leader may have left in between).
        """
        node = self._node
        if node is None or not node.failed():
            if self._on_page:
                if leader_gone is None:
                    leader_gone = node.leader_gone()  # type: ignore[union-attr]
                if not leader_gone:
                    return None
                self._lost_leader(node.leader)  # type: ignore[union-attr]
            elif not self._store.check(["failed"]):
                return None
            if node is not None:
                node.fail()
        return bytes(self._store.get("failed")).decode()

    def _lost_leader(self, leader: int) -> None:
        """This node's leader (global rank ``leader``) is gone: announce it, unless a failure
        was announced already (the leader's own, or what it died of)."""
        if not self._store.check(["failed"]):
            gone = f"its node's leader, rank {leader}, is gone (killed, or died without a word)"
            self.announce(LeaderGone(gone))

    @contextmanager
    def announcing(self) -> Iterator[None]:
        """Announce any error that leaves the block (it is raised as it is)."""
        try:
            yield
        except BaseException as e:
            self.announce(e)
            raise

    def advance(self) -> None:
        """A reader made progress: the peer waits' ``timeout_s`` starts again (a store round trip
        at most every half :data:`PROGRESS_LOOK_S`)."""
        now = time.monotonic()
        if now - self._advanced >= self._progress_look_s / 2:
            self._advanced = now
            self._store.add("progress", 1)
        if self._node is not None:
            self._node.advanced()

    def _progress(self) -> int:
        """The call's progress: the readers' count on the store, or, on the node's page, the
        times the leader saw the call progress (which it notes here too)."""
        node = self._node
        if node is not None and not node.leads:
            return node.progress()
        progress = self._store.add("progress", 0)
        if node is not None and progress != self._seen:
            node.advanced()
        self._seen = progress
        return progress

    def post(self, key: str, value: str) -> None:
        """Leave ``value`` for the ranks that :meth:`read` ``key`` (a name, not data)."""
        self._store.set(f"posted/{key}", value)

    def withdraw(self, key: str, error: BaseException) -> None:
        """Post ``error`` under ``key`` instead of a value: its readers raise it at once."""
        self.post(key, f"{FAILED}{self.what} failed on rank {self.rank}: {describe(error)}")

    def _released(self, key: str) -> str:
        """The value of ``key``, set; :class:`PeerFailed` if a failing rank set it instead
        (:meth:`announce`, :meth:`withdraw`), marked on the node's page too."""
        value = bytes(self._store.get(key)).decode()
        if value.startswith(FAILED):
            if self._node is not None:
                self._node.fail()
            raise PeerFailed(value.removeprefix(FAILED))
        return value


def gate_key(number: int) -> str:
    """The key that opens a call's barrier ``number`` (from 0), or says why it never will."""
    return f"gate/{number}"
