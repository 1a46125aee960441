"""A load's planning at 8,192 ranks (Qwen3-235B-A22B, TP4 x PP8 x EP64, 1,024 nodes of 8),
computed from every rank's demands as the ranks make them, without starting a process: which
groups between node leaders each rank makes, and with whom, from the whole plan (the reader)
and from its node's view of it (every other leader); and what planning brings each rank."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from megastart.bench.synthetic import MODELS, Layout, synthetic_checkpoint, world_demands
from megastart.bench.world import received_up, shared_reports
from megastart.distributed import tree_levels
from megastart.loader.mapping.mappings import mapping_for
from megastart.loader.plan.buckets import build_plan
from megastart.loader.plan.demands import WorldDemands
from megastart.loader.plan.nodes import Nodes, local_buckets
from megastart.loader.plan.planning import NODES, Outline, node_plan, node_views
from megastart.loader.stream.route import leader_sets


@pytest.fixture(scope="module")
def qwen_8192() -> tuple[Any, list[Any]]:
    """The checkpoint's metadata and every rank's demands."""
    config = MODELS["qwen3-235b-a22b"]
    meta = synthetic_checkpoint(config)
    return meta, world_demands(config, meta, Layout(4, 8, 64), 8192)


def test_at_8192_ranks_each_group_between_leaders_is_made_by_its_leaders_alone(
    qwen_8192: tuple[Any, list[Any]],
) -> None:
    meta, demands = qwen_8192
    plan = build_plan(demands, meta, bucket_bytes=32 * 2**20)
    nodes = Nodes.of([rank // 8 for rank in range(8192)])
    world = list(range(8192))
    sets = leader_sets(world, nodes, plan.receiver_sets)

    # all 1,024 leaders first, then one per other set of several leaders a bucket reaches;
    # only node leaders are in one
    assert sets[0] == tuple(range(0, 8192, 8))
    assert sets[1:] == sorted(set(sets[1:])) and sets[0] not in sets[1:]
    assert all(rank % 8 == 0 for ranks in sets for rank in ranks)
    reached = {tuple(nodes.leaders_reached(b.positions)) for b in plan.buckets}
    assert {ranks for ranks in reached if len(ranks) > 1} <= set(sets)

    # what each rank makes (open_route): the sets it is in, in that order; a member none
    made = {rank: [s for s in sets if rank in s] for rank in world}
    assert all(made[rank] == [] for rank in world if rank % 8)
    assert all(made[rank][0] == sets[0] for rank in range(0, 8192, 8))
    # a group is made by exactly its own ranks: nothing over the world, nobody else waits
    makers: dict[tuple[int, ...], list[int]] = {}
    for rank, its in made.items():
        for ranks in its:
            makers.setdefault(ranks, []).append(rank)
    assert all(makers[ranks] == list(ranks) for ranks in sets)
    # a bucket reaches the nodes of one pipeline stage (1,024 ranks, 128 nodes) and the
    # reader's, or, an expert's, the 4 nodes of its expert-parallel rank and the reader's:
    # the reader is in every group, a stage's leader in a few
    assert made[0] == sets
    assert max(len(made[rank]) for rank in range(8, 8192, 8)) <= 0.1 * len(sets)
    sizes = [len(ranks) for ranks in sets[1:]]
    assert max(sizes) <= 128 + 1
    assert sum(size <= 4 + 1 for size in sizes) >= 0.9 * len(sizes)

    # no leader plans: each takes its node's view from the reader, with the group's nodes, and
    # makes from them alone exactly the groups above, in the same order; its node's ranks
    # take the same buckets
    views = node_views(plan, nodes)
    outline = Outline(
        tuple(b.nbytes for b in plan.buckets), tuple(b.reader for b in plan.buckets), (0,)
    )
    # one view per stage and pair of expert-parallel ranks (a node's 8 ranks: TP4 x 2 EP
    # ranks), shared by its nodes; the reader's node needs every bucket, and sees them all
    assert len({id(view) for view in views.values()}) == 8 * 64 // 2 + 1
    assert sorted(views[0]) == [NODES, *range(len(plan.buckets))]
    for leader in (8, 16, 4096, 8184):
        theirs = dict(views[leader])
        layout = pickle.loads(theirs.pop(NODES))
        assert layout == nodes
        view = node_plan(outline, theirs)
        assert [b.nbytes for b in view.buckets] == [b.nbytes for b in plan.buckets]
        assert len(theirs) < len(plan.buckets) // 4  # its stage's or experts' buckets
        assert all(view.buckets[i] == plan.buckets[i] for i in theirs)  # receivers too
        mine = [s for s in leader_sets(world, layout, view.receiver_sets) if leader in s]
        assert mine == made[leader]
        node = nodes.node_of(leader)  # what its leader announces to its other ranks
        assert local_buckets(node, view) == local_buckets(node, plan)

    # the control plane's groups: made once per process, none over more than 32 ranks
    tree = [group for level in tree_levels(nodes.members) for group in level]
    assert max(map(len, tree)) == 32 and len(tree) == 1024 + 32 + 1


def test_at_8192_ranks_a_rank_but_the_reader_receives_its_nodes_reports_not_the_worlds(
    qwen_8192: tuple[Any, list[Any]],
) -> None:
    """The planning phase's reports go up the control plane's tree to rank 0 alone, each node's
    exchanged among its ranks; every rank gets rank 0's summary of them (no rank's node in it:
    a rank takes its node's from the reports it holds), and its node's view of the plan (a
    node leader with the group's nodes, a few bytes a node). A member receives about the same
    bytes at 2,048 ranks as at 8,192, a leader the same but the group's nodes. The bytes each
    rank receives are those of the tree's payloads, made as it makes them."""
    meta, demands = qwen_8192
    small = world_demands(MODELS["qwen3-235b-a22b"], meta, Layout(4, 8, 64), 2048)
    table = mapping_for(meta.architectures[0])
    told: dict[int, dict[int, int]] = {}  # by world size and rank: its reports and summary
    received: dict[int, dict[int, int]] = {}  # and its node's view of the plan
    for size, its in ((8192, demands), (2048, small)):
        keys = [("node", rank - rank % 8) for rank in range(size)]
        nodes = Nodes.of(keys)
        reports = shared_reports(its, meta, keys)
        world = sum(map(len, reports))  # what an all-gather of the reports handed every rank
        assert world > 10 * 2**20 * size / 8192

        up = received_up(reports, tree_levels(nodes.members), {0, 8, 9, 256, size - 1})
        loaded: dict[int, Any] = {}
        values = [loaded.get(id(b)) or loaded.setdefault(id(b), pickle.loads(b)) for b in reports]
        summary = WorldDemands(meta, table, value_model=False, fix="")
        said = summary.summarise([value for _, _, value in values])
        assert said.nodes == size // 8 and said.readers == () and said.devices == {"cuda"}
        assert said.disagreement is None and said.unused == () and said.tensors > 30_000
        down = len(pickle.dumps(said))  # every rank but 0 receives it once
        assert down < 256  # no demand, and nothing per rank or per node
        # rank 0 takes them all, each node's tensor-parallel replicas' once
        assert up[0] < world / 3
        told[size] = {rank: up[rank] + down for rank in (8, 9, 256, size - 1)}

        plan = build_plan(summary.demands, meta, bucket_bytes=512 * 2**20)
        views = node_views(plan, nodes)
        outline = Outline(
            tuple(b.nbytes for b in plan.buckets), tuple(b.reader for b in plan.buckets), (0,)
        )
        received[size] = {}
        for rank, before in told[size].items():
            view = dict(views[nodes.leader_of[rank]])
            if rank not in nodes.leaders:  # the scatter's private part: a leader's alone
                del view[NODES]
            received[size][rank] = before + len(pickle.dumps((view, outline)))
    # a member: its node's 7 other reports; a node's leader: those and 31 leaders' sizes; the
    # leader of 32 nodes: their reports. Not the world's 12 MB: under 1 %, 2 %, 3 %
    for rank, bound in ((9, 0.01), (8191, 0.01), (8, 0.02), (256, 0.03)):
        assert told[8192][rank] < bound * 12 * 2**20, (rank, told[8192][rank])
    # in a world 4x the size: a member's and a leader's reports and summary, the same bytes; a
    # member's view of the plan about the same (its experts' buckets reach 4x the nodes), a
    # leader's also the group's nodes
    for rank, theirs in ((8, 8), (9, 9), (8191, 2047)):
        assert told[8192][rank] == told[2048][theirs], (rank, told)
    for rank, theirs in ((9, 9), (8191, 2047)):
        assert received[8192][rank] < 1.01 * received[2048][theirs], (rank, received)
    assert received[8192][8] - received[2048][8] < 4 * 1024, received

    # the group's nodes, which only the node leaders take with their buckets: a few bytes a
    # node, however many ranks each holds
    nodes = Nodes.of([rank // 8 for rank in range(8192)])
    assert len(pickle.dumps(nodes)) < 4 * 1024 < len(pickle.dumps(list(range(8192))))
    assert pickle.loads(pickle.dumps(nodes)) == nodes
    shuffled = Nodes.of([rank % 3 for rank in range(20)])  # a node's ranks far apart
    assert pickle.loads(pickle.dumps(shuffled)) == shuffled
