"""``megastart bench plan --world N``: what one rank of each role does to plan a load in a
world of ``N`` ranks, measured in one process without starting ``N`` of them.

Every rank's demands are made as the ranks would make them (each distinct pipeline stage
and expert-parallel rank's parameters resolved against the synthetic checkpoint; tensor-
and data-parallel ranks share them), and its report pickled as the planning phase sends it
up the control plane's tree to rank 0 (:meth:`~megastart.distributed.Control.gather_up`);
then one rank of each role (the reader, rank 0; the leader of the second node; a member of
the second) runs what ``load_hf_checkpoint`` runs on it before the first byte moves, with
the loader's own functions: on the reader, the summary of every rank's report, the unused
tensors, the plan and each node's view of it; on the others, their node's reports, the
summary and their node's view as the control plane hands them down; on each, the stream's
process groups and its lookups of where each bucket
goes. Figures per role: process CPU seconds (best of ``--repeats``), the peak of Python
memory it allocated (``tracemalloc``, the reports it holds included), the bytes the tree
brings it while planning (computed from the payloads as the tree makes them), the process groups
each load makes (``between_leaders``: the groups between node leaders it is in, made by
those leaders alone; and the node's own two, made by its ranks alone; none a collective
over the world) and the groups of the control
plane's tree it is in (made once per process, :mod:`megastart.distributed.control`), and the
store requests per second of a
rank waiting at the board (the real :class:`~megastart.distributed.Board` wait with its node's
real page attached, a leader's or another rank's, over a store of one process, counted as they
go out), in the first seconds of a wait and once settled; and the world's, every rank waiting.
"""

from __future__ import annotations

import pickle
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

ROLES = ("reader", "leader", "member")

WAIT_S = 6.0
"""How long the store-request count waits at the board (past its settling, see
:data:`megastart.distributed.polling.SETTLE_S`)."""


def measure_world(
    demands_by_rank: list[Any],
    meta: Any,
    *,
    ranks_per_node: int,
    bucket_mb: float,
    repeats: int,
) -> dict[str, Any]:
    """The figures of each role (``plan_s``, ``plan_mb``, ``received_mb``, ``groups``,
    ``store_rps``) and the world's size (``demands_mb``: every rank's report, as pickled, what
    an all-gather would hand every rank).

    :param demands_by_rank: every rank's demands (:meth:`~megastart.loader.mapping.needs.Need.demands`).
    """
    from megastart.distributed import tree_levels
    from megastart.loader.plan.nodes import Nodes

    world = len(demands_by_rank)
    keys = [("node", r - r % ranks_per_node) for r in range(world)]
    reports = shared_reports(demands_by_rank, meta, keys)
    # a member of the second node: one of the reader's node takes the whole plan (its node's
    # view), as it takes its slices out of the page cache
    roles = {"reader": 0, "leader": ranks_per_node, "member": ranks_per_node + 1}
    if world == ranks_per_node:
        del roles["leader"]
        roles["member"] = 1
    if ranks_per_node == 1:
        del roles["member"]
    nodes = world // ranks_per_node
    rates = {leads: store_requests_per_second(leads=leads, nodes=nodes) for leads in (True, False)}
    levels = tree_levels(Nodes.of(keys).members)
    tree = [group for level in levels for group in level]
    results: dict[str, Any] = {
        "demands_mb": sum(map(len, reports)) / 2**20,
        "roles": {},
        "control": {  # kept for the process: made by its first load
            "groups": len(tree),
            "largest": max(map(len, tree), default=1),
            # gloo asks the store for each peer's address, once per pair and direction, and
            # each rank says its node (an add and a set), checks in, and meets once more
            "store_requests": sum(len(g) * (len(g) - 1) for g in tree) + 8 * world,
        },
    }
    up = received_up(reports, levels, set(roles.values()))
    for role, rank in roles.items():
        work, down = _planning(reports, meta, keys, rank, role, bucket_mb)
        made = work()
        results["roles"][role] = {
            "rank": rank,
            "plan_s": _best_cpu(repeats, work),
            "plan_mb": _peak_mb(work),
            "received_mb": (up[rank] + down) / 2**20,
            "groups": made["groups"],
            "between_leaders": made["between_leaders"],
            "control_groups": sum(rank in group for group in tree),
            "store_rps": rates[role != "member"],
        }
    results["store_rps_world"] = {  # every rank waiting at once: the leaders, and the others
        when: nodes * rates[True][when] + (world - nodes) * rates[False][when]
        for when in ("first", "settled")
    }
    return results


def shared_reports(
    demands_by_rank: list[Any], meta: Any, keys: list[tuple[str, int]]
) -> list[bytes]:
    """Each rank's report of the planning phase's mapping, pickled as it goes up the control
    plane (:func:`~megastart.distributed.all_or_none`'s report of a
    :class:`~megastart.loader.plan.demands.RankDemands`; a node's replicas the same bytes)."""
    import dataclasses

    from megastart.loader.plan.buckets import packed
    from megastart.loader.plan.demands import RankDemands
    from megastart.loader.settings import Rank0LoaderSettings

    packs = {id(d): packed(d, meta) for d in demands_by_rank}
    agreed = dataclasses.asdict(Rank0LoaderSettings())
    del agreed["progress"]
    made: dict[tuple[Any, int], bytes] = {}
    for rank, demands in enumerate(demands_by_rank):
        key = (keys[rank], id(demands))
        if key not in made:
            report = RankDemands(keys[rank], packs[id(demands)], "cuda", [], True, agreed)
            made[key] = pickle.dumps((None, False, report))
    return [made[(keys[r], id(d))] for r, d in enumerate(demands_by_rank)]


def received_up(
    reports: list[bytes], levels: list[list[tuple[int, ...]]], ranks: set[int]
) -> dict[int, int]:
    """Bytes each of ``ranks`` receives while the reports go up the control plane's tree
    (:meth:`~megastart.distributed.Control.gather_up`, its payloads made as it makes them): in
    its node's group every other rank's payload, in a group of leaders the others' heads, and
    on that group's leader their payloads."""
    from megastart.distributed.wire import INLINE_BYTES

    held: dict[int, dict[int, bytes]] = {r: {r: data} for r, data in enumerate(reports)}
    interned: dict[bytes, bytes] = {}
    received = dict.fromkeys(ranks, 0)
    for depth, level in enumerate(levels):
        for group in level:
            sizes = [len(pickle.dumps(held[r])) for r in group]
            rest = max(0, max(sizes) - INLINE_BYTES)
            for r in ranks.intersection(group):
                others = len(group) - 1
                payloads = depth == 0 or r == group[0]  # a node's group: an all-gather
                received[r] += others * (8 + INLINE_BYTES + (rest if payloads else 0))
            for r in group[1:]:  # its leader carries them up
                held[group[0]] |= {k: interned.setdefault(b, b) for k, b in held[r].items()}
    return received


def _planning(
    reports: list[bytes],
    meta: Any,
    keys: list[tuple[str, int]],
    rank: int,
    role: str,
    bucket_mb: float,
) -> tuple[Callable[[], dict[str, Any]], int]:
    """What ``load_hf_checkpoint`` computes on ``rank`` between the planning phase's reports
    and the stream's first byte (``reader=global``, as today's default), and the bytes it
    receives down the tree: the reader unpickles every distinct report, summarises them
    (:class:`~megastart.loader.plan.demands.WorldDemands`), plans the buckets and cuts each
    node's view of them; another rank unpickles its node's reports, the summary and its
    node's view as the control plane hands them down
    (:func:`~megastart.loader.plan.planning.handed_out`: a leader's with the group's nodes, a
    member's without)."""
    from megastart.distributed.control import scatter_parts
    from megastart.loader.mapping.mappings import mapping_for
    from megastart.loader.plan.buckets import build_plan
    from megastart.loader.plan.demands import WorldDemands
    from megastart.loader.plan.nodes import Nodes, local_buckets
    from megastart.loader.plan.planning import NODES, Outline, node_plan, node_views
    from megastart.loader.stream.route import leader_sets

    table = mapping_for(meta.architectures[0])
    nodes = Nodes.of(keys)
    group = range(len(keys))

    def plan_all() -> tuple[Any, dict[int, Any], Outline, bytes]:
        loaded: dict[int, Any] = {}  # each distinct report unpickled once, as gather_up does
        values = [loaded.get(id(b)) or loaded.setdefault(id(b), pickle.loads(b)) for b in reports]
        world = WorldDemands(meta, table, value_model=False, fix="")
        summary = pickle.dumps(world.summarise([value for _, _, value in values]))  # sent down
        plan = build_plan(world.demands, meta, bucket_bytes=int(bucket_mb * 2**20))
        views = node_views(plan, nodes)
        pickle.dumps(scatter_parts(views))  # what the scatter sends down from the reader
        sizes = tuple(b.nbytes for b in plan.buckets)
        outline = Outline(sizes, tuple(b.reader for b in plan.buckets), (0,))
        return plan, views, outline, summary

    plans = role == "reader" or len(nodes.members) == 1  # one node: every rank plans
    summary, handed, down = (b"", b"", 0) if plans else _handed_down(plan_all, nodes, rank, role)
    node = nodes.node_of(rank)

    def work() -> dict[str, Any]:
        layout: Nodes | None = nodes
        if plans:
            plan = plan_all()[0]
        else:
            # its node's reports, held in the phase, and rank 0's summary of the world's
            held = [pickle.loads(reports[r]) for r in node]
            pickle.loads(summary)
            view, outline = pickle.loads(handed)
            theirs = view.pop(NODES, None)
            layout = None if theirs is None else pickle.loads(theirs)
            plan = node_plan(outline, view)
        # the sets of leaders a bucket reaches; a leader makes those it is in, with them alone
        made = []
        if layout is not None:
            made = [s for s in leader_sets(group, layout, plan.receiver_sets) if rank in s]
        # the node's own two (headers, reports), made by its ranks alone; none on the reader's
        # node, which takes its slices out of the page cache
        local = 2 if len(node) > 1 and 0 not in node else 0
        if role == "member":  # Route.local_buckets: the buckets its leader announces
            looked = len(local_buckets(node, plan))
        else:  # the reader's and the leaders' Route.leaders_for of every bucket
            assert layout is not None
            looked = sum(len(layout.leaders_reached(b.positions)) for b in plan.buckets)
        if not plans:
            del held  # held to here, as the load holds them
        return {"groups": len(made) + local, "between_leaders": len(made), "looked": looked}

    return work, down


def _handed_down(
    plan_all: Callable[[], tuple[Any, dict[int, Any], Any, bytes]], nodes: Any, rank: int, role: str
) -> tuple[bytes, bytes, int]:
    """What the tree hands ``rank``'s node (made once, outside the timing): rank 0's summary,
    its node's view of the plan with the outline, and the bytes that reach it."""
    from megastart.distributed.wire import INLINE_BYTES
    from megastart.loader.plan.planning import NODES

    _, views, outline, summary = plan_all()
    view = dict(views[nodes.leader_of[rank]])
    if role == "member":  # the scatter's private part reaches the leader alone
        del view[NODES]
    handed = pickle.dumps((view, outline))
    return summary, handed, sum(8 + max(INLINE_BYTES, len(data)) for data in (summary, handed))


def _best_cpu(repeats: int, work: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best


def _peak_mb(work: Callable[[], Any]) -> float:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def store_requests_per_second(
    *, leads: bool, nodes: int, wait_s: float = WAIT_S
) -> dict[str, float]:
    """Store requests per second of a rank waiting ``wait_s`` at a real :class:`Board` on a
    peer that never answers, as the leader of one of ``nodes`` nodes or another rank of it
    (its board attached to a real page of node-shared memory): in the first
    :data:`~megastart.distributed.polling.SETTLE_S` seconds (``first``) and after (``settled``)."""
    import datetime

    import torch.distributed as dist

    from megastart.distributed import Board
    from megastart.distributed.polling import SETTLE_S
    from megastart.loader.stream.node import NodeBoard
    from megastart.loader.stream.shm import Segment

    started_here = not dist.is_initialized()
    if started_here:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        board = Board("bench-plan")
        board.timeout_s = wait_s + 60
        segment = Segment.create(NodeBoard.nbytes(2))
        segment.unlink()
        board.attach(NodeBoard(segment, 2, 0 if leads else 1), leaders=nodes)
        counting = CountingStore(board._store)
        board._store = counting
        start = time.monotonic()
        end = start + wait_s

        def never(slice_s: float) -> bool:
            time.sleep(min(slice_s, max(0.0, end - time.monotonic())))
            return time.monotonic() >= end

        board.wait(never, "nothing", peer=True)
        segment.close()
    finally:
        if started_here:
            dist.destroy_process_group()
    first = sum(1 for t in counting.times if t < start + SETTLE_S) / SETTLE_S
    settled = sum(1 for t in counting.times if t >= start + SETTLE_S) / (wait_s - SETTLE_S)
    return {"first": first, "settled": settled}


class CountingStore:
    """A store that passes every request on and notes when it went (an instrument: the board
    measured talks to the real store through it)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.times: list[float] = []
        self.names: list[str] = []
        """Each request's method (``"check"``, ``"wait"``, ...), in the order of :attr:`times`."""

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.times.append(time.monotonic())
            self.names.append(name)
            return method(*args, **kwargs)

        return counted
