"""The :class:`Board`: what the ranks of one call tell each other in torch.distributed's store
(check-in, a failure announced at once, progress), and bounded waits that look at it."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from megastart.distributed.errors import PeerFailed, Stalled, describe
from megastart.errors import CollectiveError

if TYPE_CHECKING:
    pass


POLL_S = 0.1
"""How long a wait blocks before it looks at the :class:`Board` again, for its first
:data:`SETTLE_S` seconds (most waits end within them)."""

SETTLE_S = 3.0
LONG_POLL_S = 1.0
"""After :data:`SETTLE_S` seconds a wait looks at the board (and a polled condition at the
store) once every this many seconds: a rank that waits long (a far bucket, a finished rank
at the final barrier) costs the store a few requests a second, not a hundred, and a failure
still reaches it within a second."""

PROGRESS_LOOK_S = 1.0
"""How often a wait on a peer looks at the call's progress (:meth:`Board.advance`): a stall is
named within this much of ``timeout_s`` after the last progress, at a store round trip per
look on every waiting rank."""

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
    """

    def __init__(self, what: str) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        number = _calls[what] = _calls.get(what, 0) + 1
        self.what = what
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = float("inf")
        self._advanced = -float("inf")
        self._store = dist.PrefixStore(f"megastart/{what}/{number}/", _get_default_store())

    def announce(self, error: BaseException) -> None:
        """Tell every rank that this one failed; the first failure announced is the one named.

        Ranks still checking in hear it too: they stop waiting for this one.
        """
        if not isinstance(error, PeerFailed):
            failure = f"rank {self.rank}: {describe(error)}"
            self._store.compare_set("failed", "", failure)
            self._store.compare_set("start", "", f"{_FAILED}{self.what} failed on {failure}")

    def failure(self) -> str | None:
        """``"rank R: error"`` of the first failure announced, or ``None``."""
        if not self._store.check(["failed"]):
            return None
        return bytes(self._store.get("failed")).decode()

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
            missing = [r for r in range(self.world) if not self._store.check([f"arrived/{r}"])]
            self._store.compare_set(
                "start",
                "",
                f"{self.what}: rank(s) {missing} did not start it within timeout_s={timeout_s:g} "
                "s (died, hung, or never called it); no process group was made",
            )
        start = bytes(self._store.get("start")).decode()
        if start.startswith(_FAILED):
            raise PeerFailed(start.removeprefix(_FAILED))
        if start != _GO:
            raise CollectiveError(start)

    def wait(
        self, ready: Callable[[float], bool], what: str | Callable[[], str], *, peer: bool = False
    ) -> None:
        """Until ``ready(slice_s)`` is true (it may block ``slice_s`` seconds).

        :param peer: the wait is on another rank: it gets :data:`PEER_GRACE_S` more,
            counted from the call's last progress (:meth:`advance`).
        :raises PeerFailed: within a slice of any rank announcing a failure.
        :raises Stalled: after ``timeout_s``, naming ``what`` (or what it returns
            then); announced first, so the others stop at once.
        """
        limit = self.timeout_s + (PEER_GRACE_S if peer else 0.0)
        started = time.monotonic()
        deadline = started + limit
        # The readers' progress is looked at once the first slice did not do: most waits end in it.
        progress: int | None = None
        looked = started
        while not ready(_slice(started, deadline)):
            failure = self.failure()
            if failure is not None:
                raise PeerFailed(f"{self.what} failed on {failure}")
            now = time.monotonic()
            if peer and progress is None:
                progress = self._progress()
            elif peer and now - looked >= PROGRESS_LOOK_S:
                looked = now
                if progress != (progress := self._progress()):
                    deadline = now + limit
            if time.monotonic() >= deadline:
                bound = (
                    f"{limit:g} s (timeout_s + {PEER_GRACE_S:g} s)"
                    if peer
                    else f"timeout_s={limit:g} s"
                )
                waited_for = what if isinstance(what, str) else what()
                stalled = Stalled(f"rank {self.rank} waited {bound} for {waited_for}")
                self.announce(stalled)
                raise stalled

    def advance(self) -> None:
        """A reader made progress: the peer waits' ``timeout_s`` starts again (a store round trip
        at most every half :data:`PROGRESS_LOOK_S`)."""
        now = time.monotonic()
        if now - self._advanced >= PROGRESS_LOOK_S / 2:
            self._advanced = now
            self._store.add("progress", 1)

    def _progress(self) -> int:
        return self._store.add("progress", 0)

    def post(self, key: str, value: str) -> None:
        """Leave ``value`` for the ranks that :meth:`read` ``key`` (a name, not data)."""
        self._store.set(f"posted/{key}", value)

    def read(self, key: str, what: str) -> str:
        """The value another rank :meth:`post` s under ``key``: :meth:`wait` on a peer for it.

        The store is polled, every millisecond at first (the peer usually posts
        at once), then less often, up to every :data:`POLL_S`.
        """
        name = f"posted/{key}"

        self.wait(polled(lambda: self._store.check([name]), 0.001), what, peer=True)
        return bytes(self._store.get(name)).decode()

    def arrive(self, key: str) -> None:
        """Count this rank in at ``key`` (for a rank waiting in :meth:`arrivals`)."""
        self._store.add(f"arrived/{key}", 1)

    def arrivals(self, key: str, count: int, what: str) -> None:
        """:meth:`wait` on peers until ``count`` ranks :meth:`arrive` d at ``key``: a barrier of
        a few ranks that needs no process group."""
        name = f"arrived/{key}"
        self.wait(polled(lambda: self._store.add(name, 0) >= count, 0.001), what, peer=True)

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


def _slice(started: float, deadline: float) -> float:
    """How long the next slice of a wait that started at ``started`` may block: :data:`POLL_S`
    at first, :data:`LONG_POLL_S` after :data:`SETTLE_S`, never past the ``deadline``."""
    now = time.monotonic()
    length = POLL_S if now - started < SETTLE_S else LONG_POLL_S
    return max(0.001, min(length, deadline - now))  # 0 would mean "no timeout" to gloo


def polled(
    condition: Callable[[], bool], first_pause_s: float, *, settled_pause_s: float = LONG_POLL_S
) -> Callable[[float], bool]:
    """A ``ready`` for :meth:`Board.wait` that polls ``condition``: every ``first_pause_s`` at
    first (the peer usually answers at once), then less often, up to every quarter
    :data:`POLL_S`, and after :data:`SETTLE_S` every ``settled_pause_s`` (a condition that
    asks the store; one that reads shared memory costs nothing and keeps looking often).
    The pause carries over from one slice to the next."""
    pause = first_pause_s
    started: float | None = None

    def ready(slice_s: float) -> bool:
        nonlocal pause, started
        now = time.monotonic()
        started = now if started is None else started
        deadline = now + slice_s
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            settled = time.monotonic() - started >= SETTLE_S
            pause = min(2 * pause, settled_pause_s if settled else POLL_S / 4)
        return True

    return ready
