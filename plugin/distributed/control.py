"""The control plane: the ranks' reports travel up and down a tree of small gloo groups (each
node's ranks, then up to :data:`FANOUT` node leaders at a time), never through a group over
the whole world.

A gloo group connects every pair of its ranks through torch.distributed's store: over 8,192
ranks that is 67 million store requests and 8,191 sockets per process before its first
message. The tree's groups hold a node (8 ranks) or :data:`FANOUT` leaders: at 8,192 ranks of
8 per node, a rank is in one group (two for a node leader, three for the 32 at the top) and
making them all costs the store about 0.16 million requests. They are made from the
store directly (``ProcessGroupGloo`` over a prefix of it), by their own ranks only: no
collective over WORLD, and the host's process-group bookkeeping is left as it was.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from megastart.distributed.groups import LocalGroup
from megastart.distributed.wire import allgather, broadcast, dumps, gather, loads

if TYPE_CHECKING:
    import torch.distributed as dist

FANOUT = 32
"""The most node leaders in one group of the tree (a node's group holds all its ranks)."""


def node_key() -> tuple[str, int]:
    """This rank's node: host name and the global rank of the node's local rank 0.

    Honours ``LOCAL_RANK`` (torchrun, Ray, RankPool), so several "nodes" can be
    simulated on one host; without it, the host name alone decides.
    """
    import torch.distributed as dist

    local_rank = os.environ.get("LOCAL_RANK")
    first = dist.get_rank() - int(local_rank) if local_rank is not None else -1
    return socket.gethostname(), first


def tree_levels(
    nodes: Sequence[Sequence[int]], fanout: int = FANOUT
) -> list[list[tuple[int, ...]]]:
    """The groups of the tree over ``nodes`` (each a node's global ranks), level by level from
    the nodes up; every group's ranks ascending, its first the one that goes up a level.

    Level 0 holds the nodes of several ranks; each later level cuts the leaders of the one
    below (the first rank of each of its groups, and of each node of one rank) into groups
    of at most ``fanout``, until one group holds them all. Rank 0, the lowest, leads every
    group it is in.
    """
    levels = [[tuple(sorted(node)) for node in nodes if len(node) > 1]]
    climbing = sorted(min(node) for node in nodes)
    while len(climbing) > 1:
        level = [tuple(climbing[i : i + fanout]) for i in range(0, len(climbing), fanout)]
        levels.append([group for group in level if len(group) > 1])  # one alone just climbs
        climbing = [group[0] for group in level]
    return levels


class Control:
    """The groups of the tree this rank is in, bottom up, and the collectives megastart's
    phases need on them: every rank's report on every rank (:meth:`gather`) or on rank 0
    (:meth:`gather_up`), rank 0's value on every rank (:meth:`broadcast`), and each node's
    own value from rank 0 (:meth:`scatter`). Each group's first rank leads it.

    :param top: the tree's top group, where known (to its ranks and every node leader): its
        ranks hold every report once they have exchanged theirs.
    :param node: this rank's node, its global ranks ascending (its first leads it).
    """

    def __init__(
        self,
        groups: Sequence[LocalGroup],
        top: tuple[int, ...] | None,
        world: int,
        node: tuple[int, ...] = (),
    ) -> None:
        self.groups = tuple(groups)
        self.top = top
        self.world = world
        self.node = node

    @property
    def group_ranks(self) -> list[tuple[int, ...]]:
        """The global ranks of each group this rank is in, bottom up."""
        return [group.ranks for group in self.groups]

    def gather(self, value: Any, *, timeout_s: float) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank.

        Up the tree, each group's ranks exchange what they hold and its leader carries it a
        level higher; the top group then holds everything, and each leader passes it down
        to its groups. Each exchange waits at most ``timeout_s``.
        """
        import torch.distributed as dist

        held: dict[int, Any] = {dist.get_rank(): value}
        for group in self.groups:
            for part in allgather(group, dumps(held), timeout_s):
                held.update(loads(part))
        if self.groups and self.top not in self.group_ranks:  # it all comes down from the top
            held = loads(self._down(b"", timeout_s))
        elif len(self.groups) > 1:  # the top's ranks lead groups below it
            self._down(dumps(held), timeout_s)
        return [held[rank] for rank in range(self.world)]

    def gather_up(self, value: Any, *, timeout_s: float) -> dict[int, Any]:
        """Every rank's ``value`` (picklable) on rank 0, by rank; elsewhere what passed through
        this rank on its way up: its node's (a node's ranks exchange theirs), and on a leader
        those of the nodes below it.

        Above the nodes, each group's rank sends to its leader only (:func:`~megastart.distributed.wire.gather`):
        a rank receives its node's values and its groups' sizes, not the world's. Values that
        pickle the same (a node's tensor-parallel replicas) cross each group once and are
        unpickled once, into one object. Each exchange waits at most ``timeout_s``.
        """
        import torch.distributed as dist

        held: dict[int, bytes] = {dist.get_rank(): pickle.dumps(value)}
        interned: dict[bytes, bytes] = {}  # one object per distinct value: pickled once each
        for group in self.groups:
            if group.ranks == self.node:
                parts: list[bytes] | None = allgather(group, dumps(held), timeout_s)
            else:
                parts = gather(group, dumps(held), timeout_s)
            if parts is None:  # its leader carries them up
                break
            for part in parts:
                held |= {r: interned.setdefault(b, b) for r, b in loads(part).items()}
        loaded: dict[int, Any] = {}  # by the pickled bytes' id
        for data in held.values():
            if id(data) not in loaded:
                loaded[id(data)] = pickle.loads(data)
        return {rank: loaded[id(data)] for rank, data in sorted(held.items())}

    @property
    def holds_all(self) -> bool:
        """Whether :meth:`gather_up` leaves every rank's value on every rank (one node, or one
        rank)."""
        return not self.groups or self.top == self.node

    def broadcast(self, value: Any, *, timeout_s: float) -> Any:
        """Rank 0's ``value`` (picklable) on every rank; rank 0 leads every group it is in."""
        return loads(self._down(dumps(value), timeout_s, top=True))

    def scatter(
        self,
        values: Mapping[int, Mapping[int, bytes]] | None,
        *,
        timeout_s: float,
        private: Collection[int] = (),
    ) -> dict[int, bytes]:
        """Rank 0's ``values[leader]`` on every rank of ``leader``'s node: each node gets its
        own, not the others' (``values``: by node leader, on rank 0; ignored elsewhere). A
        value is made of parts (``{part: bytes}``); a part is the same bytes in every value
        that holds it. The ``private`` parts reach the node leaders alone: a node's other
        ranks get the rest of its value.

        Down the tree, each group's leader sends what its group's subtrees need, and each
        rank keeps its own subtree's part (the leader too, for the groups it leads lower
        down): a leader the nodes below it (a contiguous range of leaders,
        :func:`tree_levels`), a node's other ranks their leader's value. A group carries each
        distinct value once, and each part once, however many values hold it.
        """
        import torch.distributed as dist

        rank = dist.get_rank()
        held: _Parts = ({}, [], {})
        if rank == 0:
            assert values is not None
            held = scatter_parts(values)
        for group in reversed(self.groups):
            if group.index == 0:
                sent = held
                if group.ranks == self.node:  # this node's ranks: its own value alone
                    held = _kept(held, (rank,))
                    sent = _kept(held, (rank,), private)
                broadcast(group, dumps(sent), timeout_s)
                held = _kept(held, range(rank, group.ranks[1]))  # the leaders below it
                continue
            received = loads(broadcast(group, b"", timeout_s))
            if group.ranks == self.node:
                return _value(received, group.ranks[0])
            following = group.ranks[group.index + 1 : group.index + 2]
            held = _kept(received, range(rank, following[0] if following else self.world))
        return _value(held, rank)

    def _down(self, payload: bytes, timeout_s: float, *, top: bool = False) -> bytes:
        """``payload`` passed down this rank's groups, top first (the tree's top group too if
        ``top``), each from its leader: what came from above, as bytes (a leader's own
        ``payload`` where nothing is above it)."""
        for group in reversed(self.groups):
            if top or group.ranks != self.top:
                payload = broadcast(group, payload, timeout_s)
        return payload


def make_control(timeout_s: float, *, fanout: int = FANOUT) -> Control:
    """Make this rank's groups of the tree (collective over every rank, through the store).

    The ranks say which node they are on under a key of their node's; once all have (a
    barrier on the store), each reads its node's ranks, and each node's leader adds itself
    to the leaders; once all have, each leader reads them, and every rank makes the
    groups of :func:`tree_levels` it is in.

    :raises megastart.distributed.CollectiveError: when a rank does not come within
        ``timeout_s``, naming it.
    """
    import torch.distributed as dist

    from megastart.distributed.board import Board

    board = Board("control")
    store = board.store  # this tree's keys: the board numbers its calls
    rank = dist.get_rank()
    node = f"node/{hashlib.sha1(repr(node_key()).encode()).hexdigest()[:16]}"
    _add(store, node, rank)
    board.check_in(timeout_s)  # every rank has said which node it is on
    members = _listed(store, node)
    if rank == members[0]:
        _add(store, "leaders", rank)
    board.barrier("every node's leader to say so")
    nodes = [members]
    if rank == members[0]:  # the other nodes matter only as their leaders, a node of one each
        nodes += [(leader,) for leader in _listed(store, "leaders") if leader != rank]
    levels = tree_levels(nodes, fanout)
    one_node = store.add("leaders", 0) == 1  # else a node's group is not the top
    top = levels[-1][0] if levels[-1] and (len(levels) > 1 or one_node) else None
    groups = [  # a rank leads one group per level at most: its prefix
        LocalGroup.make(
            dist.PrefixStore(f"group/{level}/{ranks[0]}/", store), ranks, timeout_s=timeout_s
        )
        for level, its_groups in enumerate(levels)
        for ranks in its_groups
        if rank in ranks
    ]
    return Control(groups, top, dist.get_world_size(), members)


_Parts = tuple[dict[int, int], list[tuple[int, ...]], dict[int, bytes]]
"""What :meth:`Control.scatter` passes down: each leader's value (an index), each value's
parts, and each part's bytes."""


def scatter_parts(values: Mapping[int, Mapping[int, bytes]]) -> _Parts:
    """What rank 0 passes down in :meth:`Control.scatter`: each distinct value (by identity)
    once, each part once."""
    distinct: dict[int, int] = {}  # by the value's id
    pointers = {
        leader: distinct.setdefault(id(value), len(distinct)) for leader, value in values.items()
    }
    objects = {id(value): value for value in values.values()}
    parts = {part: data for value in objects.values() for part, data in value.items()}
    return pointers, [tuple(objects[key]) for key in distinct], parts


def _kept(held: _Parts, leaders: Sequence[int] | range, dropped: Collection[int] = ()) -> _Parts:
    """The part of a :meth:`Control.scatter` payload for ``leaders``: their pointers, the
    distinct values they point at (renumbered, without the ``dropped`` parts), and those
    values' parts."""
    pointers, values, parts = held
    kept: dict[int, int] = {}
    renumbered: dict[int, int] = {}
    for leader, index in pointers.items():
        if leader in leaders:
            kept[leader] = renumbered.setdefault(index, len(renumbered))
    chosen = [tuple(p for p in values[index] if p not in dropped) for index in renumbered]
    return kept, chosen, {part: parts[part] for value in chosen for part in value}


def _value(held: _Parts, leader: int) -> dict[int, bytes]:
    pointers, values, parts = held
    return {part: parts[part] for part in values[pointers[leader]]}


def _add(store: dist.Store, key: str, rank: int) -> None:
    """Add ``rank`` to the ranks listed under ``key``."""
    store.set(f"{key}/{store.add(key, 1)}", str(rank))


def _listed(store: dist.Store, key: str) -> tuple[int, ...]:
    """The ranks added under ``key``, ascending."""
    count = store.add(key, 0)
    values = store.multi_get([f"{key}/{i}" for i in range(1, count + 1)])
    return tuple(sorted(int(bytes(v)) for v in values))
