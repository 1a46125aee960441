"""Collective safety: bounded waits, and one rank's failure raised on every rank.

Every megastart collective runs inside :func:`all_or_none`: the block runs on
every rank, then the ranks agree (over a gloo control group of their own,
bounded by ``timeout_s``) on whether any of them failed. If one did, every rank
raises the same :class:`CollectiveError`, naming the rank and its error. A rank
that died or never arrived makes the others raise after ``timeout_s`` instead of
hanging.
"""

from __future__ import annotations

import datetime
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A megastart collective failed on at least one rank; raised on every rank."""


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
    what: str, *, timeout_s: float, control: dist.ProcessGroup | None = None
) -> Iterator[Outcome]:
    """Run the block on every rank; if it fails on any rank, raise on every rank.

    :param what: what the block does, for the message (``"rank0_loader: stream"``).
    :param timeout_s: how long a rank waits for the others to report.
    :param control: a gloo group over the participating ranks; by default one
        over WORLD is made for this call and destroyed after it.
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
    try:
        mine = None if local is None else _describe(local)
        reports: list[tuple[str | None, Any]] = [(None, None)] * dist.get_world_size(control)
        try:
            dist.all_gather_object(
                reports, (mine, outcome._mine if local is None else None), group=control
            )
        except Exception as e:
            here = "" if mine is None else f" failed on rank {dist.get_rank()}: {mine};"
            raise CollectiveError(
                f"{what}{here} the other ranks did not report within {timeout_s:.0f} s "
                f"(a rank died, hung, or never entered this step): {e}"
            ) from (local or e)
        failed = [
            (dist.get_global_rank(control, i), report)
            for i, (report, _) in enumerate(reports)
            if report is not None
        ]
        if failed:
            first_rank, first = failed[0]
            others = "" if len(failed) == 1 else f" (and on ranks {[r for r, _ in failed[1:]]})"
            raise CollectiveError(f"{what} failed on rank {first_rank}{others}: {first}") from local
        outcome.shared = [value for _, value in reports]
    finally:
        if own_control:
            destroy_group(control)


def broadcast_or_raise(
    what: str, produce: Callable[[], Any], *, src: int, timeout_s: float, control: dist.ProcessGroup
) -> Any:
    """``produce()`` run on rank ``src``, its result returned on every rank; its error raised on every rank.

    One broadcast: the other ranks have nothing to report, so no all-gather is needed.
    """
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            box[0] = (None, produce())
        except BaseException as e:  # raised below, on every rank
            box[0] = (_describe(e), None)
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


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, CollectiveError):
        return str(error)
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    if where:
        frame = where[0]
        text += f" [{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}]"
    return text
