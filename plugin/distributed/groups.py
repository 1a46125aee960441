"""Process groups of megastart's own: made with a bounded timeout (over WORLD, or by their own
ranks alone from the store), destroyed off the critical path."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
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


@dataclass(frozen=True)
class LocalGroup:
    """A group made by its own ranks alone, under a prefix of torch.distributed's store (a
    ``ProcessGroupGloo``, or a ``ProcessGroupNCCL`` for CUDA tensors): no collective over
    WORLD (``new_group`` is one, made by every rank), and not registered with
    torch.distributed, so the host's groups keep their names and counts."""

    ranks: tuple[int, ...]
    """Global ranks, ascending."""
    index: int
    """This rank's place in ``ranks``."""
    process_group: Any
    """Its ``ProcessGroupGloo`` or ``ProcessGroupNCCL``."""
    backend: str = "gloo"

    @classmethod
    def make(
        cls, store: dist.Store, ranks: Sequence[int], *, timeout_s: float, backend: str = "gloo"
    ) -> LocalGroup:
        """Made collectively by ``ranks`` (this rank among them) under ``store``, a prefix no
        other group uses. Gloo connects its ranks here; NCCL at the group's first collective
        (so ranks that share several groups use them in one order, as they make them)."""
        import torch.distributed as dist

        ranks = tuple(sorted(ranks))
        index = ranks.index(dist.get_rank())
        timeout = datetime.timedelta(seconds=timeout_s)
        group: Any
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, index, len(ranks), options)
        elif backend == "gloo":
            group = dist.ProcessGroupGloo(store, index, len(ranks), timeout)
        else:
            raise ValueError(f"a group of megastart's own is gloo or nccl, not {backend!r}")
        return cls(ranks, index, group, backend)

    def close(self, *, failed: bool) -> None:
        """Free an NCCL group's communicator now (aborted when ``failed``: an operation may be
        stuck in it); a gloo group is torn down with its last reference."""
        if self.backend == "nccl":
            if failed:
                self.process_group.abort()
            else:
                self.process_group.shutdown()

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, timeout_s: float | None = None
    ) -> dist.Work:
        """Broadcast ``tensor`` from global rank ``src``, within ``timeout_s`` (by default the
        group's)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = self.ranks.index(src)
        _bound(options, timeout_s)
        return self.process_group.broadcast([tensor], options)

    def all_gather(
        self, parts: list[torch.Tensor], tensor: torch.Tensor, *, timeout_s: float
    ) -> dist.Work:
        """Every rank's ``tensor`` into ``parts`` (one per rank), within ``timeout_s``: gloo
        bounds an operation by its own options, else by the group's timeout, fixed when the
        group was made (for a kept group, by another call than this one)."""
        from torch._C._distributed_c10d import AllgatherOptions

        options = AllgatherOptions()
        _bound(options, timeout_s)
        return self.process_group.allgather([parts], [tensor], options)

    def gather(
        self, parts: list[torch.Tensor], tensor: torch.Tensor, *, timeout_s: float
    ) -> dist.Work:
        """Every rank's ``tensor`` into ``parts`` (one per rank) on the group's first rank, its
        ``parts`` empty elsewhere; within ``timeout_s``."""
        from torch._C._distributed_c10d import GatherOptions

        options = GatherOptions()
        options.rootRank = 0
        _bound(options, timeout_s)
        return self.process_group.gather([parts] if parts else [], [tensor], options)

    def all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        return self.process_group.allreduce([tensor])


class OwnGroups:
    """The process groups one megastart call makes for itself (:class:`LocalGroup` s, each
    made by its own ranks), let go together at its end.

    Used as a context manager. On exit NCCL groups free their communicators at once
    (aborted if the call failed). The C++ teardown of gloo's is slow (its event loop is
    waited on once per connection, about 10 ms each), so a thread of its own drops the
    last references and the call returns without waiting. Keep no reference to
    the groups past the ``with`` block, or that teardown runs wherever the last
    one is dropped.
    """

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._local: list[LocalGroup] = []

    def local(
        self, store: dist.Store, ranks: Sequence[int], *, backend: str = "gloo"
    ) -> LocalGroup:
        """:meth:`LocalGroup.make` (collective over ``ranks`` only), let go with the others."""
        group = LocalGroup.make(store, ranks, timeout_s=self.timeout_s, backend=backend)
        self._local.append(group)
        return group

    def __enter__(self) -> OwnGroups:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        groups, self._local = self._local, []
        for group in groups:
            group.close(failed=exc_type is not None)
        drop_later([groups], "megastart-group-teardown")


_dropping: list[threading.Thread] = []
"""The threads of :func:`drop_later` not known to have ended."""


def drop_later(dropped: list[Any], name: str) -> None:
    """Clear ``dropped`` (the last references to process groups) on a thread named ``name``.

    A daemon thread: a group of a failed call may hold an operation until that operation's
    timeout, and its teardown waits for it; the process must not (it exits when the host
    is done with it). :func:`settle_drops` waits for them where it matters.
    """
    thread = threading.Thread(target=dropped.clear, name=name, daemon=True)
    _dropping[:] = [t for t in _dropping if t.is_alive()] + [thread]
    thread.start()


def settle_drops(timeout_s: float) -> None:
    """Wait, at most ``timeout_s`` in all, until the groups of :func:`drop_later` are torn
    down (their sockets closed, their hold on the store let go)."""
    deadline = time.monotonic() + timeout_s
    for thread in _dropping:
        thread.join(max(0.0, deadline - time.monotonic()))
    _dropping[:] = [t for t in _dropping if t.is_alive()]


def _bound(options: Any, timeout_s: float | None) -> None:
    """Bound the operation of ``options`` by ``timeout_s`` (``None``: the group's timeout)."""
    if timeout_s is not None:
        options.timeout = datetime.timedelta(seconds=timeout_s)
