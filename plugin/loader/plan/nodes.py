"""The nodes of a reader group: which positions share a node, and which leads it.

The plan needs them (which node a bucket reaches, each node's view of the buckets); the
stream routes by them (:mod:`megastart.loader.stream.route`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megastart.loader.plan.buckets import Plan


@dataclass(frozen=True, slots=True)
class Nodes:
    """The nodes of one reader group: each node's positions in the group, in order.

    Node 0 holds position 0 (the reader); each node's first position leads it.
    """

    members: tuple[tuple[int, ...], ...]
    leader_of: tuple[int, ...]
    """Per position, its node's leader."""

    @classmethod
    def of(cls, keys: Sequence[object]) -> Nodes:
        """Group positions by node key (``keys[p]`` is position ``p``'s node)."""
        by_key: dict[object, list[int]] = {}
        for position, key in enumerate(keys):
            by_key.setdefault(key, []).append(position)
        leader = {key: positions[0] for key, positions in by_key.items()}
        members = tuple(tuple(positions) for positions in by_key.values())
        return cls(members, tuple(leader[key] for key in keys))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the runs of consecutive positions on one node, by the node's number (a
        node's ranks are consecutive where ``LOCAL_RANK`` is set): a few bytes a node, not a
        rank, for the node leaders that take it (:func:`~megastart.loader.plan.planning.handed_out`)."""
        number = {leader: i for i, leader in enumerate(self.leaders)}
        at = self.leader_of
        runs = [p for p, leader in enumerate(at) if p == 0 or leader != at[p - 1]]
        owners = tuple(number[at[p]] for p in runs)
        in_order = owners == tuple(range(len(owners)))  # each node one run: its number is its run's
        return _from_runs, (len(self.leader_of), tuple(runs), None if in_order else owners)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(node[0] for node in self.members)

    def node_of(self, position: int) -> tuple[int, ...]:
        return next(node for node in self.members if position in node)

    def leaders_reached(self, positions: Sequence[int]) -> tuple[int, ...]:
        """The leaders of the nodes that hold any of ``positions``, in node order (a node's
        leader is its first position, and the nodes go in the order of their first)."""
        return tuple(sorted({self.leader_of[p] for p in positions}))


def _from_runs(size: int, runs: tuple[int, ...], owners: tuple[int, ...] | None) -> Nodes:
    """The :class:`Nodes` of :meth:`Nodes.__reduce__`."""
    keys = [0] * size
    for run, (start, stop) in enumerate(zip(runs, (*runs[1:], size), strict=True)):
        keys[start:stop] = [run if owners is None else owners[run]] * (stop - start)
    return Nodes.of(keys)


def local_buckets(node: Sequence[int], plan: Plan) -> list[int]:
    """The buckets some rank of ``node`` (its positions, its leader first) other than its
    leader needs, in plan order (what the leader announces to its node)."""
    others = set(node[1:])
    return [i for i, bucket in enumerate(plan.buckets) if others.intersection(bucket.positions)]
