"""How buckets reach each rank: between nodes over the leaders' group, inside a node through shared memory.

A reader group (every rank with ``reader=global``, one node with ``reader=node``)
is split into its nodes (:func:`~megastart.distributed.node_key`). Each
node's lowest rank leads it; the reader leads its own node. A bucket crosses
to each other node that needs it once, broadcast among the leaders that need
it; inside a node it is written once into the leader's shared-memory buffers
(:mod:`megastart.loader.shm`), and every local rank copies its own slices out
of them, in parallel, with no socket. Small per-bucket headers ("bucket in
buffer *s*", or the reader's error) go over a gloo group of the node, and a
second one carries "done with that buffer" back, so the leader knows when it may
refill a buffer. Neither is a group of the phases' control plane: a stream that
failed may leave operations pending on its groups, and the control plane must
still carry every rank's error. Every wait on them watches the load's
:class:`~megastart.distributed.Board`.

The reader's node takes its slices out of the page cache instead
(:mod:`~megastart.loader.pagecache`) when every rank of it can: it needs no
buffers, and so neither of the node's groups (each costs milliseconds to make
and to destroy, a tenth of a warm load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megastart.distributed import Board, LocalGroup, OwnGroups
from megastart.loader.node import NodeBoard
from megastart.loader.plan import Plan
from megastart.loader.transport import Channel, open_receiver_groups

if TYPE_CHECKING:
    import torch


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

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(node[0] for node in self.members)

    def node_of(self, position: int) -> tuple[int, ...]:
        return next(node for node in self.members if position in node)

    def local_buckets(self, position: int, plan: Plan) -> list[int]:
        """The buckets some rank of ``position``'s node other than its leader needs, in plan
        order (what the leader announces to its node)."""
        others = set(self.node_of(position)[1:])
        return [i for i, bucket in enumerate(plan.buckets) if others.intersection(bucket.positions)]

    def leaders_reached(self, positions: Sequence[int]) -> tuple[int, ...]:
        """The leaders of the nodes that hold any of ``positions``, in node order (a node's
        leader is its first position, and the nodes go in the order of their first)."""
        return tuple(sorted({self.leader_of[p] for p in positions}))


@dataclass(slots=True)
class Route:
    """This rank's place in the stream: its reader group, its node, and the channels it is on."""

    group: list[int]
    """Global ranks of the reader group, the reader first."""
    nodes: Nodes
    position: int
    """This rank's position in ``group``."""
    device: torch.device
    """Where this rank's parameters live."""
    leaders: Channel | None
    """Headers and payloads between the node leaders (a leader of a group of several nodes)."""
    local: Channel | None
    """Headers from the node leader to the node's ranks (a node of several ranks)."""
    done: LocalGroup | None
    """The node's ranks report a buffer read over it (a node of several ranks)."""
    board: Board
    """The load's board: where failures are announced and every wait looks."""
    page: NodeBoard | None
    """This rank's node's page of the board (a node of several ranks)."""
    page_cache: bool
    """This rank's node is its reader's and takes its slices out of the page cache."""
    striped: bool = False
    """Every node leader reads a share of the buckets (:mod:`megastart.loader.stripes`)."""

    @property
    def node(self) -> tuple[int, ...]:
        return self.nodes.node_of(self.position)

    @property
    def leads(self) -> bool:
        return self.node[0] == self.position

    @property
    def members(self) -> list[int]:
        """Global ranks of this rank's node, its leader first."""
        return [self.group[p] for p in self.node]

    @property
    def leader(self) -> int:
        """Global rank of this rank's node leader."""
        return self.group[self.node[0]]

    @property
    def opens_files(self) -> bool:
        """Whether this rank opens the checkpoint's files: a reader (a striped leader too), or a
        rank of the reader's node that takes its slices out of the page cache."""
        return self.position == 0 or self.page_cache or (self.striped and self.leads)

    def leaders_for(self, positions: Sequence[int]) -> tuple[int, ...]:
        """Global ranks of the leaders a bucket for ``positions`` goes to, the reader first."""
        return tuple(self.group[p] for p in self.nodes.leaders_reached(positions))

    def local_buckets(self, plan: Plan) -> list[int]:
        """The buckets some rank of this node other than its leader needs, in plan order."""
        return self.nodes.local_buckets(self.position, plan)


def group_sets(
    groups: Sequence[Sequence[int]],
    nodes: Sequence[Nodes],
    receiver_sets: Sequence[Sequence[tuple[int, ...]]],
) -> list[tuple[int, ...]]:
    """The global ranks of every group between node leaders the stream makes (each
    ``new_group`` a collective over WORLD, made by every rank): per reader group of several
    nodes, one of all its leaders and one per other set of several leaders a bucket reaches.
    A bucket no other node needs goes to no group. (A node's own two groups are made by its
    ranks alone, :class:`~megastart.distributed.LocalGroup`.)"""
    leader_sets: list[tuple[int, ...]] = []
    for group, its_nodes, sets in zip(groups, nodes, receiver_sets, strict=True):
        if len(its_nodes.members) > 1:
            everyone = tuple(group[p] for p in its_nodes.leaders)
            reached = {tuple(group[p] for p in its_nodes.leaders_reached(s)) for s in sets}
            several = {ranks for ranks in reached if len(ranks) > 1}
            leader_sets += [everyone, *sorted(several - {everyone})]
    return leader_sets


def open_route(
    groups: list[list[int]],
    node_keys: Sequence[object],
    receiver_sets: list[list[tuple[int, ...]]],
    own: OwnGroups,
    *,
    page_cache: Sequence[bool],
    backend: str,
    device: torch.device,
    board: Board,
    page: NodeBoard | None,
    striped: bool = False,
) -> Route:
    """Open every process group the stream needs (collective over WORLD for the groups between
    node leaders; over the node's ranks for its own); this rank's route.

    :param groups: global ranks of every reader group, the reader first.
    :param node_keys: every global rank's node key.
    :param receiver_sets: per reader group, the distinct :attr:`Bucket.positions` of its plan.
    :param page_cache: per global rank, whether it may take its slices out of the page
        cache; a reader's node does if all its ranks may (never with striped readers).
    :param backend: the backend between node leaders.
    :param board: the load's board, which every channel's waits watch.
    :param page: this rank's node's page of the board (:func:`~megastart.loader.node.node_board`).
    :param striped: each bucket is read by a leader of a node that needs it
        (``receiver_sets`` without the reader, :func:`~megastart.loader.stripes.stripe`).
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    nodes = [Nodes.of([node_keys[r] for r in group]) for group in groups]
    cached = [
        not striped and all(page_cache[group[p]] for p in its_nodes.members[0])
        for group, its_nodes in zip(groups, nodes, strict=True)
    ]
    between = open_receiver_groups(group_sets(groups, nodes, receiver_sets), own, backend=backend)

    index = next(i for i, group in enumerate(groups) if rank in group)
    group, its_nodes = groups[index], nodes[index]
    position = group.index(rank)
    route = Route(
        group,
        its_nodes,
        position,
        device,
        leaders=None,
        local=None,
        done=None,
        board=board,
        page=page,
        page_cache=cached[index] and position in its_nodes.members[0],
        striped=striped,
    )
    mine = tuple(group[p] for p in route.node)
    if len(its_nodes.members) > 1 and route.leads:
        wire = device if backend == "nccl" else torch.device("cpu")
        everyone = tuple(group[p] for p in its_nodes.leaders)
        route.leaders = Channel(between[everyone], group[0], wire, between, board)
    if len(mine) > 1 and not route.page_cache:  # the node's two groups, made by its ranks alone
        sender = "the reader" if mine[0] == group[0] and not striped else "the node leader"
        node = dist.PrefixStore(f"node/{mine[0]}/", board.store)
        headers = own.local(dist.PrefixStore("headers/", node), mine)
        route.local = Channel(headers, mine[0], torch.device("cpu"), {}, board, sender)
        route.done = own.local(dist.PrefixStore("done/", node), mine)
    return route
