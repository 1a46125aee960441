"""Routed experts stored fused (one ``[E, ...]`` tensor per projection and layer, as Qwen3.6,
Qwen3-VL-MoE and GLM-4.5 ship them) load through Megatron-Bridge's ``FusedGatedExpertMapping``
and ``FusedExpertMapping`` exactly as the bridge loads them, in each of the three ways
``gate_up_proj`` is stored, each rank taking its experts' slices from the row blocks that
hold them.

The model is Qwen3-MoE built by the bridge's provider on CPU (sequential experts: grouped ones
need Transformer Engine, tested on the GPU machine), its checkpoint rewritten from the tensors
``transformers``' Qwen3-MoE class holds (:mod:`support.packing`), and the bridge's registry the
one 0.6 gives Qwen3.5-MoE for packed checkpoints (:func:`megastart.bench.packed.bridge_with_packed_experts`).

gpt-oss's MXFP4 release (``X_blocks`` / ``X_scales``, made here from a bf16 checkpoint as
OpenAI's are) loads as its bridge's hook dequantises it, each rank dequantising only its
experts' rows (into a float32 model: the bridge's ``dequantize_mxfp4`` makes bf16, which
the copy widens), in 10 KiB buckets, so that each packed tensor travels as row blocks of an
expert or two while its scales arrive whole before it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:  # imported with shims, by the ranks
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.bridge_ranks import bridge_and_megastart, differences
from support.packing import fused_shape, pack_experts
from support.quantise import quantise_mxfp4

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
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: {differ} differ from the bridge's load"


GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=96,  # not square: a down_proj left transposed would not fit
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=256,
    sliding_window=8,
    max_position_embeddings=128,
)


def test_gpt_oss_mxfp4_release_loads_as_its_bridge_dequantises_it(
    rank_pools: dict[int, RankPool], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """TP2 for attention, EP2 for the experts (expert TP 1, the only one gpt-oss's bridge
    loads)."""
    from transformers import GptOssConfig

    config = GptOssConfig(**GPT_OSS, architectures=["GptOssForCausalLM"], dtype="bfloat16")
    directory = Path(make_checkpoint(config, tmp_path_factory.mktemp("mxfp4")))
    quantise_mxfp4(directory)
    layout = {"tp": 2, "ep": 2, "etp": 1}
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[2].run(bridge_and_megastart, str(directory), layout, "float32", None, 0.01)
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        assert any(name.endswith("_blocks") for name in _read(report, directory))
        experts = [n for n in theirs if ".experts." in n]
        assert experts and all(not theirs[n].isnan().any() for n in experts), (
            f"rank {rank}: the bridge left experts unloaded"
        )
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: {differ} differ from the bridge's load"


def _read(report: object, directory: Path) -> list[str]:
    """The checkpoint's tensors, where the report counts every one of them read."""
    import json

    names = list(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
    assert getattr(report, "tensors", None) == len(names), (report, len(names))
    return names
