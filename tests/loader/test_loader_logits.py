"""rank0_loader against ground truth: the loaded Megatron model's logits equal the
``transformers`` model's, for every architecture and parallel layout (real ranks, gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.loader_ranks import (
    load_and_forward,
    load_as_nodes,
    load_counting_received_bytes,
    load_parameters,
    process_groups_before_and_after_loads,
    reference_logits,
)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

RANKS_PER_NODE = 2
"""The logits tests simulate nodes of two ranks (``LOCAL_RANK``)."""

LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2}),
    "tp2_pp2": (4, {"tp": 2, "pp": 2}),
    "tp2_pp2_vpp2": (4, {"tp": 2, "pp": 2, "vpp": 2}),
    "tp4": (4, {"tp": 4}),
    "dp2_tp2": (4, {"tp": 2}),
}

# Every architecture in every layout; tied and untied embeddings alternate so
# each architecture and each layout sees both.
CASES = [
    pytest.param(arch, layout, tied, id=f"{arch}-{layout}-{'tied' if tied else 'untied'}")
    for a, arch in enumerate(ARCHITECTURES)
    for n, layout in enumerate(LAYOUTS)
    for tied in [(a + n) % 2 == 0]
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(arch, tied, kv_heads) -> (directory, transformers logits)``, each made once."""
    from megastart.harness.checkpoints import make_checkpoint

    cache: dict[tuple[str, bool, int], tuple[str, torch.Tensor]] = {}

    def get(arch: str, tied: bool, kv_heads: int = 4) -> tuple[str, torch.Tensor]:
        key = (arch, tied, kv_heads)
        if key not in cache:
            directory = tmp_path_factory.mktemp(
                f"{arch}-{'tied' if tied else 'untied'}-kv{kv_heads}"
            )
            make_checkpoint(arch, directory, tie_word_embeddings=tied, num_key_value_heads=kv_heads)
            cache[key] = (str(directory), reference_logits(directory))
        return cache[key]

    return get


def assert_logits_match(results: list[tuple[Any, torch.Tensor]], expected: torch.Tensor) -> None:
    for rank, (_, logits) in enumerate(results):
        diff = (logits - expected).abs().max().item()
        assert diff <= 1e-4, f"rank {rank}: max abs logit difference {diff:.3g}"


@pytest.mark.parametrize(("arch", "layout", "tied"), CASES)
def test_logits_match_transformers(
    rank_pools: Any, checkpoints: Any, arch: str, layout: str, tied: bool
) -> None:
    """On nodes of two ranks: the 2-rank layouts on the reader's node alone; the 4-rank ones
    on the reader's node and a second node, which receives what it needs once."""
    world, parallel = LAYOUTS[layout]
    directory, expected = checkpoints(arch, tied)
    results = rank_pools[world].run(load_as_nodes, directory, parallel, RANKS_PER_NODE, {})
    assert_logits_match(results, expected)
    report = results[0][0]
    assert report.reader_ranks == (0,)
    assert report.bytes_read == sum(
        p.stat().st_size for p in Path(directory).glob("*.safetensors")
    ) - _header_bytes(directory)
    if world == RANKS_PER_NODE:  # one node: its ranks read the reader's shared memory
        assert report.bytes_broadcast == 0
    else:  # each bucket crosses to the second node at most once (fp32 in, fp32 out)
        assert 0 < report.bytes_broadcast <= report.bytes_read


def test_uneven_pipeline_stages(rank_pools: Any, checkpoints: Any) -> None:
    directory, expected = checkpoints("qwen3", False)
    uneven = {"num_layers_in_first_pipeline_stage": 1}  # 1 layer on stage 0, 3 on stage 1
    assert_logits_match(
        rank_pools[2].run(load_and_forward, directory, {"pp": 2}, {}, **uneven), expected
    )


def test_mha_checkpoint_loads_with_tp2_pp2(rank_pools: Any, checkpoints: Any) -> None:
    directory, expected = checkpoints("llama", False, kv_heads=8)
    assert_logits_match(
        rank_pools[4].run(load_and_forward, directory, {"tp": 2, "pp": 2}, {}), expected
    )


def test_gloo_transport_and_large_buckets_give_the_same_logits(
    rank_pools: Any, checkpoints: Any
) -> None:
    directory, expected = checkpoints("qwen2", True)
    results = rank_pools[2].run(
        load_and_forward, directory, {"tp": 2}, {"transport": "gloo", "bucket_mb": 256}
    )
    assert_logits_match(results, expected)


def test_node_readers_each_read_the_checkpoint_once_for_their_node(
    rank_pools: Any, checkpoints: Any
) -> None:
    directory, expected = checkpoints("llama", False)
    results = rank_pools[4].run(load_as_nodes, directory, {"tp": 2}, 2, {"reader": "node"})
    assert_logits_match(results, expected)
    single = rank_pools[4].run(load_and_forward, directory, {"tp": 2}, {})[0][0]
    report = results[0][0]
    assert report.reader_ranks == (0, 2)
    assert report.bytes_read == 2 * single.bytes_read


@pytest.mark.parametrize(
    ("world", "parallel"), [(2, {"cp": 2}), (4, {"tp": 2, "cp": 2})], ids=["cp2", "tp2_cp2"]
)
def test_context_parallel_ranks_load_the_same_parameters_as_without_cp(
    rank_pools: Any, checkpoints: Any, world: int, parallel: dict[str, int]
) -> None:
    directory, _ = checkpoints("qwen3", False)
    with_cp = rank_pools[world].run(load_parameters, directory, parallel)
    without_cp = dict(
        rank_pools[world].run(
            load_parameters, directory, {k: v for k, v in parallel.items() if k != "cp"}
        )
    )
    for tp_rank, params in with_cp:
        reference = without_cp[tp_rank]
        assert params.keys() == reference.keys()
        for name, value in params.items():
            assert torch.equal(value, reference[name]), name


def _header_bytes(directory: str) -> int:
    """Bytes of the safetensors headers (8-byte length + JSON), which the loader reads but does not count."""
    total = 0
    for path in Path(directory).glob("*.safetensors"):
        with open(path, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def test_world_of_eight_dp2_tp2_pp2_on_four_nodes(rank_pools: Any, checkpoints: Any) -> None:
    """Four nodes of two ranks: three leaders relay what their node needs."""
    directory, expected = checkpoints("qwen2", True)
    results = rank_pools[8].run(load_as_nodes, directory, {"tp": 2, "pp": 2}, RANKS_PER_NODE, {})
    assert_logits_match(results, expected)


@pytest.mark.parametrize("layout", ["tp2", "tp2_pp2"])
def test_loader_destroys_its_stream_groups_and_keeps_its_control_plane(
    rank_pools: Any, checkpoints: Any, layout: str
) -> None:
    """The groups between nodes and inside them go after each load; the control plane the
    phases report over (here the one node's gloo group) is made once per process, kept for
    the next load, and never registered with torch.distributed."""
    world, parallel = LAYOUTS[layout]
    directory, _ = checkpoints("llama", False)
    for result in rank_pools[world].run(process_groups_before_and_after_loads, directory, parallel):
        before, after_one, after_two = result["registered"]
        assert after_one == after_two == before
        assert result["control"] == [tuple(range(world))] and result["same_control"]


def test_each_bucket_crosses_once_to_the_node_that_needs_it(
    rank_pools: Any, checkpoints: Any
) -> None:
    """TP2 x PP2 on two nodes of two ranks: node 0 holds stage 0 and the reader, node 1 stage 1.
    Only node 1's leader receives bytes over a socket, and only stage 1's; its other rank and
    the reader's node take theirs from shared memory."""
    directory, _ = checkpoints("llama", False)  # untied: no tensor is needed by both stages
    results = rank_pools[4].run(load_counting_received_bytes, directory, {"tp": 2, "pp": 2}, 2)
    report = results[0][2]
    assert [stage for stage, _, _ in results] == [0, 0, 1, 1]
    assert [got for _, got, _ in results] == [0, 0, report.bytes_broadcast, 0]
    assert 0 < report.bytes_broadcast < report.bytes_read  # stage 0's tensors stay on node 0
