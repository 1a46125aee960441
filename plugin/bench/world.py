"""``megastart bench plan --world N``: what one rank of each role does to plan a load in a
world of ``N`` ranks, measured in one process without starting ``N`` of them.

Every rank's demands are made as the ranks would make them (each distinct pipeline stage
and expert-parallel rank's parameters resolved against the synthetic checkpoint; tensor-
and data-parallel ranks share them), pickled as the planning phase's all-gather hands them
to every rank, and then one rank of each role (the reader, rank 0; the leader of the second
node; a member of the second) runs what ``load_hf_checkpoint`` runs on it before the
first byte moves, with the loader's own functions: on the reader, the unused tensors, the
plan and each node's view of it; on the others, their node's view as the control plane
hands it down; on each, the stream's process groups and its lookups of where each bucket
goes. Figures per role: process CPU seconds (best of ``--repeats``), the peak of Python
memory it allocated (``tracemalloc``, the gathered demands included), the process groups
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
    """The figures of each role (``plan_s``, ``plan_mb``, ``groups``, ``store_rps``) and the
    world's size (``demands_mb``: the all-gathered demands, as pickled).

    :param demands_by_rank: every rank's demands (:meth:`~megastart.loader.needs.Need.demands`).
    """
    from megastart.distributed import tree_levels
    from megastart.loader.plan import packed
    from megastart.loader.route import Nodes

    # Each rank packs its demands into what it shares (replicas the same bytes); every rank
    # unpickles all of that.
    packs = {id(d): packed(d, meta) for d in demands_by_rank}
    gathered = [pickle.dumps((r, packs[id(d)])) for r, d in enumerate(demands_by_rank)]
    world = len(gathered)
    keys = [("node", r - r % ranks_per_node) for r in range(world)]
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
    tree = [group for level in tree_levels(Nodes.of(keys).members) for group in level]
    results: dict[str, Any] = {
        "demands_mb": sum(map(len, gathered)) / 2**20,
        "roles": {},
        "control": {  # kept for the process: made by its first load
            "groups": len(tree),
            "largest": max(map(len, tree), default=1),
            # gloo asks the store for each peer's address, once per pair and direction, and
            # each rank says its node (an add and a set), checks in, and meets once more
            "store_requests": sum(len(g) * (len(g) - 1) for g in tree) + 8 * world,
        },
    }
    for role, rank in roles.items():
        work = _planning(gathered, meta, keys, rank, role, bucket_mb)
        made = work()
        results["roles"][role] = {
            "rank": rank,
            "plan_s": _best_cpu(repeats, work),
            "plan_mb": _peak_mb(work),
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


def _planning(
    gathered: list[bytes],
    meta: Any,
    keys: list[tuple[str, int]],
    rank: int,
    role: str,
    bucket_mb: float,
) -> Callable[[], dict[str, Any]]:
    """What ``load_hf_checkpoint`` computes on ``rank`` between the planning phase's all-gather
    and the stream's first byte (``reader=global``, as today's default): the reader plans the
    buckets and cuts each node's view of them; another rank unpickles its node's view as the
    control plane's scatter hands it over (:func:`~megastart.loader.planning.handed_out`)."""
    from megastart.distributed.control import scatter_parts
    from megastart.loader.mappings import mapping_for
    from megastart.loader.plan import build_plan, demands_once, distinct, unused_tensors
    from megastart.loader.planning import Outline, node_plan, node_views
    from megastart.loader.route import Nodes, leader_sets

    table = mapping_for(meta.architectures[0])
    nodes = Nodes.of(keys)
    group = list(range(len(keys)))

    def plan_all() -> tuple[Any, dict[int, Any], Outline]:
        by_rank = demands_once([pickle.loads(shared)[1] for shared in gathered], meta)
        unused_tensors(by_rank, meta, table)
        plan = build_plan(by_rank, meta, bucket_bytes=int(bucket_mb * 2**20))
        views = node_views(plan, nodes)
        pickle.dumps(scatter_parts(views))  # what the scatter sends down from the reader
        tensors = len({n for d in distinct(by_rank) for names, _ in d for n in names})
        sizes = tuple(b.nbytes for b in plan.buckets)
        outline = Outline(sizes, tuple(b.reader for b in plan.buckets), (0,), tensors)
        return plan, views, outline

    handed = b""
    plans = role == "reader" or len(nodes.members) == 1  # one node: every rank plans
    if not plans:  # what the scatter hands this node, made once, outside the timing
        _, views, outline = plan_all()
        handed = pickle.dumps((views[nodes.leader_of[rank]], outline))

    def work() -> dict[str, Any]:
        if plans:
            plan = plan_all()[0]
        else:
            # the gather's reports, which every rank still receives and holds in the phase
            reports = [pickle.loads(shared) for shared in gathered]
            view, outline = pickle.loads(handed)
            plan = node_plan(outline, view)
        # the sets of leaders a bucket reaches; this rank makes those it is in, with them alone
        made = [s for s in leader_sets(group, nodes, plan.receiver_sets) if rank in s]
        # the node's own two (headers, reports), made by its ranks alone; none on the reader's
        # node, which takes its slices out of the page cache
        local = 2 if len(nodes.node_of(rank)) > 1 and rank not in nodes.members[0] else 0
        if role == "member":  # Route.local_buckets: the buckets its leader announces
            looked = len(nodes.local_buckets(rank, plan))
        else:  # the reader's and the leaders' Route.leaders_for of every bucket
            looked = sum(len(nodes.leaders_reached(b.positions)) for b in plan.buckets)
        if not plans:
            del reports  # held to here, as the load holds them
        return {"groups": len(made) + local, "between_leaders": len(made), "looked": looked}

    return work


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
    from megastart.loader.node import NodeBoard
    from megastart.loader.shm import Segment

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
