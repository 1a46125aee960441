"""Routed experts stored fused (one ``[E, ...]`` tensor per projection and layer, as Qwen3.6,
Qwen3-VL-MoE and GLM-4.5 ship them) load through Megatron-Bridge's ``FusedGatedExpertMapping``
and ``FusedExpertMapping`` exactly as the bridge loads them, in each of the three ways
``gate_up_proj`` is stored, each rank taking its experts' slices from the row blocks that
hold them.

The model is Qwen3-MoE built by the bridge's provider on CPU (sequential experts: grouped ones
need Transformer Engine, tested on the GPU machine), its checkpoint rewritten from the tensors
``transformers``' Qwen3-MoE class holds (:mod:`support.packing`), and the bridge's registry the
one 0.6 gives Qwen3.5-MoE for packed checkpoints (:func:`megastart.bench.packed.bridge_with_packed_experts`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:  # imported with shims, by the ranks
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.bridge_ranks import bridge_and_megastart
from support.packing import fused_shape, pack_experts

from megastart.bench.packed import bridge_with_packed_experts
from megastart.harness.checkpoints import make_checkpoint
from megastart.harness.launch import RankPool

# moe_intermediate_size 48: gate/up has 96 rows against a hidden size of 64, so a transposed
# [E, H, 2I] is told apart from [E, 2I, H] by its shape, as the bridge tells them apart
EXPERT_ROWS = 48
STORED = {"E,2I,H": (4, 96, 64), "E,H,2I": (4, 64, 96), "E,2,I,H": (4, 2, 48, 64)}
"""Layer 0's ``gate_up_proj`` in each layout (4 experts, hidden size 64)."""


@pytest.mark.parametrize(
    ("layout", "world", "parallel"),
    [
        ("E,2I,H", 2, {"ep": 2}),
        ("E,H,2I", 2, {"tp": 2}),  # expert TP 2: each rank's rows of a transposed gate and up
        ("E,2,I,H", 2, {"tp": 2, "ep": 2, "etp": 1}),
    ],
    ids=["E_2I_H-ep2", "E_H_2I-tp2_etp2", "E_2_I_H-tp2_ep2_etp1"],
)
def test_fused_experts_load_as_megatron_bridge_loads_them(
    rank_pools: dict[int, RankPool],
    tmp_path_factory: pytest.TempPathFactory,
    layout: str,
    world: int,
    parallel: dict[str, int],
) -> None:
    directory = Path(tmp_path_factory.mktemp("packed"))
    make_checkpoint("qwen3_moe", directory, moe_intermediate_size=EXPERT_ROWS)
    pack_experts(directory, layout)
    assert fused_shape(directory) == STORED[layout]
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[world].run(
            bridge_and_megastart, str(directory), parallel, "float32", bridge_with_packed_experts
        )
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        experts = [n for n in theirs if ".local_experts." in n]
        assert experts and all(not theirs[n].isnan().any() for n in experts), (
            f"rank {rank}: the bridge left experts unloaded"
        )
        for name in theirs:
            same = torch.equal(theirs[name].nan_to_num(7.0), ours[name].nan_to_num(7.0))
            assert same, f"rank {rank}: {name} differs from the bridge's load"
