"""The control plane's tree of small gloo groups: every rank's report reaches every rank (or
rank 0 alone, each rank keeping its node's) and rank 0's value every rank through groups of
a node or of a few node leaders, never a group over the whole world (real ranks over gloo;
and the tree of an 8,192-rank job, computed)."""

from __future__ import annotations

import pickle
import random
from collections import Counter
from typing import Any

import pytest

from megastart.distributed import FANOUT, CollectiveError, tree_levels
from megastart.harness.launch import RankPool


def test_at_8192_ranks_each_rank_is_in_a_few_small_groups_and_the_tree_reaches_everyone() -> None:
    nodes = [tuple(range(first, first + 8)) for first in range(0, 8192, 8)]
    levels = tree_levels(nodes)
    groups = [group for level in levels for group in level]
    assert max(len(group) for group in groups) == FANOUT == 32
    per_rank = Counter(rank for group in groups for rank in group)
    # a member is in its node's group; a leader in its 32 leaders' too; the 32 leaders of
    # those (rank 0 among them) in the top group as well
    assert Counter(per_rank.values()) == {1: 8192 - 1024, 2: 1024 - 32, 3: 32}
    assert levels[-1] == [tuple(range(0, 8192, 8 * 32))]  # the top: one leader per 32 nodes
    # every rank is joined to rank 0 through the groups' leaders
    leader_of = {rank: group[0] for group in groups for rank in group if rank != group[0]}
    for rank in range(8192):
        while rank in leader_of:
            rank = leader_of[rank]
        assert rank == 0
    # connecting a gloo group asks the store about every pair: about 0.1 million requests,
    # against 67 million for one group over the 8,192 ranks
    assert sum(len(g) * (len(g) - 1) for g in groups) < 0.11e6 < 8192 * 8191 / 600


def test_nodes_of_one_rank_climb_straight_to_the_leaders_groups() -> None:
    assert tree_levels([(0,), (1,), (2,)], fanout=2) == [[], [(0, 1)], [(0, 2)]]
    assert tree_levels([(0, 1)]) == [[(0, 1)]]
    assert tree_levels([(0,)]) == [[]]


def exchange(ranks_per_node: int, fanout: int) -> dict[str, Any]:
    """Make a control plane on simulated nodes of ``ranks_per_node`` (through ``LOCAL_RANK``),
    then gather every rank's report, broadcast rank 0's value and scatter rank 0's value for
    each node over it (the last two nodes share one value, which shares a part with node 0's;
    every value holds a part for node leaders alone; some reports, and the broadcast values,
    longer than a collective's inline bytes: those that compress travel in one collective,
    the random ones in two)."""
    import os
    import random

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from megastart.distributed import make_control

    rank = dist.get_rank()
    os.environ["LOCAL_RANK"] = str(rank % ranks_per_node)
    registered = _world.group_count
    control = make_control(30.0, fanout=fanout)
    leaders = list(range(0, dist.get_world_size(), ranks_per_node))
    shared = {-1: b"the last nodes' value", 0: b"node 0"}  # parts: node 0's too
    values = {leader: {leader: f"node {leader}".encode()} for leader in leaders[:-2]}
    values |= {leader: shared for leader in leaders[-2:]}
    values = {leader: {**value, -2: b"leaders only"} for leader, value in values.items()}
    return {
        "scattered": control.scatter(values if rank == 0 else None, timeout_s=30.0, private={-2}),
        "groups": control.group_ranks,
        "gathered": control.gather({"rank": rank, "text": "x" * rank * 2000}, timeout_s=30.0),
        "up": control.gather_up(
            up_values(len(leaders) * ranks_per_node, leaders[-1])[rank], timeout_s=30.0
        ),
        "holds_all": control.holds_all,
        "broadcast": control.broadcast(f"from rank {rank}" + "y" * 5000, timeout_s=30.0),
        "random": control.gather(random.Random(rank).randbytes(3000 * rank), timeout_s=30.0),
        "random_broadcast": control.broadcast(random.Random(rank).randbytes(9000), timeout_s=30.0),
        "registered": _world.group_count - registered,
    }


@pytest.fixture(scope="module")
def six() -> RankPool:
    with RankPool(6, timeout_s=60) as pool:
        yield pool


def test_every_rank_hears_every_report_through_a_tree_of_nodes_and_leaders(six: RankPool) -> None:
    results = six.run(exchange, 2, 2)  # nodes (0, 1) (2, 3) (4, 5); leaders 0 2 4, two a group
    assert [r["groups"] for r in results] == [
        [(0, 1), (0, 2), (0, 4)],
        [(0, 1)],
        [(2, 3), (0, 2)],
        [(2, 3)],
        [(4, 5), (0, 4)],
        [(4, 5)],
    ]
    expected = [{"rank": r, "text": "x" * r * 2000} for r in range(6)]
    randoms = [random.Random(r).randbytes(3000 * r) for r in range(6)]
    for result in results:
        assert result["gathered"] == expected
        assert result["broadcast"] == "from rank 0" + "y" * 5000
        assert result["random"] == randoms
        assert result["random_broadcast"] == random.Random(0).randbytes(9000)
        assert result["registered"] == 0  # the host's group names and counts are untouched
    # each node's ranks get their leader's value, the last two nodes the one they share; the
    # private part reaches the leaders alone
    shared = {-1: b"the last nodes' value", 0: b"node 0"}
    private = {-2: b"leaders only"}
    expected = [{0: b"node 0"}] * 2 + [shared] * 4
    expected = [v | private if r % 2 == 0 else v for r, v in enumerate(expected)]
    assert [r["scattered"] for r in results] == expected


def up_values(world: int, last_node: int) -> dict[int, dict[str, Any]]:
    """What :func:`exchange` sends up, by rank: some longer than a collective's inline bytes;
    the last node's ranks the same value (it crosses each group once)."""
    return {
        r: {"rank": r, "text": "z" * r * 1500}
        if r < last_node
        else {"rank": last_node, "text": "last node"}
        for r in range(world)
    }


def test_reports_go_up_to_rank_0_and_a_rank_keeps_only_its_nodes(six: RankPool) -> None:
    """Rank 0 gets every rank's value; any other rank only what passed through it: its node's,
    and on a leader the nodes below it, never the world's (reader-only planning's gather)."""
    results = six.run(exchange, 2, 2)  # nodes (0, 1) (2, 3) (4, 5); leaders 0 2 4, two a group
    values = up_values(6, 4)
    assert results[0]["up"] == values
    for rank in range(1, 6):
        node = range(rank - rank % 2, rank - rank % 2 + 2)
        assert results[rank]["up"] == {r: values[r] for r in node}, rank
    assert not any(r["holds_all"] for r in results)
    # three levels: nodes of one rank, two leaders a group: (0, 1) (2, 3) (4, 5), (0, 2), (0, 4)
    results = six.run(exchange, 1, 2)
    values = up_values(6, 5)
    assert results[0]["up"] == values
    for leader in (2, 4):  # a leader: its group's below
        assert results[leader]["up"] == {leader: values[leader], leader + 1: values[leader + 1]}
    assert [results[r]["up"] for r in (1, 3, 5)] == [{r: values[r]} for r in (1, 3, 5)]


def test_a_scatter_down_three_levels_gives_each_node_its_own_value(six: RankPool) -> None:
    """Nodes of one rank, two leaders a group: (0, 1) (2, 3) (4, 5), then (0, 2), then (0, 4);
    each leader keeps the part of the leaders below it; every rank leads its node, and takes
    the private part too."""
    results = six.run(exchange, 1, 2)
    assert results[0]["groups"] == [(0, 1), (0, 2), (0, 4)]
    shared = {-1: b"the last nodes' value", 0: b"node 0"}
    own = [{r: f"node {r}".encode()} for r in range(4)]
    private = {-2: b"leaders only"}
    assert [r["scattered"] for r in results] == [v | private for v in [*own, shared, shared]]


def summarised_phase(ranks_per_node: int, failing: int | None, summary_fails: bool) -> Any:
    """A phase (:func:`~megastart.distributed.all_or_none`) whose values go up to rank 0 alone
    and come back as its summary, on simulated nodes of ``ranks_per_node``; ``failing``'s
    block raises, or rank 0's ``summarise`` does: what each rank got, or its error."""
    import os

    import torch.distributed as dist

    from megastart.distributed import all_or_none, make_control

    rank = dist.get_rank()
    os.environ["LOCAL_RANK"] = str(rank % ranks_per_node)
    control = make_control(30.0, fanout=2)

    def summarise(values: list[Any]) -> Any:
        if summary_fails:
            raise ValueError("no summary of these")
        return {"ranks": len(values), "total": sum(v["n"] for v in values)}

    try:
        with all_or_none("a phase", timeout_s=10.0, control=control, summarise=summarise) as out:
            if rank == failing:
                raise RuntimeError(f"rank {rank} could not map its parameters")
            out.share({"n": rank, "text": "w" * 5000})
    except CollectiveError as e:
        return str(e)
    return {"summary": out.summary, "held": sorted(out.held), "shared": out.shared}


@pytest.mark.parametrize("ranks_per_node", [2, 6])
def test_a_phase_summarised_on_rank_0_gives_every_rank_its_summary_or_the_same_error(
    six: RankPool, ranks_per_node: int
) -> None:
    """Nodes of 2 (the reports go up three levels, the summary comes down) and one node of 6
    (every rank holds every report, and summarises them itself)."""
    results = six.run(summarised_phase, ranks_per_node, None, False)
    for rank, result in enumerate(results):
        assert result["summary"] == {"ranks": 6, "total": 15}
        first = rank - rank % ranks_per_node
        held = list(range(6)) if rank == 0 else list(range(first, first + ranks_per_node))
        assert result["held"] == held and result["shared"] == []
    # the same error on every rank: the failing rank's own, or rank 0's summary's
    for failing, summary_fails, error in (
        (3, False, "a phase failed on rank 3: RuntimeError: rank 3 could not map its parameters"),
        (None, True, "a phase failed on rank 0: ValueError: no summary of these"),
    ):
        results = six.run(summarised_phase, ranks_per_node, failing, summary_fails)
        assert len(set(results)) == 1 and results[0].startswith(error), results


def test_on_one_node_the_tree_is_the_nodes_group(six: RankPool) -> None:
    results = six.run(exchange, 6, 32)
    assert [r["groups"] for r in results] == [[tuple(range(6))]] * 6
    assert all(r["gathered"][5] == {"rank": 5, "text": "x" * 10000} for r in results)
    shared = {-1: b"the last nodes' value", 0: b"node 0"}
    assert [r["scattered"] for r in results] == [shared | {-2: b"leaders only"}] + [shared] * 5
    assert all(r["up"] == up_values(6, 0) and r["holds_all"] for r in results)  # one node: all


def test_a_world_of_one_gathers_and_broadcasts_its_own_value() -> None:
    with RankPool(1, timeout_s=60) as pool:
        (result,) = pool.run(exchange, 1, 32)
    assert result["groups"] == []
    assert result["gathered"] == [{"rank": 0, "text": ""}]
    assert result["up"] == up_values(1, 0) and result["holds_all"]
    assert result["broadcast"] == "from rank 0" + "y" * 5000


def test_a_report_that_compresses_to_a_collective_s_inline_bytes_travels_in_one() -> None:
    """A small model's metadata (8.6 KB pickled) goes in one broadcast, not a size and then
    its bytes; a random one, or one too long to be worth compressing, as it is."""
    from megastart.distributed.wire import INLINE_BYTES, SQUEEZED_BYTES, dumps, loads

    names = {f"model.layers.{i}.mlp.up_proj.weight": (i, [4864, 896]) for i in range(150)}
    noise = random.Random(0).randbytes(2 * INLINE_BYTES)
    long = [random.Random(1).randbytes(16) * 64 for _ in range(SQUEEZED_BYTES // 1000)]
    assert len(dumps(names)) <= INLINE_BYTES < len(pickle.dumps(names))
    assert len(dumps(noise)) > INLINE_BYTES and len(dumps(long)) > SQUEEZED_BYTES
    for value in (names, noise, long, "short"):
        assert loads(dumps(value)) == value


def make_without(missing: int) -> str:
    import torch.distributed as dist

    from megastart.distributed import make_control

    if dist.get_rank() == missing:
        return "stayed away"
    try:
        make_control(2.0)
    except CollectiveError as e:
        return str(e)
    return "made"


def test_a_rank_that_never_comes_is_named_on_every_other_rank(six: RankPool) -> None:
    results = six.run(make_without, 4)
    for rank, result in enumerate(results):
        if rank != 4:
            assert "rank(s) [4] did not start it within timeout_s=2 s" in result, result


def miss_a_gather(missing: int, up: bool = False) -> dict[str, Any]:
    """Every rank but ``missing`` gathers over a tree of nodes of 2 (fanout 2), to every rank
    or, ``up``, to rank 0 in a phase whose summary comes back down: what each saw, and how
    long it waited."""
    import os
    import time

    import torch.distributed as dist

    from megastart.distributed import PEER_GRACE_S, all_or_none, make_control

    os.environ["LOCAL_RANK"] = str(dist.get_rank() % 2)
    control = make_control(30.0, fanout=2)
    started = time.monotonic()
    if dist.get_rank() == missing:
        time.sleep(12.0)  # hung: it never reports
        return {"outcome": "stayed away", "waited_s": 0.0}
    try:
        if up:  # a phase waits for its peers twice PEER_GRACE_S longer than its timeout_s
            waited = 3.0 - 2 * PEER_GRACE_S
            with all_or_none("a phase", timeout_s=waited, control=control, summarise=len):
                pass
        else:
            control.gather("report", timeout_s=3.0)
    except (TimeoutError, CollectiveError) as e:
        return {"outcome": str(e), "waited_s": time.monotonic() - started}
    return {"outcome": "gathered", "waited_s": time.monotonic() - started}


@pytest.mark.parametrize("up", [False, True])
def test_a_rank_missing_a_gather_makes_every_other_rank_fail_within_the_bound(up: bool) -> None:
    with RankPool(4, timeout_s=60) as pool:
        results = pool.run(miss_a_gather, 3, up)
    assert "the control group of ranks [2, 3] did not complete within 3 s" in results[2]["outcome"]
    for rank in (0, 1):  # rank 2 never carries its node's reports up, nor passes them down
        assert "did not complete within 3 s" in results[rank]["outcome"], results[rank]
    for result in results[:3]:
        assert result["waited_s"] < 3 * 3.0 + 1, result  # a bound per level, at most
