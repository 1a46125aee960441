"""Process groups of megastart's own: made with a bounded timeout, kept for the process's
next call where that saves a teardown, destroyed off the critical path."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

from megastart.distributed.control import Control, make_control

if TYPE_CHECKING:
    import torch.distributed as dist


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
    """The kept control plane, and the WORLD group it was made in."""

    world: dist.ProcessGroup | None
    control: Control


_kept: list[_Kept] = []
"""This process's kept control plane, if any."""


def kept_control(*, timeout_s: float) -> Control:
    """The control plane for the phase reports of megastart's calls (the loader's and the
    warmup's alike): its tree of small gloo groups (:mod:`.control`) made by the first call in
    this process (collectively, through the store) and kept for the later ones, made anew
    once WORLD was rebuilt.

    Making and tearing down even small gloo groups costs a warm load tens of milliseconds;
    kept, they hold a socket per peer of the groups this rank is in. Their gloo timeout is
    the first call's ``timeout_s``; each collective on them is bounded by its own.
    """
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _kept or _kept[0].world is not world:
        _kept[:] = [_Kept(world, make_control(timeout_s))]
    return _kept[0].control


def discard_control() -> None:
    """Let the kept control plane go (after a failed call: its groups may hold operations
    that never completed); the next call makes another. Its connections close off this
    thread (gloo closes them one at a time)."""
    dropped = list(_kept)
    _kept.clear()
    threading.Thread(target=dropped.clear, name="megastart-control-teardown").start()


@contextmanager
def discarding_control() -> Iterator[None]:
    """:func:`discard_control` if the block fails (a call whose reports may not all have
    completed)."""
    try:
        yield
    except BaseException:
        discard_control()
        raise


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
