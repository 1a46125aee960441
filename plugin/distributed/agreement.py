"""Agreement among the ranks: a block that succeeds on every rank or fails on every rank
(:func:`all_or_none`), one rank's result on every rank, and settings that must match."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from megastart.distributed.board import PEER_GRACE_S, Board
from megastart.distributed.errors import PeerFailed, describe
from megastart.errors import CollectiveError

if TYPE_CHECKING:
    from megastart.distributed.control import Control


class Outcome:
    """What the ranks report at the end of an :func:`all_or_none` block.

    A rank may :meth:`share` one value; once the block has succeeded on every
    rank, :attr:`shared` holds every rank's, in rank order. The same
    all-gather carries the values and the verdict: sharing costs no collective.
    With ``summarise``, the values go up to rank 0 alone, and every rank gets its
    :attr:`summary` of them instead (and :attr:`held`).
    """

    def __init__(self) -> None:
        self._mine: Any = None
        self.shared: list[Any] = []
        self.held: dict[int, Any] = {}
        """With ``summarise``: the values that passed through this rank, by rank (its node's;
        every rank's on rank 0, :meth:`~megastart.distributed.Control.gather_up`)."""
        self.summary: Any = None
        """With ``summarise``: rank 0's ``summarise(values)``, on every rank."""

    def share(self, value: Any) -> None:
        """Send ``value`` (small, picklable) to every rank with this rank's report."""
        self._mine = value


@contextmanager
def all_or_none(
    what: str,
    *,
    timeout_s: float,
    control: Control,
    board: Board | None = None,
    summarise: Callable[[list[Any]], Any] | None = None,
) -> Iterator[Outcome]:
    """Run the block on every rank; if it fails on any rank, raise on every rank.

    :param what: what the block does, for the message (``"rank0_loader: stream"``).
    :param timeout_s: how long a rank may take in the block; it waits for the others' reports
        that and twice :data:`~megastart.distributed.PEER_GRACE_S` longer.
    :param control: the control plane the ranks report over
        (:func:`~megastart.distributed.kept_control`).
    :param board: the call's :class:`Board`: an error is announced there as
        soon as it leaves the block; the message names the rank whose own error
        it was, not the ranks that stopped because of it (:class:`PeerFailed`).
    :param summarise: the shared values (every rank's, in rank order) to what every rank
        needs of them: they go up the tree to rank 0 alone, which decides the verdict and
        sends it down with its summary (:attr:`Outcome.summary`). A rank receives its node's
        values and the summary, not the world's values. Where every rank holds every value
        (one node), each summarises them itself. Its error is rank 0's.
    """
    import torch.distributed as dist

    outcome = Outcome()
    local: BaseException | None = None
    try:
        yield outcome
    except BaseException as e:  # re-raised below, on every rank
        local = e
        if board is not None:
            board.announce(e)
    mine = None if local is None else describe(local)
    secondary = isinstance(local, PeerFailed)
    waited_s = timeout_s + 2 * PEER_GRACE_S  # a rank stalled in its own work names it first
    report = (mine, secondary, outcome._mine if local is None else None)
    try:
        if summarise is None:
            reports: list[tuple[str | None, bool, Any]] = control.gather(report, timeout_s=waited_s)
            verdict = _verdict(what, reports)
        else:
            verdict = _summarised(what, report, outcome, summarise, control, waited_s)
    except Exception as e:
        here = "" if mine is None else f" failed on rank {dist.get_rank()}: {mine};"
        error = _unreported(what, here, "the other ranks did not report", waited_s, e, board)
        if board is not None and local is None:  # the peers still waiting stop with its cause
            board.announce(error)
        raise error from (local or e)
    if verdict is not None:
        raise CollectiveError(verdict) from local
    if summarise is None:
        outcome.shared = [value for _, _, value in reports]


def _verdict(what: str, reports: Sequence[tuple[str | None, bool, Any]]) -> str | None:
    """The error every rank raises for the ranks' ``reports`` (``None``: none failed): the
    first rank's own error, and the others that failed of their own."""
    failed = sorted(  # a rank's own error first, then those it made others stop with
        (peer, rank, report) for rank, (report, peer, _) in enumerate(reports) if report is not None
    )
    if not failed:
        return None
    _, first_rank, first = failed[0]
    rest = sorted(rank for peer, rank, _ in failed[1:] if not peer)
    others = f" (and on ranks {rest})" if rest else ""
    return f"{what} failed on rank {first_rank}{others}: {first}"


def _summarised(
    what: str,
    report: tuple[str | None, bool, Any],
    outcome: Outcome,
    summarise: Callable[[list[Any]], Any],
    control: Control,
    timeout_s: float,
) -> str | None:
    """:func:`all_or_none`'s reports up to rank 0, and its verdict and summary down: the
    verdict (``None``: none failed); the summary and the values held in ``outcome``."""
    import torch.distributed as dist

    held = control.gather_up(report, timeout_s=timeout_s)
    decided: tuple[str | None, Any] = (None, None)
    if control.holds_all or dist.get_rank() == 0:
        verdict = _verdict(what, list(held.values()))
        if verdict is None:
            try:
                decided = (None, summarise([value for _, _, value in held.values()]))
            except Exception as e:  # raised on every rank, as rank 0's
                decided = (f"{what} failed on rank 0: {describe(e)}", None)
        else:
            decided = (verdict, None)
    if not control.holds_all:
        decided = control.broadcast(decided, timeout_s=timeout_s)
    outcome.held = {rank: value for rank, (_, _, value) in held.items()}
    outcome.summary = decided[1]
    return decided[0]


def broadcast_or_raise(
    what: str, produce: Callable[[], Any] | Started, *, timeout_s: float, control: Control
) -> Any:
    """``produce()`` run on rank 0, its result returned on every rank; its error raised on every rank.

    One broadcast: the other ranks have nothing to report, so no gather is needed.
    ``produce()`` runs on a thread of its own (:class:`Started`: given one, rank 0 takes the
    outcome of what it started earlier): if it has not returned within ``timeout_s`` of its
    start (a read the storage never answers), that is the error, on every rank; the thread
    is left to the kernel.
    """
    import torch.distributed as dist

    if dist.get_rank() == 0:
        mine = (produce if isinstance(produce, Started) else Started(produce)).outcome(timeout_s)
    else:
        mine = None
    try:  # the others wait longer than rank 0 gives produce(): its error is the one named
        error, value = control.broadcast(mine, timeout_s=timeout_s + 2 * PEER_GRACE_S)
    except Exception as e:
        raise _unreported(what, ":", "rank 0 did not send its result", timeout_s, e, None) from e
    if error is not None:
        raise CollectiveError(f"{what} failed on rank 0: {error}")
    return value


def _unreported(
    what: str, here: str, missing: str, waited_s: float, error: Exception, board: Board | None
) -> CollectiveError:
    """The error of a report that did not come: the failure a rank announced on the ``board``
    if any (the real error: the control plane's is its echo); else a timeout, said to be
    one (``missing`` within ``waited_s``); else the control plane's own error. ``here``:
    this rank's own error, or a separator."""
    try:
        announced = board.failure() if board is not None else None
    except Exception:  # the store went with the rank that held it: the errors below say so
        announced = None
    if announced is not None:
        return CollectiveError(f"{what} failed on {announced}")
    if isinstance(error, TimeoutError):
        return CollectiveError(
            f"{what}{here} {missing} within {waited_s:.0f} s (a rank died, hung, or never "
            f"entered this step): {error}"
        )
    return CollectiveError(f"{what}{here} {missing}: {error}")


class Started:
    """``produce()`` running on a thread of its own from now on; :meth:`outcome` waits for it
    within a bound counted from its start. Rank 0 starts a load's metadata read this way
    before the ranks check in, and the read runs while it waits for them."""

    def __init__(self, produce: Callable[[], Any]) -> None:
        self._outcome: list[tuple[str | None, Any]] = []
        self._started = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, args=(produce,), name="megastart-bounded", daemon=True
        )
        self._thread.start()

    def _run(self, produce: Callable[[], Any]) -> None:
        try:
            self._outcome.append((None, produce()))
        except BaseException as e:  # raised by the caller, on every rank
            self._outcome.append((describe(e), None))

    def outcome(self, timeout_s: float) -> tuple[str | None, Any]:
        """``(None, produce())``, or ``(error, None)`` if it raised or did not return within
        ``timeout_s`` of its start."""
        self._thread.join(max(0.0, self._started + timeout_s - time.monotonic()))
        if not self._outcome:
            return (
                f"it did not finish within timeout_s={timeout_s:g} s (the storage did not answer)",
                None,
            )
        return self._outcome[0]


def agree(
    what: str, values: Mapping[str, Any], *, control: Control, timeout_s: float, fix: str
) -> None:
    """Raise on every rank if the ranks were given different ``values`` (a variable set on
    one node only): their collectives would not match, and would wait or abort.

    :param fix: what to do about it, for the message.
    """
    check_agreed(what, control.gather(dict(values), timeout_s=timeout_s), fix=fix)


def check_agreed(what: str, everyone: Sequence[Mapping[str, Any]], *, fix: str) -> None:
    """:func:`agree` on values already gathered (every rank's, in rank order), for a step
    that gathers them with something else: the same error on every rank."""
    differ = disagreement(what, everyone, fix=fix)
    if differ is not None:
        raise CollectiveError(differ)


def disagreement(what: str, everyone: Sequence[Mapping[str, Any]], *, fix: str) -> str | None:
    """The error of :func:`check_agreed` (``None``: the values agree), for a rank that
    decides for the others."""
    if all(theirs == everyone[0] for theirs in everyone):  # at 8,192 ranks, in milliseconds
        return None
    differ = []
    for key in everyone[0] if everyone else ():
        ranks_by_value: dict[str, list[int]] = {}
        for rank, theirs in enumerate(everyone):
            ranks_by_value.setdefault(repr(theirs.get(key)), []).append(rank)
        if len(ranks_by_value) > 1:
            differ.append(
                f"{key} is "
                + ", ".join(f"{value} on ranks {ranks}" for value, ranks in ranks_by_value.items())
            )
    return f"{what}: the ranks' settings differ: {'; '.join(differ)}; {fix}" if differ else None
