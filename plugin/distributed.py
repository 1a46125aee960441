"""Collective safety: bounded waits, and one rank's failure raised on every rank.

Every megastart collective runs inside :func:`all_or_none`: the block runs on
every rank, then the ranks agree (over a gloo control group of their own,
bounded by ``timeout_s``) on whether any of them failed. If one did, every rank
raises the same :class:`CollectiveError`, naming the rank and its error. A rank
that died or never arrived makes the others raise after ``timeout_s`` instead of
hanging.

A call that streams data also keeps a :class:`Board` in torch.distributed's
store: ranks check in there before any process group is made (so a rank that
never comes is named), a failing rank announces its error there at once, and
every wait of the call looks at it (so no rank waits ``timeout_s`` on a peer
that has already given up). :class:`Sticky` makes a call that failed in a
process fail at once when it is made again.
"""

from __future__ import annotations

import datetime
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from megastart.errors import CollectiveError

if TYPE_CHECKING:
    import torch.distributed as dist


class PeerFailed(CollectiveError):
    """This rank stopped because another rank announced its failure on the :class:`Board`."""


class Stalled(CollectiveError):
    """A wait took longer than ``timeout_s``; the message names what was waited for."""


class FailedBefore(CollectiveError):
    """A megastart call was made again in a process where it had failed (:class:`Sticky`)."""


POLL_S = 0.1
"""How long a wait blocks before it looks at the :class:`Board` again."""

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
    :data:`POLL_S` at a time and looks at the board in between, so a failure
    anywhere stops it within a slice; a wait that outlasts ``timeout_s`` is
    announced as a failure of its own, naming what it waited for. A store round
    trip per slice is all it costs.

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
            failure = f"rank {self.rank}: {_describe(error)}"
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
        deadline = time.monotonic() + limit
        # The readers' progress is looked at once the first slice did not do: most waits end in it.
        progress: int | None = None
        looked = time.monotonic()
        while not ready(POLL_S):
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


def polled(condition: Callable[[], bool], first_pause_s: float) -> Callable[[float], bool]:
    """A ``ready`` for :meth:`Board.wait` that polls ``condition``: every ``first_pause_s`` at
    first (the peer usually answers at once), then less often, up to every quarter
    :data:`POLL_S`."""

    def ready(slice_s: float) -> bool:
        deadline = time.monotonic() + slice_s
        pause = first_pause_s
        while not condition():
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, POLL_S / 4)
        return True

    return ready


class Sticky:
    """Once a collective call failed in a process, every later call there fails at once.

    A failed call leaves its peers and groups in an unknown state, and ranks do
    not retry together (a host retries an RPC on the rank where it failed), so a
    second run would wait for ranks that are not coming, or meet collectives
    that are not its own.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.failure: BaseException | None = None

    @contextmanager
    def guard(self, *, passes: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Run the block unless the call failed before; remember its failure
        (errors of the ``passes`` types leave the ranks in step and are not kept)."""
        if self.failure is not None:
            raise FailedBefore(
                f"{self.what}: not run again: it already failed in this process "
                f"({_describe(self.failure)}); a retry on some ranks only would wait for "
                "the others or meet their collectives. Restart the process (and do not let "
                "the host retry calls that reach megastart hooks)"
            ) from self.failure
        try:
            yield
        except passes:
            raise
        except BaseException as e:
            self.failure = e
            raise

    def reset(self) -> None:
        """Forget the failure: only for a process that rebuilt its process groups (tests, demos)."""
        self.failure = None


def new_group(ranks: Sequence[int] | None, *, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """A process group of megastart's own, every wait bounded by ``timeout_s``.

    Collective over WORLD, like ``torch.distributed.new_group``. Destroy it with
    :func:`destroy_group` when done, so it keeps no communicator buffers.
    """
    import torch.distributed as dist

    group = dist.new_group(
        ranks=list(ranks) if ranks is not None else None,
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    assert group is not None
    return group


def destroy_group(group: dist.ProcessGroup | None) -> None:
    import torch.distributed as dist

    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(group)


class _Kept(NamedTuple):
    """A control group kept for a call name, and the WORLD group it was made in."""

    world: dist.ProcessGroup | None
    group: dist.ProcessGroup


_kept: dict[str, _Kept] = {}
"""Per call name, its kept control group."""


def kept_control(what: str, *, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over WORLD for the phase reports of ``what``: made (collectively) by its
    first call in this process and kept for the later ones, made anew once WORLD was rebuilt.

    Tearing a gloo group down costs a warm 1 GB load about 40 ms of wall time even off its
    thread (its connections close one by one), a fifth of the load; kept, it holds a socket
    per peer and two idle threads. Its gloo timeout is the first call's ``timeout_s``: a
    call's waits that may be long (for a reader) go through its :class:`Board`. A host that
    destroys it (or every group) makes the next call make another.
    """
    import torch.distributed as dist

    world = dist.group.WORLD
    kept = _kept.get(what)
    if kept is None or kept.world is not world or not _exists(kept.group):
        kept = _kept[what] = _Kept(world, new_group(None, backend="gloo", timeout_s=timeout_s))
    return kept.group


def discard_control(what: str) -> None:
    """Destroy the control group kept for ``what`` (after a failed call: it may hold operations
    that never completed)."""
    kept = _kept.pop(what, None)
    if kept is not None and _exists(kept.group):
        destroy_group(kept.group)


def _exists(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (not destroyed by the host since)."""
    from torch.distributed import distributed_c10d

    return group in distributed_c10d._world.pg_map


class OwnGroups:
    """The process groups one megastart call makes for itself, destroyed together at its end.

    Used as a context manager. On exit every group is shut down at once, in the
    order made (the same on every rank), so NCCL frees its communicators there.
    The C++ teardown that remains is slow for gloo (its event loop is waited on
    once per connection, about 10 ms each), so a thread of its own drops the
    last references and the call returns without waiting. Keep no reference to
    the groups past the ``with`` block, or that teardown runs wherever the last
    one is dropped.
    """

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._groups: list[dist.ProcessGroup] = []

    def new(self, ranks: Sequence[int] | None, *, backend: str) -> dist.ProcessGroup:
        """:func:`new_group` (collective over WORLD), destroyed with the others."""
        group = new_group(ranks, backend=backend, timeout_s=self.timeout_s)
        self._groups.append(group)
        return group

    def __enter__(self) -> OwnGroups:
        return self

    def __exit__(self, *exc_info: object) -> None:
        groups, self._groups = self._groups, []
        for group in groups:
            destroy_group(group)
        threading.Thread(target=groups.clear, name="megastart-group-teardown").start()


class Outcome:
    """What the ranks report at the end of an :func:`all_or_none` block.

    A rank may :meth:`share` one value; once the block has succeeded on every
    rank, :attr:`shared` holds every rank's, in rank order. The same
    all-gather carries the values and the verdict: sharing costs no collective.
    """

    def __init__(self) -> None:
        self._mine: Any = None
        self.shared: list[Any] = []

    def share(self, value: Any) -> None:
        """Send ``value`` (small, picklable) to every rank with this rank's report."""
        self._mine = value


@contextmanager
def all_or_none(
    what: str,
    *,
    timeout_s: float,
    control: dist.ProcessGroup | None = None,
    board: Board | None = None,
) -> Iterator[Outcome]:
    """Run the block on every rank; if it fails on any rank, raise on every rank.

    :param what: what the block does, for the message (``"rank0_loader: stream"``).
    :param timeout_s: how long a rank waits for the others to report.
    :param control: a gloo group over the participating ranks; by default one
        over WORLD is made for this call and destroyed after it. The block must
        leave no operation of its own pending on it.
    :param board: the call's :class:`Board`: an error is announced there as
        soon as it leaves the block; the message names the rank whose own error
        it was, not the ranks that stopped because of it (:class:`PeerFailed`).
    """
    import torch.distributed as dist

    own_control = control is None
    if control is None:
        control = new_group(None, backend="gloo", timeout_s=timeout_s)
    outcome = Outcome()
    local: BaseException | None = None
    try:
        yield outcome
    except BaseException as e:  # re-raised below, on every rank
        local = e
        if board is not None:
            board.announce(e)
    try:
        mine = None if local is None else _describe(local)
        secondary = isinstance(local, PeerFailed)
        reports: list[tuple[str | None, bool, Any]] = [(None, False, None)] * dist.get_world_size(
            control
        )
        try:
            dist.all_gather_object(
                reports,
                (mine, secondary, outcome._mine if local is None else None),
                group=control,
            )
        except Exception as e:
            here = "" if mine is None else f" failed on rank {dist.get_rank()}: {mine};"
            raise CollectiveError(
                f"{what}{here} the other ranks did not report within {timeout_s:.0f} s "
                f"(a rank died, hung, or never entered this step): {e}"
            ) from (local or e)
        failed = sorted(  # a rank's own error first, then those it made others stop with
            (peer, dist.get_global_rank(control, i), report)
            for i, (report, peer, _) in enumerate(reports)
            if report is not None
        )
        if failed:
            _, first_rank, first = failed[0]
            rest = sorted(rank for peer, rank, _ in failed[1:] if not peer)
            others = f" (and on ranks {rest})" if rest else ""
            raise CollectiveError(f"{what} failed on rank {first_rank}{others}: {first}") from local
        outcome.shared = [value for _, _, value in reports]
    finally:
        if own_control:
            destroy_group(control)


def broadcast_or_raise(
    what: str, produce: Callable[[], Any], *, src: int, timeout_s: float, control: dist.ProcessGroup
) -> Any:
    """``produce()`` run on rank ``src``, its result returned on every rank; its error raised on every rank.

    One broadcast: the other ranks have nothing to report, so no all-gather is needed.
    ``produce()`` runs on a thread of its own: if it has not returned within ``timeout_s``
    (a read the storage never answers), that is the error, on every rank; the thread
    is left to the kernel.
    """
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == src:
        box[0] = _bounded(produce, timeout_s)
    try:
        dist.broadcast_object_list(box, src=src, group=control)
    except Exception as e:
        raise CollectiveError(
            f"{what}: rank {src} did not send its result within {timeout_s:.0f} s "
            f"(it died, hung, or never entered this step): {e}"
        ) from e
    error, value = box[0]
    if error is not None:
        raise CollectiveError(f"{what} failed on rank {src}: {error}")
    return value


def _bounded(produce: Callable[[], Any], timeout_s: float) -> tuple[str | None, Any]:
    """``(None, produce())``, or ``(error, None)`` if it raised or did not return within ``timeout_s``."""
    outcome: list[tuple[str | None, Any]] = []

    def run() -> None:
        try:
            outcome.append((None, produce()))
        except BaseException as e:  # raised by the caller, on every rank
            outcome.append((_describe(e), None))

    thread = threading.Thread(target=run, name="megastart-bounded", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return (
            f"it did not finish within timeout_s={timeout_s:g} s (the storage did not answer)",
            None,
        )
    return outcome[0]


def agree(what: str, values: Mapping[str, Any], *, control: dist.ProcessGroup, fix: str) -> None:
    """Raise on every rank if the ranks were given different ``values`` (a variable set on
    one node only): their collectives would not match, and would wait or abort.

    :param fix: what to do about it, for the message.
    """
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(everyone, dict(values), group=control)
    differ = []
    for key in values:
        ranks_by_value: dict[str, list[int]] = {}
        for index, theirs in enumerate(everyone):
            rank = dist.get_global_rank(control, index)
            ranks_by_value.setdefault(repr(theirs.get(key)), []).append(rank)
        if len(ranks_by_value) > 1:
            differ.append(
                f"{key} is "
                + ", ".join(f"{value} on ranks {ranks}" for value, ranks in ranks_by_value.items())
            )
    if differ:
        raise CollectiveError(f"{what}: the ranks' settings differ: {'; '.join(differ)}; {fix}")


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, CollectiveError):
        return str(error)
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    if where:
        frame = where[0]
        text += f" [{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}]"
    return text
