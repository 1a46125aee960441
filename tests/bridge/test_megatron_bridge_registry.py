"""Where megastart replaces Megatron-Bridge's ``load_hf_weights`` (verl 0.9's default branch),
the bridge's ``mapping_registry()`` decides: megastart's load is bit-identical to the
bridge's own, parameter by parameter (every one set to NaN before each load), in TP, PP,
VPP, EP and expert-TP layouts; where megastart also has a built-in table the two agree; a
bridge with a mapping class or a per-weight hook megastart does not reproduce loads the
model itself, with one line on rank 0.

Runs where Megatron-Bridge is installed (the ``verl`` nox session's second environment:
megatron-core 0.19, megatron-bridge 0.5), on CPU over gloo with the models built by
Megatron-Bridge's own provider (:mod:`support.bridge_ranks`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("megatron.bridge") is None:  # imported with shims, by the ranks
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.bridge_ranks import (
    bridge_and_megastart,
    bridge_with_a_hook_of_its_own,
    bridge_with_a_mapping_of_its_own,
    differences,
    leaves_to_the_bridge,
    tables_agree,
    the_auto_bridges_model_bridge,
    unknown_subclass,
)

from megastart.harness.launch import RankPool

CASES = [
    pytest.param("qwen3", 2, {"tp": 2}, id="qwen3-tp2"),
    pytest.param("qwen3", 4, {"tp": 2, "pp": 2, "vpp": 2}, id="qwen3-tp2_pp2_vpp2"),
    pytest.param("llama", 2, {"pp": 2}, id="llama-pp2"),
    pytest.param("qwen3_moe", 2, {"ep": 2}, id="qwen3_moe-ep2"),
    pytest.param("qwen3_moe", 2, {"tp": 2, "ep": 2, "etp": 1}, id="qwen3_moe-tp2_ep2_etp1"),
    pytest.param("qwen3_moe", 2, {"pp": 2}, id="qwen3_moe-pp2"),
    pytest.param("qwen3_moe", 2, {"tp": 2}, id="qwen3_moe-tp2_etp2"),
    pytest.param("deepseek_v3", 2, {"tp": 2}, id="deepseek_v3-tp2"),
    pytest.param("deepseek_v3", 2, {"ep": 2}, id="deepseek_v3-ep2"),
    pytest.param("deepseek_v3", 2, {"pp": 2}, id="deepseek_v3-pp2"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from megastart.harness.checkpoints import make_checkpoint

    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            # Qwen3 with 8 layers, so that PP2 x VPP2 has two layers per chunk
            layers = {"num_hidden_layers": 8} if arch == "qwen3" else {}
            made[arch] = str(make_checkpoint(arch, tmp_path_factory.mktemp(arch), **layers))
        return made[arch]

    return get


@pytest.mark.parametrize(("arch", "world", "layout"), CASES)
def test_megastart_loads_what_the_bridge_loads_bit_for_bit(
    rank_pools: dict[int, RankPool], checkpoints: Any, arch: str, world: int, layout: dict[str, int]
) -> None:
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[world].run(bridge_and_megastart, checkpoints(arch), layout)
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        assert report.reader_ranks == (0,)
        loaded = [n for n, t in theirs.items() if not t.isnan().any()]
        assert loaded, f"rank {rank}: the bridge loaded nothing"
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: these differ from the bridge's load: {differ}"


@pytest.mark.parametrize(
    ("arch", "world", "layout"),
    [
        ("qwen3", 2, {"tp": 2}),
        ("llama", 2, {"pp": 2}),
        ("qwen3_moe", 2, {"ep": 2}),
        ("deepseek_v3", 2, {"tp": 2}),
    ],
)
def test_the_bridge_registry_and_the_built_in_table_agree(
    rank_pools: dict[int, RankPool], checkpoints: Any, arch: str, world: int, layout: dict[str, int]
) -> None:
    for rank, disagree in enumerate(rank_pools[world].run(tables_agree, checkpoints(arch), layout)):
        assert not disagree, f"rank {rank}: {disagree}"


@pytest.mark.parametrize(
    ("custom", "named"),
    [
        (
            bridge_with_a_mapping_of_its_own,
            "with ShiftedNormMapping, which megastart does not translate",
        ),
        (bridge_with_a_hook_of_its_own, "changes each loaded weight ("),
        (unknown_subclass, "it changes build_conversion_tasks"),
    ],
    ids=["mapping_class", "per_weight_hook", "unknown_subclass"],
)
def test_a_bridge_megastart_does_not_reproduce_loads_the_model_itself(
    rank_pools: dict[int, RankPool], checkpoints: Any, custom: Any, named: str
) -> None:
    (result0, lines0), (result1, lines1) = rank_pools[2].run(
        leaves_to_the_bridge, checkpoints("qwen3"), custom
    )
    assert result0 is None and result1 is None
    assert len(lines0) == 1 and not lines1, (lines0, lines1)
    assert "rank0_loader does not handle this checkpoint" in lines0[0]
    assert named in lines0[0], lines0[0]


def test_a_source_that_is_not_a_local_directory_is_left_to_the_bridge(
    rank_pools: dict[int, RankPool], checkpoints: Any
) -> None:
    (result0, lines0), (result1, lines1) = rank_pools[2].run(
        leaves_to_the_bridge, checkpoints("qwen3"), the_auto_bridges_model_bridge, "Qwen/Qwen3-8B"
    )
    assert result0 is None and result1 is None
    assert len(lines0) == 1 and not lines1, (lines0, lines1)
    assert "the source 'Qwen/Qwen3-8B' is not a local checkpoint directory" in lines0[0]


QWEN35 = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
VISION_LANGUAGE = (
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)


def test_architectures_lists_what_megatron_bridge_megastart_serves() -> None:
    """Run in-process: Megatron-Bridge imports here only with the test shims."""
    from support.bridge_ranks import import_megatron_bridge

    from megastart.architectures import collect, render

    import_megatron_bridge()
    report = collect()["megatron_bridge"]
    served = report["architectures"]
    for name in (
        "LlamaForCausalLM",
        "Qwen3MoeForCausalLM",
        "DeepseekV3ForCausalLM",
        "KimiK2ForCausalLM",
    ):
        assert served[name]["served"] == "yes", served[name]
    for name in ("Qwen3NextForCausalLM", "Qwen2_5_VLForConditionalGeneration"):
        assert served[name]["served"] == "yes", served[name]
    if report["version"] >= "0.6":  # the issue's reach: every one of 0.6.2's 58
        assert len(served) == 58 and all(v["served"] != "no" for v in served.values()), [
            (a, v["why"]) for a, v in served.items() if v["served"] == "no"
        ]
        packed = ("GptOssForCausalLM", "KimiK25ForConditionalGeneration")  # MXFP4, INT4 too
        for name in (*QWEN35, *VISION_LANGUAGE, "MiniMaxM2ForCausalLM", *packed, *ONCE_LEFT):
            assert served[name]["served"] == "yes", (name, served[name])
        assert served["Glm4vMoeForConditionalGeneration"]["served"] == "at load time"
    later = sorted(a for a, v in served.items() if v["served"] == "at load time")
    assert later and f"{later[0]}: its registry needs" in render(collect())


ONCE_LEFT = (
    *("DeepseekV4ForCausalLM", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    *("MiMoV2FlashForCausalLM", "Mistral3ForConditionalGeneration", "NemotronHForCausalLM"),
    *("NemotronH_Nano_VL_V2", "NemotronH_Nano_Omni_Reasoning_V3", "FalconH1ForCausalLM"),
    *("Gemma3ForConditionalGeneration", "Ernie4_5_VLMoeForConditionalGeneration"),
)
"""The eleven Megatron-Bridge 0.6.2 registrations megastart left to the bridge until issue 53:
per-weight hooks, Mamba's in_proj, permuted AutoMappings."""


def test_an_fp8_release_loads_as_megatron_bridges_dequantisation(
    rank_pools: dict[int, RankPool], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """DeepSeek-V3's FP8 format (128x128 blocks, the only size DeepSeekV3Bridge's hook
    dequantises) into a bf16 model: the bridge's hook and megastart's own dequantisation
    write the same bits."""
    from support.quantise import quantise_fp8

    from megastart.harness.checkpoints import make_checkpoint

    directory = make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("fp8"), dtype="bfloat16")
    quantise_fp8(directory)
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[2].run(bridge_and_megastart, str(directory), {"tp": 2}, "bfloat16")
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        differ = differences(theirs, ours)
        assert not differ, f"rank {rank}: these differ from the bridge's load: {differ}"
