"""Architectures the harness does not build load as Megatron-Bridge loads them, bit for bit,
on every rank, from models built by the bridge's own provider on CPU: a vision-language model
(the language model's decoder and the vision tower, its parameters outside any GPT decoder,
mostly ``ReplicatedMapping`` over ``visual.**``: the tower is each rank's whole, the decoder
its TP slice), Ernie-4.5-MoE (mapping classes of its bridge's own), Ernie-4.5-VL (two expert
pools per layer, routers stored transposed) and a Mamba hybrid (Nemotron-H: Mamba's in_proj
split by group over TP)."""

from __future__ import annotations

import importlib.util
from importlib.metadata import version
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.bridge_ranks import bridge_and_megastart, differences
from support.tiny_models import make_tiny

from megastart.harness.launch import RankPool
from megastart.loader.checkpoint import read_metadata

TOWERS = ("visual.", "vision_tower.")
"""Where a vision-language model built by Megatron-Bridge holds its vision tower."""


@pytest.mark.parametrize(
    ("model_type", "layout"),
    [("qwen2_5_vl", {"tp": 2}), ("mistral3", {"tp": 2})],
    ids=["qwen2_5_vl-tp2", "mistral3-tp2"],  # Ministral 3: a per-weight hook, as data
)
def test_a_vision_language_model_loads_as_megatron_bridge_loads_it(
    rank_pools: dict[int, RankPool],
    tmp_path_factory: pytest.TempPathFactory,
    model_type: str,
    layout: dict[str, int],
) -> None:
    if version("megatron-bridge") < "0.6":
        pytest.skip(
            "Megatron-Bridge 0.5's Qwen2.5-VL model imports Transformer Engine's float8_tensor, "
            "which the CPU stub lacks"
        )
    directory = make_tiny(model_type, Path(tmp_path_factory.mktemp(model_type)))
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[2].run(bridge_and_megastart, str(directory), layout)
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        tower = [n for n in theirs if n.split(":")[1].startswith(TOWERS) or ".visual." in n]
        loaded = [n for n in tower if not theirs[n].isnan().any()]
        assert len(loaded) > 10, f"rank {rank}: the bridge loaded no tower: {tower[:5]}"
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: these differ from the bridge's load: {differ}"


def test_ernie_4_5_moe_loads_as_megatron_bridge_loads_it(
    rank_pools: dict[int, RankPool], tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = make_tiny("ernie4_5_moe", Path(tmp_path_factory.mktemp("ernie")))
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[2].run(bridge_and_megastart, str(directory), {"ep": 2})
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        bias = [n for n in theirs if n.endswith("router.expert_bias")]
        assert bias and not any(theirs[n].isnan().any() for n in bias), bias
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: these differ from the bridge's load: {differ}"


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}], ids=["tp2", "ep2"])
def test_ernie_4_5_vl_loads_as_megatron_bridge_loads_it(
    rank_pools: dict[int, RankPool],
    tmp_path_factory: pytest.TempPathFactory,
    layout: dict[str, int],
) -> None:
    """The bridge's own model (its dual-pool decoder spec on megatron-core's local modules, the
    HF vision tower and resampler): routers stored ``[hidden, experts]`` (a permuted
    ``AutoMapping``), vision expert ``j`` stored as expert ``j + 4``, each pool's expert bias
    one row of a ``[2, 4]`` tensor, the resampler's ``spatial_linear.0`` as ``fc1``."""
    if version("megatron-bridge") < "0.6":
        pytest.skip("Megatron-Bridge before 0.6 has no Ernie-4.5-VL bridge")
    directory = make_tiny("ernie4_5_vl_moe", Path(tmp_path_factory.mktemp("ernie_vl")))
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[2].run(bridge_and_megastart, str(directory), layout)
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        tower = [n for n in theirs if n.split(":")[1].startswith(("vision_tower.", "resampler"))]
        pools = [n for n in theirs if "_moe_layer." in n and "tokens_per_expert" not in n]
        permuted = [n for n in pools if n.endswith("router.weight")]
        loaded = [*tower, *pools]
        experts = 2 * 2 * 4 // layout.get("ep", 1)  # two pools, fc1 and fc2 per expert
        assert len(tower) > 30 and len(permuted) == 2 and len(pools) == experts + 4, loaded
        unloaded = [n for n in loaded if theirs[n].isnan().any() and "inv_freq" not in n]
        assert not unloaded, f"rank {rank}: the bridge left these: {unloaded}"
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: these differ from the bridge's load: {differ}"


@pytest.mark.parametrize(
    ("model_type", "layout"), [("nemotron_h", {"tp": 2})], ids=["nemotron_h-tp2"]
)
def test_a_mamba_hybrid_loads_as_megatron_bridge_loads_it(
    rank_pools: dict[int, RankPool],
    tmp_path_factory: pytest.TempPathFactory,
    model_type: str,
    layout: dict[str, int],
) -> None:
    """Mamba's in_proj (z, x, B, C, dt per TP rank, by group), conv1d, A_log, D, dt_bias and
    gated norm per TP shard, beside attention and MLP layers: megatron-core's hybrid model on
    its local spec, its mixer built with the test-only mamba_ssm stub (support/stubs)."""
    if version("megatron-bridge") < "0.6":
        pytest.skip("the issue's reach: Megatron-Bridge 0.6.2's Nemotron-H")
    directory = make_tiny(model_type, Path(tmp_path_factory.mktemp(model_type)))
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[2].run(bridge_and_megastart, str(directory), layout)
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        mixer = [n for n in theirs if ".mixer." in n and "in_proj" in n]
        assert mixer and not any(theirs[n].isnan().any() for n in theirs), mixer
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: these differ from the bridge's load: {differ}"


def test_gemma4_derived_keys_and_values_load_as_megatron_bridge_loads_them(
    rank_pools: dict[int, RankPool], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Gemma 4's bridge hook makes V a copy of K on its full-attention layers (no v_proj) and
    zero K and V on the layers sharing another's KV (no k_proj, v_proj nor k_norm: the bridge
    leaves that norm as it was, and so does megastart); at TP2 on its dense local spec."""
    if version("megatron-bridge") < "0.6":
        pytest.skip("Megatron-Bridge before 0.6 has no Gemma 4 bridge")
    directory = make_tiny("gemma4_text", Path(tmp_path_factory.mktemp("gemma4")))
    stored = {n for n in read_metadata(str(directory), allow_pickle=False).tensors}
    layer = "model.layers.{}.self_attn.{}_proj.weight"
    assert layer.format(1, "k") in stored and layer.format(1, "v") not in stored
    assert not {layer.format(3, "k"), layer.format(3, "v")} & stored
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[2].run(bridge_and_megastart, str(directory), {"tp": 2})
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        qkv = [n for n in theirs if n.endswith("linear_qkv.weight")]
        assert len(qkv) == 4 and not any(theirs[n].isnan().any() for n in qkv), qkv
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: these differ from the bridge's load: {differ}"
