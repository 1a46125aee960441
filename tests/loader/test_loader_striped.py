"""Striped readers (``reader=striped``) on simulated nodes (``LOCAL_RANK``) over gloo.

Every node leader reads a share of the buckets and sends each to the other nodes
that need it. Against today's reader (``reader=global``) in the same world: every
parameter equal bit for bit, the same bytes read (each bucket once, by one
reader), every leader reading, and a reader's failure on another node raised on
every rank as one error.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from support.loader_faults import load_while_a_rank_dies, load_with_failing_reads
from support.loader_ranks import load_parameters_as_nodes

from megastart.harness.launch import RankFailure, RankPool

CASES: dict[str, tuple[str, dict[str, Any], int, dict[str, int], int]] = {
    # id: (arch, checkpoint overrides, world, layout, ranks per node)
    "llama_tp2_pp2_two_nodes_of_two": (
        "llama",
        {"tie_word_embeddings": False},
        4,
        {"tp": 2, "pp": 2},
        2,
    ),
    "llama_dp2_pp2_four_nodes_of_one": ("llama", {"tie_word_embeddings": False}, 4, {"pp": 2}, 1),
    "qwen2_tied_tp2_two_nodes_of_two": ("qwen2", {"tie_word_embeddings": True}, 4, {"tp": 2}, 2),
    "qwen3_moe_pp2_ep2_two_nodes_of_two": ("qwen3_moe", {}, 4, {"pp": 2, "ep": 2}, 2),
    "qwen3_moe_ep2_four_nodes_of_one": ("qwen3_moe", {}, 4, {"ep": 2}, 1),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from megastart.harness.checkpoints import make_checkpoint

    made: dict[str, str] = {}

    def get(arch: str, overrides: dict[str, Any]) -> str:
        key = f"{arch}-{sorted(overrides.items())}"
        if key not in made:
            directory = tmp_path_factory.mktemp(arch)
            make_checkpoint(arch, directory, **overrides)
            made[key] = str(directory)
        return made[key]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_striped_readers_load_what_one_reader_loads_reading_each_bucket_once(
    rank_pools: Any, checkpoints: Any, case: str
) -> None:
    arch, overrides, world, layout, per_node = CASES[case]
    directory = checkpoints(arch, overrides)
    pool = rank_pools[world]
    one = pool.run(load_parameters_as_nodes, directory, layout, per_node, {"reader": "global"})
    striped = pool.run(load_parameters_as_nodes, directory, layout, per_node, {"reader": "striped"})
    for rank, ((_, expected), (_, got)) in enumerate(zip(one, striped, strict=True)):
        assert got.keys() == expected.keys()
        for name, value in got.items():
            assert torch.equal(value, expected[name]), f"rank {rank}: {name}"
    reference, report = one[0][0], striped[0][0]
    assert report.bytes_read == reference.bytes_read
    assert report.reader_ranks == tuple(range(0, world, per_node))  # every leader reads
    assert {r[0].bytes_read for r in striped} == {report.bytes_read}


def test_auto_reads_striped_on_several_nodes_and_as_one_reader_on_one(
    rank_pools: Any, checkpoints: Any
) -> None:
    directory = checkpoints("llama", {"tie_word_embeddings": False})
    pool = rank_pools[4]
    several = pool.run(load_parameters_as_nodes, directory, {"tp": 2}, 2, {"reader": "auto"})
    one = pool.run(load_parameters_as_nodes, directory, {"tp": 2}, 4, {"reader": "auto"})
    assert several[0][0].reader_ranks == (0, 2)
    assert one[0][0].reader_ranks == (0,)
    assert one[0][0].bytes_read == several[0][0].bytes_read


def test_a_reader_failing_on_another_node_reaches_every_rank(
    rank_pools: Any, checkpoints: Any
) -> None:
    """The leader of the second node (rank 2) fails its fourth read: the ranks of both
    nodes, waiting for its bucket or for others', raise its error."""
    directory = checkpoints("llama", {"tie_word_embeddings": False})
    start = time.monotonic()
    messages = rank_pools[4].run(
        load_with_failing_reads, directory, {"tp": 2, "pp": 2}, 3, 2, {"reader": "striped"}, 2
    )
    assert time.monotonic() - start < 30
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("CollectiveError: rank0_loader: streaming")
    assert "reader rank 2 failed: OSError" in messages[0] or "failed on rank 2" in messages[0]
    assert "Input/output error" in messages[0]


def test_a_striped_reader_killed_mid_stream_fails_every_rank_of_both_nodes_within_the_bound(
    checkpoints: Any,
) -> None:
    """The leader of the second node (rank 2), a reader, exits while it copies its second
    bucket: the reader of the first node and both nodes' other ranks raise one error, named,
    within the bound, whatever they were waiting on (a broadcast from it, their node's page)."""
    directory = checkpoints("llama", {"tie_word_embeddings": False})
    timeout_s = 5.0
    layout, striped = {"tp": 2, "pp": 2}, {"reader": "striped"}
    with RankPool(4, timeout_s=120, grace_s=3 * timeout_s) as pool:
        pool.run(load_parameters_as_nodes, directory, layout, 2, striped)  # imports done
        start = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            pool.run(load_while_a_rank_dies, directory, layout, 2, timeout_s, 2, striped)
        elapsed = time.monotonic() - start
    message = str(failure.value)
    assert "ranks that died: 2 (exit code 7)" in message
    for rank in (0, 1, 3):
        assert f"--- rank {rank} raised" in message
    assert message.count("CollectiveError: rank0_loader: streaming") == 3
    assert elapsed < 3 * timeout_s + 10


def test_a_striped_plan_of_8192_ranks_reads_each_bucket_once_on_a_node_that_needs_it() -> None:
    """Qwen3-235B-A22B at TP4 x PP8 x EP64 on 1,024 nodes of 8, planned from every rank's
    demands as the ranks make them, without starting a process: every bucket of the plan is
    read once, by the leader of a node that needs it; the 1,024 leaders share the reading
    evenly; each receiver set's buckets keep their order (an FP8 weight's scales before it)."""
    from collections import Counter

    from megastart.bench.synthetic import MODELS, Layout, synthetic_checkpoint, world_demands
    from megastart.loader.plan.buckets import build_plan
    from megastart.loader.plan.nodes import Nodes
    from megastart.loader.plan.stripes import stripe

    config = MODELS["qwen3-235b-a22b"]
    meta = synthetic_checkpoint(config)
    demands = world_demands(config, meta, Layout(4, 8, 64), 8192)
    plan = build_plan(demands, meta, bucket_bytes=32 * 2**20, to_reader=False)
    nodes = Nodes.of([rank // 8 for rank in range(8192)])
    striped = stripe(plan, nodes)

    def slots(buckets: Any) -> Counter[Any]:
        return Counter((slot.name, slot.rows) for bucket in buckets for slot in bucket.slots)

    assert slots(striped.buckets) == slots(plan.buckets)
    assert len(striped.buckets) == len(plan.buckets)
    shares: Counter[int] = Counter()
    for bucket in striped.buckets:
        assert bucket.reader in nodes.leaders_reached(bucket.positions)
        shares[bucket.reader] += bucket.nbytes
    assert len(shares) == 1024  # every node leader reads
    mean = plan.nbytes / 1024
    assert max(shares.values()) <= 1.1 * mean + 32 * 2**20, (max(shares.values()), mean)
    by_set: dict[Any, list[Any]] = {}
    for bucket in plan.buckets:
        by_set.setdefault(bucket.positions, []).append(bucket.slots)
    for bucket in striped.buckets:
        assert by_set[bucket.positions].pop(0) == bucket.slots
