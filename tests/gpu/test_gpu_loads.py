"""Transformer Engine models, as the hosts build them on a GPU, load exactly: megastart's load
equals Megatron-Bridge's own ``load_hf_weights`` bit for bit (through the bridge's registry
and through the built-in tables), the built-in tables give transformers' logits, several ranks
sharing the GPU over gloo load CUDA parameters, and TE's ``_extra_state`` is never a
checkpoint tensor.

Every parameter is NaN before each load. ``GPU-RESULT`` lines carry the figures for
docs/compatibility.md.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.gpu_ranks import (
    bridge_and_megastart,
    load_and_forward,
    loads_on_the_bridges_model,
    te_load_and_local_load,
)

from megastart.harness.launch import RankPool

BRIDGE_CASES = [
    pytest.param("qwen3", True, id="qwen3"),
    pytest.param("qwen3_moe", True, id="qwen3_moe"),
    pytest.param("deepseek_v3", True, id="deepseek_v3"),
    pytest.param("deepseek_v3_fp8", True, id="deepseek_v3-fp8"),
    pytest.param("glm4_moe", True, id="glm4_moe"),
    pytest.param("gemma3", False, id="gemma3"),
    pytest.param("olmoe", False, id="olmoe"),
    pytest.param("gpt_oss", False, id="gpt_oss"),
    pytest.param("gpt_oss_mxfp4", False, id="gpt_oss-mxfp4"),  # dequantised per expert
]
"""(checkpoint, whether megastart has a built-in table for it)."""

MOE = ("qwen3_moe", "deepseek_v3", "glm4_moe", "olmoe", "gpt_oss")


def bridge_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("megatron.bridge") is not None


@pytest.mark.skipif(not bridge_installed(), reason="Megatron-Bridge is not installed here")
@pytest.mark.parametrize(("name", "built_in"), BRIDGE_CASES)
def test_megastart_loads_what_the_bridge_loads_into_te_models_bit_for_bit(
    nccl: RankPool, checkpoint: Any, name: str, built_in: bool
) -> None:
    (got,) = nccl.run(bridge_and_megastart, checkpoint(name), "cuda", built_in)
    print(f"GPU-RESULT bridge {name}: {got}")
    assert got["te_modules"] > 0, "the bridge's provider built no Transformer Engine module"
    assert "torch.bfloat16" in got["dtypes"]
    if name.startswith(MOE):
        assert got["grouped"] > 0, "no grouped-GEMM expert weights (TEGroupedMLP)"
    assert not got["bridge_left_nan"], f"the bridge's own load left {got['bridge_left_nan']}"
    assert got["by_registry"], f"megastart left the load to the bridge: {got['said']}"
    assert not got["registry_differs"], f"through the registry: {got['registry_differs']}"
    if built_in:
        assert not got["table_differs"], f"with the built-in table: {got['table_differs']}"


LOGIT_CASES = ["llama", "qwen2", "qwen3_moe", "deepseek_v3_routed", "glm4_moe", "deepseek_v3_fp8"]

MEAN_ERROR = 0.05
"""bf16 TE logits against transformers' float32 ones, mean absolute difference (0.009 to 0.027
with the local specs in bf16 on the CPU). Not the largest: in bf16 a router can pick another
expert for a token (Qwen3-MoE: 1.27 at one logit on the CPU, argmax unchanged)."""
DECISIVE_MARGIN = 0.25
"""A position decides the argmax when transformers' best logit leads its second by more than
this: bf16 moves these logits by 0.05-0.11 at most (where the routers agree), so there the
argmax must agree. A random tiny model has near ties elsewhere: DeepSeek-V3 with routed
experts on an H100 agreed on 13 of 16 positions, each disagreement a tie closer than 0.14."""


@pytest.mark.parametrize("name", LOGIT_CASES)
def test_built_in_tables_give_transformers_logits_on_te_models(
    nccl: RankPool, checkpoint: Any, truth: Any, name: str
) -> None:
    (got,) = nccl.run(load_and_forward, checkpoint(name), "cuda")
    want = truth(name)
    error = (got["logits"] - want).abs()
    mean, largest = error.mean().item(), error.max().item()
    agree = got["logits"].argmax(-1) == want.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > DECISIVE_MARGIN
    print(
        f"GPU-RESULT logits {name}: mean error {mean:.4f}, max {largest:.4f}, "
        f"argmax {agree.float().mean().item():.0%} ({int(agree[decisive].sum())} of "
        f"{int(decisive.sum())} decisive positions)"
    )
    assert got["te_modules"] > 0
    if name.startswith(MOE):
        assert got["grouped"] > 0, "no grouped-GEMM expert weights (TEGroupedMLP)"
    assert not got["left_nan"], f"left NaN: {got['left_nan']}"
    assert mean <= MEAN_ERROR, (mean, largest)
    assert agree[decisive].all(), f"argmax differs where it is decisive: {agree}, {decisive}"


def test_a_query_norm_the_checkpoint_lacks_is_refused_by_name(
    nccl: RankPool, checkpoint: Any
) -> None:
    """DeepSeek-V3 without ``q_lora_rank`` (DeepSeek-V2-Lite's layout), as Megatron-Bridge
    0.6.2 builds it on megatron-core 0.19's TE specs: its ``qk_layernorm`` fuses a norm into
    the query projection (``QKNormConfigResolver``), a norm the checkpoint does not have.
    The bridge's own load fails on it (no mapping, then an AttributeError); megastart says
    which parameter no table rule fills, before it reads a tensor."""
    (got,) = nccl.run(loads_on_the_bridges_model, checkpoint("deepseek_v3_plain_q"), "cuda")
    print(f"GPU-RESULT refused deepseek_v3-no_q_lora: {got}")
    assert got["bridge"] is not None, "the bridge loaded it: compare megastart's load instead"
    said = got["megastart"]
    assert said is not None and "PlanError" in said, said  # on every rank: a CollectiveError
    assert "'decoder.layers.0.self_attention.linear_q_proj.layer_norm_weight'" in said, said
    assert "has no rule in the DeepseekV3ForCausalLM mapping table" in said, said


def test_te_extra_state_is_neither_read_nor_reported_unused(
    nccl: RankPool, checkpoint: Any
) -> None:
    """A strict load (an unused checkpoint tensor is an error) of a model whose state dict has
    TE's ``_extra_state`` entries reads exactly the checkpoint's tensors and says nothing."""
    import json
    from pathlib import Path

    directory = checkpoint("qwen3_moe")
    index = json.loads((Path(directory) / "model.safetensors.index.json").read_text())
    (got,) = nccl.run(load_and_forward, directory, "cuda")
    print(f"GPU-RESULT extra_state: {len(got['extra_state'])} entries, {got['tensors']} tensors")
    assert got["extra_state"], "the TE model has no _extra_state entries to leave alone"
    assert got["tensors"] == len(index["weight_map"])
    assert not got["left_to_host"] and not got["lines"], (got["left_to_host"], got["lines"])


SHARED_CASES = [
    pytest.param("qwen3", {"tp": 2}, id="qwen3-tp2"),
    pytest.param("qwen3_moe", {"ep": 2}, id="qwen3_moe-ep2"),
    pytest.param("deepseek_v3", {"tp": 2}, id="deepseek_v3-tp2"),
]


@pytest.mark.parametrize(("name", "layout"), SHARED_CASES)
def test_ranks_sharing_the_gpu_load_cuda_te_parameters_as_the_cpu_model(
    shared_gpu: RankPool, checkpoint: Any, name: str, layout: dict[str, int]
) -> None:
    for rank, got in enumerate(
        shared_gpu.run(te_load_and_local_load, checkpoint(name), layout, "cuda")
    ):
        print(f"GPU-RESULT shared {name} {layout} rank {rank}: {got}")
        assert got["devices"] == ["cuda"] and got["te_modules"] > 0
        assert not got["differs"], f"rank {rank}: {got['differs']}"
