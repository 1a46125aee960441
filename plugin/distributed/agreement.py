"""Agreement among the ranks: a block that succeeds on every rank or fails on every rank
(:func:`all_or_none`), one rank's result on every rank, and settings that must match."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from megastart.distributed.board import Board
from megastart.distributed.errors import PeerFailed, describe
from megastart.distributed.groups import destroy_group, new_group
from megastart.errors import CollectiveError

if TYPE_CHECKING:
    import torch.distributed as dist


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
        mine = None if local is None else describe(local)
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
            outcome.append((describe(e), None))

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
