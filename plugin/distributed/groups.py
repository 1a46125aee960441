"""Process groups of megastart's own: made with a bounded timeout, kept for the process's
next call where that saves a teardown, destroyed off the critical path."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

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
    """The kept control group, and the WORLD group it was made in."""

    world: dist.ProcessGroup | None
    group: dist.ProcessGroup


_kept: list[_Kept] = []
"""This process's kept control group, if any."""


def kept_control(*, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over WORLD for the phase reports of megastart's calls (the loader's and the
    warmup's alike): made (collectively) by the first call in this process and kept for the
    later ones, made anew once WORLD was rebuilt.

    Tearing a gloo group down costs a warm 1 GB load about 40 ms of wall time even off its
    thread (its connections close one by one), a fifth of the load; kept, it holds a socket
    per peer and two idle threads, once per process rather than once per plugin. Its gloo
    timeout is the first call's ``timeout_s``: a call's waits that may be long (for a reader)
    go through its :class:`Board`. A host that destroys it (or every group) makes the next
    call make another.
    """
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _kept or _kept[0].world is not world or not _exists(_kept[0].group):
        _kept[:] = [_Kept(world, new_group(None, backend="gloo", timeout_s=timeout_s))]
    return _kept[0].group


def discard_control() -> None:
    """Destroy the kept control group (after a failed call: it may hold operations that never
    completed); the next call makes another."""
    if _kept and _exists(_kept[0].group):
        destroy_group(_kept[0].group)
    _kept.clear()


@contextmanager
def discarding_control() -> Iterator[None]:
    """:func:`discard_control` if the block fails (a call whose reports may not all have
    completed)."""
    try:
        yield
    except BaseException:
        discard_control()
        raise


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
