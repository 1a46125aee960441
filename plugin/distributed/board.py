"""The :class:`Board`: bounded waits of one collective call that look, between slices, at what
the ranks tell each other in torch.distributed's store (:mod:`~megastart.distributed.board_keys`):
the check-in, waits on a peer, barriers with no process group."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

from megastart.distributed.board_keys import (
    GO,
    LOOKS_PER_S,
    PROGRESS_LOOK_S,
    BoardKeys,
    gate_key,
)
from megastart.distributed.errors import PeerFailed, Stalled
from megastart.distributed.polling import next_slice, polled_locally
from megastart.errors import CollectiveError

__all__ = ["LOOKS_PER_S", "PEER_GRACE_S", "PROGRESS_LOOK_S", "Board"]

PEER_GRACE_S = 2.0
"""How much longer than ``timeout_s`` a rank waits on a peer than on itself: a rank
stalled in its own work (a read) then names its stall before its peers time out."""


class Board(BoardKeys):
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

    _barriers: int

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
            self._store.compare_set("start", "", GO)
        try:  # one blocking wait: a store wait that times out logs a c10d warning
            self._store.wait(["start"], datetime.timedelta(seconds=timeout_s))
        except Exception:  # the timeout; a store that is gone fails again below
            self._name_the_missing(timeout_s)
        start = self._released("start")
        if start != GO:
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
                gone = self._on_page and self._node.leader_gone()
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

    def read(self, key: str, what: str) -> str:
        """The value another rank :meth:`post` s (or :meth:`withdraw` s) under ``key``: one
        blocking wait on the store, of ``timeout_s`` on a peer (more while the call
        progresses)."""
        name = f"posted/{key}"
        self._blocking(name, what)
        return self._released(name)

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
        gate, node = gate_key(self._barriers), self._node
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
            self._store.compare_set(gate, "", GO)
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
