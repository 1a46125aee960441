"""The :class:`Board`: what the ranks of one call tell each other in torch.distributed's store
(check-in, a failure announced at once, progress), and bounded waits that look at it."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from megastart.distributed.errors import LeaderGone, PeerFailed, Stalled, describe
from megastart.distributed.polling import POLL_S, next_slice, polled_locally
from megastart.errors import CollectiveError

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

PEER_GRACE_S = 2.0
"""How much longer than ``timeout_s`` a rank waits on a peer than on itself: a rank
stalled in its own work (a read) then names its stall before its peers time out."""

_GO, _FAILED = "go", "failed:"
"""The values of a board's ``start`` key besides a reason why the ranks did not all start."""

_calls: dict[str, int] = {}
"""How many :class:`Board` s this process made per call name."""


class Board:
    """What the ranks of one collective call tell each other outside of any collective.

    A rank blocked in a broadcast cannot hear an error raised on another rank,
    and a process group's timeout cannot say which rank never came. So each call
    keeps a few keys in torch.distributed's default store, under
    ``megastart/<what>/<n>/`` (``n`` counts this process's calls of ``what``: the
    same on every rank while the ranks call together): which ranks arrived, and
    the first failure any rank announced. Every wait of the call blocks
    :data:`POLL_S` at a time (:data:`LONG_POLL_S` once it has waited
    :data:`SETTLE_S`) and looks at the board in between, so a failure anywhere
    stops it within a slice; a wait that outlasts ``timeout_s`` is announced as a
    failure of its own, naming what it waited for. A store round trip per slice
    is all it costs.

    A wait on a peer counts ``timeout_s`` from the call's last progress (a
    reader's :meth:`advance`), not from its own start: a rank whose next bucket
    is far down the checkpoint, or that finished early and waits for the
    others, waits as long as the readers read, and a stalled or dead reader is
    still named ``timeout_s`` after its last bucket.

    Once the nodes are known, :meth:`attach` hands the board its node's page of
    shared memory: from then on only node leaders look at the store while they
    wait (about one request a second once settled, a thousand a second at
    8,192 ranks of 8 per node), and the other ranks look at their node's page,
    which costs the store nothing.
    """

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
        self._node: Node | None = None
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
        released = f"{_FAILED}{self.what} failed on {failure}"
        try:
            self._store.compare_set("failed", "", failure)
            self._store.compare_set("start", "", released)
            self._store.compare_set(_gate(self._barriers), "", released)
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

    def check_in(self, timeout_s: float) -> None:
        """Wait until every rank has started the call, at most ``timeout_s``; else name those
        that did not, on every rank (a latecomer too, at once).

        Call it before making any process group: creating one with a rank
        missing would wait in vain, and would leave the ranks' group counters
        apart, so the host's next ``new_group`` would hang as well.

        :raises PeerFailed: at once, when a rank announced a failure instead of arriving.
        """
        self.timeout_s = timeout_s
        self._store.set(f"arrived/{self.rank}", "1")
        if self._store.add("arrived", 1) == self.world:
            self._store.compare_set("start", "", _GO)
        try:  # one blocking wait: a store wait that times out logs a c10d warning
            self._store.wait(["start"], datetime.timedelta(seconds=timeout_s))
        except Exception:  # the timeout; a store that is gone fails again below
            self._name_the_missing(timeout_s)
        start = self._released("start")
        if start != _GO:
            raise CollectiveError(start)

    def _name_the_missing(self, timeout_s: float) -> None:
        """After a check-in timed out: the first rank here asks the store about every rank
        (``world`` requests, once), the others wait for what it finds (a request each)."""
        said = f"{self.what}: rank(s) {{}} did not start it within timeout_s={timeout_s:g} s "
        said += "(died, hung, or never called it); no process group was made"
        if self._store.add("late", 1) == 1:
            missing = [r for r in range(self.world) if not self._store.check([f"arrived/{r}"])]
            self._store.compare_set("start", "", said.format(missing))
            return
        try:
            self._store.wait(["start"], datetime.timedelta(seconds=PEER_GRACE_S))
        except Exception:  # the rank naming them stopped too: said without the names
            self._store.compare_set("start", "", said.format("not named"))

    def wait(
        self,
        ready: Callable[[float], bool],
        what: str | Callable[[], str],
        *,
        peer: bool = False,
        grace: int = 1,
    ) -> None:
        """Until ``ready(slice_s)`` is true (it may block ``slice_s`` seconds).

        :param peer: the wait is on another rank: it gets ``grace`` times
            :data:`PEER_GRACE_S` more, counted from the call's last progress
            (:meth:`advance`).
        :raises PeerFailed: within a slice of any rank announcing a failure.
        :raises Stalled: after ``timeout_s``, naming ``what`` (or what it returns
            then); announced first, so the others stop at once.
        """
        limit = self._bound() + (grace * PEER_GRACE_S if peer else 0.0)
        started = time.monotonic()
        deadline = started + limit
        # Most waits end in their first slice, and a look at the store is a request: the
        # failures are looked at every look_s (at the node's page, every slice), the readers'
        # progress first after PROGRESS_LOOK_S.
        progress: int | None = None
        looked = looked_for_failures = started
        while not ready(next_slice(started, deadline)):
            now = time.monotonic()
            if self._on_page or now - looked_for_failures >= self.look_s:
                looked_for_failures = now
                # The leader leaves the page only once it opened the node's last gate (or made
                # its last segment): gone, it is dead unless ready holds now. failure() takes
                # the same answer: asked again, the leader may have opened the gate and left
                # in between, and a rank preempted there announced it dead.
                gone = self._on_page and self._node.leader_gone()  # type: ignore[union-attr]
                if gone and ready(0.001):
                    break
                failure = self.failure(leader_gone=gone if self._on_page else None)
                if failure is not None:
                    raise PeerFailed(f"{self.what} failed on {failure}")
            if peer and now - looked >= self._progress_look_s:
                looked = now
                seen, progress = progress, self._progress()
                if seen is not None and seen != progress:
                    deadline = now + limit
            if time.monotonic() >= deadline:
                raise self._stalled(limit, what if isinstance(what, str) else what())
        if peer and self._node is not None and self._node.leads:
            self._node.advanced()  # what it waited for came: the node's ranks wait on

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
        self.post(key, f"{_FAILED}{self.what} failed on rank {self.rank}: {describe(error)}")

    def read(self, key: str, what: str) -> str:
        """The value another rank :meth:`post` s (or :meth:`withdraw` s) under ``key``: one
        blocking wait on the store, of ``timeout_s`` on a peer (more while the call
        progresses)."""
        name = f"posted/{key}"
        self._blocking(name, what)
        return self._released(name)

    def _released(self, key: str) -> str:
        """The value of ``key``, set; :class:`PeerFailed` if a failing rank set it instead
        (:meth:`announce`, :meth:`withdraw`), marked on the node's page too."""
        value = bytes(self._store.get(key)).decode()
        if value.startswith(_FAILED):
            if self._node is not None:
                self._node.fail()
            raise PeerFailed(value.removeprefix(_FAILED))
        return value

    def barrier(self, what: str) -> None:
        """Until every rank of the call arrived here: a barrier with no process group.

        With a :class:`Node` attached, a node's ranks arrive on its page and its
        leader arrives for them all: one ``add`` per node, and one blocking
        ``wait`` per leader on a key the last arriver sets (or a failure,
        :meth:`announce`); the other ranks look at their page. A node that holds
        every rank of the call asks the store nothing. Without a node, each rank
        does that itself.

        :raises PeerFailed: at once, when any rank announces a failure.
        :raises Stalled: as :meth:`wait` on a peer does.
        """
        gate, node = _gate(self._barriers), self._node
        passed = self._barriers + 1
        if node is not None and not node.leads:
            node.arrive()
            # the leader's own wait is bounded; it opens the gate or announces the failure
            self.wait(polled_locally(lambda: node.gate() >= passed), what, peer=True, grace=2)
            self._barriers = passed
            return
        if node is not None:
            ranks = f"this node's {node.size} ranks to arrive ({what})"
            self.wait(polled_locally(lambda: node.arrived(passed)), ranks, peer=True)
            if node.size == self.world:  # the node is the whole call: no other leader to meet
                self._barriers = passed
                node.open(passed)
                return
        if self._store.add(f"arrived/{gate}", node.size if node else 1) == self.world:
            self._store.compare_set(gate, "", _GO)
        self._blocking(gate, what)
        self._released(gate)
        self._barriers = passed
        if node is not None:
            node.open(passed)

    def _blocking(self, key: str, what: str) -> None:
        """One blocking store wait for ``key`` (on a peer), renewed while the call progresses.

        A wait that outlasts its bound makes torch log a line of its own; that
        happens only while a load runs longer than ``timeout_s``, or on the way
        to :class:`Stalled`.
        """
        limit = self._bound() + PEER_GRACE_S
        progress = self._progress()
        while True:
            try:
                self._store.wait([key], datetime.timedelta(seconds=limit))
                return
            except Exception:  # the timeout; a store that is gone fails again below
                if progress == (progress := self._progress()):
                    raise self._stalled(limit, what) from None

    def _bound(self) -> float:
        """``timeout_s``; an error where nothing set it: a wait with no deadline could hang."""
        if self.timeout_s == float("inf"):
            raise RuntimeError(
                f"Board({self.what!r}): a wait before check_in(timeout_s), which bounds them"
            )
        return self.timeout_s

    def _stalled(self, limit: float, what: str) -> Stalled:
        """The error of a wait of ``limit`` seconds for ``what`` that ran out, announced."""
        extra = limit - self.timeout_s
        bound = f"{limit:g} s (timeout_s + {extra:g} s)" if extra else f"timeout_s={limit:g} s"
        stalled = Stalled(f"rank {self.rank} waited {bound} for {what}")
        self.announce(stalled)
        return stalled

    def wait_work(self, work: Any, what: str) -> None:
        """:meth:`wait` on another rank for a gloo ``Work`` (its own errors are raised as they are)."""

        def done(slice_s: float) -> bool:
            try:
                work.wait(datetime.timedelta(seconds=slice_s))
            except RuntimeError:
                if not work.is_completed():
                    return False
                work.wait()  # completed in between, or failed: its own outcome
            return True

        self.wait(done, what, peer=True)


def _gate(number: int) -> str:
    """The key that opens a call's barrier ``number`` (from 0), or says why it never will."""
    return f"gate/{number}"
