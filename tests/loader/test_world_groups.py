"""The process groups a load makes at 8,192 ranks (Qwen3-235B-A22B, TP4 x PP8 x EP64, 1,024
nodes of 8), computed from every rank's demands as the ranks make them, without starting a
process: which groups are collectives over the world, and which each node makes alone."""

from __future__ import annotations

from megastart.bench.synthetic import MODELS, Layout, synthetic_checkpoint, world_demands
from megastart.distributed import tree_levels
from megastart.loader.plan import build_plan
from megastart.loader.route import Nodes, group_sets


def test_at_8192_ranks_only_sets_of_node_leaders_are_made_over_the_world() -> None:
    config = MODELS["qwen3-235b-a22b"]
    meta = synthetic_checkpoint(config)
    demands = world_demands(config, meta, Layout(4, 8, 64), 8192)
    plan = build_plan(demands, meta, bucket_bytes=32 * 2**20)
    nodes = Nodes.of([rank // 8 for rank in range(8192)])
    world = list(range(8192))
    leader_sets = group_sets([world], [nodes], [plan.receiver_sets])

    # every rank makes these, each a collective over the world: all 1,024 leaders first,
    # then one per other set of several leaders a bucket reaches; no other rank is in one
    assert leader_sets[0] == tuple(range(0, 8192, 8))
    assert len(set(leader_sets)) == len(leader_sets) <= 300
    assert all(rank % 8 == 0 for ranks in leader_sets for rank in ranks)
    reached = {tuple(nodes.leaders_reached(b.positions)) for b in plan.buckets}
    assert {ranks for ranks in reached if len(ranks) > 1} <= set(leader_sets)
    # a bucket reaches the nodes of one pipeline stage (1,024 ranks, 128 nodes) and the
    # reader's, or, an expert's, the 4 nodes of its expert-parallel rank and the reader's
    sizes = [len(ranks) for ranks in leader_sets[1:]]
    assert max(sizes) <= 128 + 1
    assert sum(size <= 4 + 1 for size in sizes) >= 0.9 * len(sizes)

    # the control plane's groups: made once per process, none over more than 32 ranks
    tree = [group for level in tree_levels(nodes.members) for group in level]
    assert max(map(len, tree)) == 32 and len(tree) == 1024 + 32 + 1
