"""How buckets reach each rank: between nodes over the leaders' group, inside a node through shared memory.

A reader group (every rank with ``reader=global``, one node with ``reader=node``)
is split into its nodes (:func:`~megastart.distributed.node_key`). Each
node's lowest rank leads it; the reader leads its own node. A bucket crosses
to each other node that needs it once, broadcast among the leaders that need
it, in a group those leaders make alone under a prefix of the load's store (NCCL
for CUDA, gloo for CPU; no collective over WORLD, nothing registered with
torch.distributed); inside a node it is written once into the leader's shared-memory buffers
(:mod:`megastart.loader.stream.shm`), and every local rank copies its own slices out
of them, in parallel, with no socket. Small per-bucket headers ("bucket in
buffer *s*", or the reader's error) go over a gloo group of the node, and a
second one carries "done with that buffer" back, so the leader knows when it may
refill a buffer. Neither is a group of the phases' control plane: a stream that
failed may leave operations pending on its groups, and the control plane must
still carry every rank's error. Every wait on them watches the load's
:class:`~megastart.distributed.Board`.

The reader's node takes its slices out of the page cache instead
(:mod:`~megastart.loader.stream.pagecache`) when every rank of it can: it needs no
buffers, and so neither of the node's groups (each costs milliseconds to make
and to destroy, a tenth of a warm load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megastart.distributed import Board, LocalGroup, OwnGroups
from megastart.loader.plan.buckets import Plan
from megastart.loader.plan.nodes import Nodes, local_buckets
from megastart.loader.stream.node import NodeBoard
from megastart.loader.stream.transport import Channel, open_leader_groups

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Route:
    """This rank's place in the stream: its reader group, its node, and the channels it is on."""

    group: Sequence[int]
    """Global ranks of the reader group, the reader first."""
    node: tuple[int, ...]
    """This rank's node: its positions in ``group``, its leader first."""
    nodes: Nodes | None
    """Every node of the group, where this rank needs them: on the reader, on a node leader,
    and in a group of one node (``None``: another rank of a group of several nodes, which
    needs its own node alone)."""
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
    """Every node leader reads a share of the buckets (:mod:`megastart.loader.plan.stripes`)."""

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
        assert self.nodes is not None, "only the reader and the node leaders send buckets"
        return tuple(self.group[p] for p in self.nodes.leaders_reached(positions))

    def local_buckets(self, plan: Plan) -> list[int]:
        """The buckets some rank of this node other than its leader needs, in plan order."""
        return local_buckets(self.node, plan)


def leader_sets(
    group: Sequence[int], nodes: Nodes, receiver_sets: Sequence[tuple[int, ...]]
) -> list[tuple[int, ...]]:
    """The global ranks of every group between node leaders that a reader group's stream
    uses, in the one order every leader makes its own: all its leaders first, then each other
    set of several leaders a bucket reaches, ascending. None for a reader group of one node;
    a bucket no other node needs goes to no group. Each group is made by its leaders alone
    (:func:`~megastart.loader.stream.transport.open_leader_groups`), as is a node's own two."""
    if len(nodes.members) == 1:
        return []
    everyone = tuple(group[p] for p in nodes.leaders)
    reached = {tuple(group[p] for p in nodes.leaders_reached(s)) for s in receiver_sets}
    return [everyone, *sorted({ranks for ranks in reached if len(ranks) > 1} - {everyone})]


def open_route(
    group: Sequence[int],
    node: tuple[int, ...],
    nodes: Nodes | None,
    receiver_sets: Sequence[tuple[int, ...]],
    own: OwnGroups,
    *,
    page_cache: Sequence[bool],
    backend: str,
    device: torch.device,
    board: Board,
    page: NodeBoard | None,
    striped: bool = False,
) -> Route:
    """Open every group this rank's part of the stream needs, each made by its own ranks alone
    (the groups between node leaders by those leaders, a node's by its ranks): no collective
    over WORLD; this rank's route.

    :param group: global ranks of this rank's reader group, the reader first.
    :param node: this rank's node, its positions in ``group`` ascending.
    :param nodes: every node of ``group`` (:attr:`Route.nodes`): needed on the reader and
        on a node leader of a group of several nodes.
    :param receiver_sets: the distinct :attr:`Bucket.positions` of the group's plan.
    :param page_cache: per rank of ``node``, whether it may take its slices out of the page
        cache; the reader's node does if all its ranks may (never with striped readers).
    :param backend: the backend between node leaders.
    :param board: the load's board, which every channel's waits watch (its store holds the
        groups' prefixes).
    :param page: this rank's node's page of the board (:func:`~megastart.loader.stream.node.node_board`).
    :param striped: each bucket is read by a leader of a node that needs it
        (``receiver_sets`` without the reader, :func:`~megastart.loader.plan.stripes.stripe`).
    """
    import torch
    import torch.distributed as dist

    position = group.index(dist.get_rank())
    route = Route(
        group,
        node,
        nodes,
        position,
        device,
        leaders=None,
        local=None,
        done=None,
        board=board,
        page=page,
        page_cache=not striped and node[0] == 0 and all(page_cache),
        striped=striped,
    )
    mine = tuple(group[p] for p in node)
    if len(node) < len(group) and route.leads:  # a leader of one of several nodes
        assert nodes is not None, "a node leader takes the group's nodes with its buckets"
        wire = device if backend == "nccl" else torch.device("cpu")
        sets = [s for s in leader_sets(group, nodes, receiver_sets) if mine[0] in s]
        between = open_leader_groups(sets, own, board.store, backend=backend)
        route.leaders = Channel(between[sets[0]], group[0], wire, between, board)
    if len(mine) > 1 and not route.page_cache:  # the node's two groups, made by its ranks alone
        sender = "the reader" if mine[0] == group[0] and not striped else "the node leader"
        node_store = dist.PrefixStore(f"node/{mine[0]}/", board.store)
        headers = own.local(dist.PrefixStore("headers/", node_store), mine)
        route.local = Channel(headers, mine[0], torch.device("cpu"), {}, board, sender)
        route.done = own.local(dist.PrefixStore("done/", node_store), mine)
    return route
