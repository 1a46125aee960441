"""The architectures whose Megatron-Bridge providers build only with Transformer Engine's
specs (gated delta nets, gated attention, vision towers beside the decoder, fused experts
loaded into grouped GEMMs): megastart's load through the bridge's registry equals the bridge's
own ``load_hf_weights`` bit for bit, every parameter NaN before each load.

Their checkpoints are written by ``transformers``' own classes (:mod:`support.tiny_models`).
The CPU tests (tests/bridge) check the same translations on tensors and on the models that do
build on the CPU; these are the whole models.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import pytest

from megastart.harness.launch import RankPool

pytestmark = pytest.mark.skipif(
    find_spec("megatron.bridge") is None, reason="Megatron-Bridge is not installed here"
)

NEWEST = [
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v_moe",
    "minimax_m2",
    # issue 53: a permuted AutoMapping (Gemma 3 VL's projector), per-weight hooks as data
    "gemma3",
    "gemma4_text",
    "gemma4_moe_text",
    "mistral3",
]
"""``model_type``s of :mod:`support.tiny_models`: Qwen3-Next, Qwen3.5 (dense and MoE, text and
vision-language), Qwen3-VL (dense and MoE), GLM-4.5V, MiniMax-M2 (gpt-oss: ``test_gpu_loads.py``);
Gemma 3 VL, Gemma 4 (dense, MoE), Ministral 3. Nemotron-H is not here: its mixer needs
mamba_ssm, which the GPU machine lacks too (tests/bridge builds it with a stub)."""

DENSE = {"qwen3_5_text", "qwen3_5", "qwen3_vl", "gemma3", "gemma4_text", "mistral3"}
MOE = set(NEWEST) - DENSE | {"gpt_oss"}


def check(got: dict[str, Any], name: str, where: str) -> None:
    print(f"GPU-RESULT newest {name} {where}: {got}")
    assert got["te_modules"] > 0, "the bridge's provider built no Transformer Engine module"
    if name in MOE:
        assert got["grouped"] > 0, "no grouped-GEMM expert weights (TEGroupedMLP)"
    assert not got["bridge_left_nan"], f"the bridge's own load left {got['bridge_left_nan']}"
    assert got["by_registry"], f"megastart left the load to the bridge: {got['said']}"
    assert not got["registry_differs"], f"through the registry: {got['registry_differs']}"


@pytest.mark.parametrize("name", NEWEST)
def test_newest_models_load_as_megatron_bridge_loads_them(
    nccl: RankPool, checkpoint: Any, name: str
) -> None:
    from support.gpu_ranks import bridge_and_megastart

    (got,) = nccl.run(bridge_and_megastart, checkpoint(name), "cuda", False)
    check(got, name, "world 1")


SHARED = [
    pytest.param("qwen3_next", {"tp": 2}, id="qwen3_next-tp2"),
    pytest.param("qwen3_5_moe", {"ep": 2}, id="qwen3_5_moe-ep2"),
    pytest.param("qwen3_vl_moe", {"tp": 2}, id="qwen3_vl_moe-tp2"),
    pytest.param("gpt_oss", {"tp": 2, "ep": 2, "etp": 1}, id="gpt_oss-tp2_ep2_etp1"),
    pytest.param("glm4v_moe", {"pp": 2}, id="glm4v_moe-pp2"),
    pytest.param("gemma3", {"tp": 2}, id="gemma3-tp2"),
    pytest.param("gemma4_moe_text", {"ep": 2}, id="gemma4_moe_text-ep2"),
]


@pytest.mark.parametrize(("name", "layout"), SHARED)
def test_newest_models_load_as_the_bridge_on_ranks_sharing_the_gpu(
    shared_gpu: RankPool, checkpoint: Any, name: str, layout: dict[str, int]
) -> None:
    from support.gpu_ranks import bridge_and_megastart

    for rank, got in enumerate(
        shared_gpu.run(bridge_and_megastart, checkpoint(name), "cuda", False, layout)
    ):
        check(got, name, f"{layout} rank {rank}")
