"""``megastart bench loader``'s ``bridge`` strategy (Megatron-Bridge's own load) loads every
parameter, and the same values as the megastart row it is compared with, on a checkpoint
with packed experts (``--arch qwen3_moe_packed``: the bridge's packed mappings) and on one
with an HF tensor per expert (``AutoBridge.load_hf_weights``): the benchmark's memory figures
compare two loads of the same weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:  # imported with shims, by the ranks
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.bench_bridge_ranks import benchmark_checksums

from megastart.bench.packed import is_packed, pack_experts
from megastart.harness.checkpoints import make_checkpoint
from megastart.harness.launch import RankPool
from megastart.loader.checkpoint import read_metadata


@pytest.mark.parametrize("packed", [True, False], ids=["packed_experts", "expert_per_tensor"])
def test_bridge_strategy_loads_as_megastart_does(
    rank_pools: dict[int, RankPool], tmp_path: Path, packed: bool
) -> None:
    # a vocabulary Megatron-Bridge need not pad (it pads to what divides it, the model to 128)
    checkpoint = make_checkpoint("qwen3_moe", tmp_path / "moe", dtype="bfloat16", vocab_size=256)
    if packed:
        pack_experts(checkpoint)
    assert is_packed(read_metadata(checkpoint, allow_pickle=False).tensors) == packed
    layout = {"tp": 1, "pp": 1, "vpp": None, "ep": 2}
    results = rank_pools[2].run(
        benchmark_checksums, str(checkpoint), layout, ("megastart", "bridge")
    )
    for rank, by_strategy in enumerate(results):
        for name, (_, nans) in by_strategy.items():
            assert nans == 0, f"rank {rank}: {name} left {nans} values unloaded"
        assert by_strategy["bridge"][0] == by_strategy["megastart"][0], (
            f"rank {rank}: the bridge strategy's weights differ from megastart's"
        )
