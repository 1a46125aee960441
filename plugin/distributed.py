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
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

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


@contextmanager
def all_or_none(
    what: str, *, timeout_s: float, control: dist.ProcessGroup | None = None
) -> Iterator[None]:
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
    local: BaseException | None = None
    try:
        yield
    except BaseException as e:  # re-raised below, on every rank
        local = e
    try:
        mine = None if local is None else _describe(local)
        reports: list[str | None] = [None] * dist.get_world_size(control)
        try:
            dist.all_gather_object(reports, mine, group=control)
        except Exception as e:
            here = "" if mine is None else f" failed on rank {dist.get_rank()}: {mine};"
            raise CollectiveError(
                f"{what}{here} the other ranks did not report within {timeout_s:.0f} s "
                f"(a rank died, hung, or never entered this step): {e}"
            ) from (local or e)
        failed = [
            (dist.get_global_rank(control, i), report)
            for i, report in enumerate(reports)
            if report is not None
        ]
        if failed:
            first_rank, first = failed[0]
            others = "" if len(failed) == 1 else f" (and on ranks {[r for r, _ in failed[1:]]})"
            raise CollectiveError(f"{what} failed on rank {first_rank}{others}: {first}") from local
    finally:
        if own_control:
            destroy_group(control)


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, CollectiveError):
        return str(error)
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    if where:
        frame = where[0]
        text += f" [{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}]"
    return text
