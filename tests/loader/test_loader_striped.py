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
from support.loader_ranks import load_parameters_as_nodes, load_with_failing_reads

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
