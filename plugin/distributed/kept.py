"""The control plane kept for the process (:func:`kept_control`), and letting it go: after a
failed call, and when the host destroys its default process group.

A kept :class:`~megastart.distributed.Control` holds gloo groups made over a prefix of the
default group's store; on rank 0 that store is the server the host's next
``init_process_group`` on the same port needs. So when the host destroys its default group
the kept control plane must go with it, then and there, not at megastart's next call:
``init_process_group`` on the same port follows at once (NeMo-RL does it between its
conversion world and its training world), and meets the old server still listening.

How megastart hears of it without the host's help: the first :func:`kept_control` wraps
``torch.distributed.destroy_process_group`` (the name hosts call it by, and
``distributed_c10d``'s), so that destroying the default group first lets the kept control
plane go, its sockets closed before the wrapped function runs. A host that bound the
function to a name of its own before that (``from torch.distributed import
destroy_process_group``) is not seen there; for it, :func:`kept_control` also notices at its
next call that the default group is another one (it holds the old one only weakly) and
lets the old control plane go before making one in the new world.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from megastart.distributed.control import Control, make_control
from megastart.distributed.groups import drop_later, settle_drops

if TYPE_CHECKING:
    import torch.distributed as dist


class _Kept(NamedTuple):
    """The kept control plane, and the default group it was made in (held weakly: the host's
    group is the host's to destroy)."""

    world: weakref.ref[dist.ProcessGroup]
    control: Control


_kept: list[_Kept] = []
"""This process's kept control plane, if any."""


def kept_control(*, timeout_s: float) -> Control:
    """The control plane for the phase reports of megastart's calls (the loader's and the
    warmup's alike): its tree of small gloo groups, made by the first call in
    this process (collectively, through the store) and kept for the later ones, made anew
    in a new default group.

    Making and tearing down even small gloo groups costs a warm load tens of milliseconds;
    kept, they hold a socket per peer of the groups this rank is in. ``timeout_s`` bounds
    their making; each collective on them is bounded by its own call's ``timeout_s``.
    """
    import torch.distributed as dist

    _hook_destroy()
    world = dist.group.WORLD
    if _kept and _kept[0].world() is not world:  # the host made a new world: the old goes
        let_go()
    if not _kept:
        assert world is not None
        _kept.append(_Kept(weakref.ref(world), make_control(timeout_s)))
    return _kept[0].control


LET_GO_S = 5.0
"""How long :func:`let_go` waits at most for groups torn down on threads: those of a
successful call go in milliseconds; a failed call's may hold an operation until its
timeout, and are left to it."""


def let_go() -> None:
    """Drop the kept control plane now, and wait (at most :data:`LET_GO_S`) for the groups
    megastart's calls dropped on threads: their sockets closed, the store let go."""
    dropped = list(_kept)
    _kept.clear()
    drop_later(dropped, "megastart-control-teardown")
    settle_drops(LET_GO_S)


def discard_control() -> None:
    """Let the kept control plane go after a failed call (its groups may hold operations that
    never completed); the next call makes another.

    An operation in flight holds its group's teardown until the operation's own timeout,
    so a daemon thread drops them (:func:`~megastart.distributed.groups.drop_later`): a
    process whose call failed exits when the host is done with it, not that timeout later.
    """
    dropped = list(_kept)
    _kept.clear()
    drop_later(dropped, "megastart-control-teardown")


@contextmanager
def discarding_control() -> Iterator[None]:
    """:func:`discard_control` if the block fails (a call whose reports may not all have
    completed)."""
    try:
        yield
    except BaseException:
        discard_control()
        raise


def _hook_destroy() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (once per process) so that destroying
    the default group lets the kept control plane go first (:func:`let_go`)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original: Callable[..., Any] = distributed_c10d.destroy_process_group
    if getattr(original, "__megastart__", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        if group is None or group is distributed_c10d.GroupMember.WORLD:
            let_go()
        return original(group)

    destroy_process_group.__megastart__ = True  # type: ignore[attr-defined]
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
