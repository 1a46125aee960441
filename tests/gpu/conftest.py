"""The GPU suite: skipped where CUDA is not available, never in CI (the nox ``tests`` session
ignores this folder); run on the GPU machine with ``tests/gpu/run``.

Its checkpoints are tiny random bf16 models, written once per session: the project's own
(:func:`megastart.harness.checkpoints.make_checkpoint`), Gemma 3, OLMoE and gpt-oss
(architectures only Megatron-Bridge maps), FP8 block-scaled copies made from bf16 as
DeepSeek's are, and gpt-oss's MXFP4 release made from bf16 as OpenAI's are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megastart.harness.checkpoints import SMALL_SIZE
from megastart.harness.launch import RankPool

HERE = Path(__file__).parent

SMALL = dict(SMALL_SIZE, head_dim=16, dtype="bfloat16")
"""The size of :func:`megastart.harness.checkpoints.small_config`, for the configs made here."""

BRIDGE_ONLY = {
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", dict(query_pre_attn_scalar=16)),
    # as OLMoE: every head its own K/V, head size hidden / heads (its config has no head_dim)
    "olmoe": (
        "olmoe",
        "OlmoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, num_key_value_heads=8, head_dim=8),
    ),
    # gpt-oss: its experts' dims multiples of 32, as MXFP4's groups need (quantised: _mxfp4)
    "gpt_oss": (
        "gpt_oss",
        "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, sliding_window=8),
    ),
}
"""Architectures with no built-in table: (model_type, class, fields)."""


ROUTED_SEED = 6
"""DeepSeek-V3's weights for the logits case: on the test's tokens every MoE layer's routing
(group, then top-2 of the sigmoid scores plus bias) wins by at least 0.015 in fp32 (seed 0: by
0.00078 at one token of the first MoE layer, under bf16's spacing of 0.0039 near 0.5, and the
H100's bf16 router chose another expert there: mean error 0.088, max 4.08, argmax 81 %; the same
weights on the CPU's local specs: 0.012, 0.10, 100 %; these: 0.014, 0.087, 94 %)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA: run tests/gpu/run on the GPU machine")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="module")
def nccl() -> Iterator[RankPool]:
    """One rank over NCCL on the GPU, started once per module."""
    with RankPool(1, timeout_s=240, backend="nccl") as pool:
        yield pool


@pytest.fixture(scope="module")
def shared_gpu() -> Iterator[RankPool]:
    """Two ranks over gloo, both on the one GPU (NCCL refuses two ranks on one device)."""
    with RankPool(2, timeout_s=240) as pool:
        yield pool


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``checkpoint(name)``: the directory of a bf16 checkpoint, made on first use. ``name`` is
    an architecture of the harness, one of :data:`BRIDGE_ONLY`, a ``model_type`` of
    :mod:`support.tiny_models` (float32: Qwen3.5, Qwen3-Next, the VL models...), ``deepseek_v3_plain_q``
    (no ``q_lora_rank``), ``deepseek_v3_routed`` (:data:`ROUTED_SEED`), or
    ``<one of those>_fp8`` (FP8 block-scaled, DeepSeek's blocks, with its dequantisation
    beside it: :func:`reference_of`), or ``gpt_oss_mxfp4`` (gpt-oss's experts in MXFP4)."""
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = str(make(name, tmp_path_factory.mktemp(name)))
        return made[name]

    return get


def tiny_model_types() -> set[str]:
    from support.tiny_models import CONFIGS, TEXT_ONLY

    return {*CONFIGS, *TEXT_ONLY}


TINY = tiny_model_types()


def make(name: str, out: Path) -> Path:
    from support.quantise import DEEPSEEK_BLOCK, fp8_and_reference, quantise_mxfp4
    from support.tiny_models import make_tiny
    from transformers import AutoConfig

    from megastart.harness.checkpoints import make_checkpoint

    if name.endswith("_fp8"):  # beside it, "reference": its dequantisation (float32)
        directory = make(name.removesuffix("_fp8"), out / "bf16")
        return Path(fp8_and_reference(directory, out, DEEPSEEK_BLOCK)[0])
    if name.endswith("_mxfp4"):  # as OpenAI's releases: the experts packed
        directory = make(name.removesuffix("_mxfp4"), out)
        quantise_mxfp4(directory)
        return directory
    if name in TINY:  # written by transformers' own class (Megatron-Bridge's architectures)
        return make_tiny(name, out)
    if name in BRIDGE_ONLY:
        model_type, cls, fields = BRIDGE_ONLY[name]
        config = AutoConfig.for_model(model_type, architectures=[cls], **{**SMALL, **fields})
        return make_checkpoint(config, out)
    if name == "deepseek_v3_plain_q":
        return make_checkpoint("deepseek_v3", out, dtype="bfloat16", q_lora_rank=None)
    if name == "deepseek_v3_routed":
        return make_checkpoint("deepseek_v3", out, dtype="bfloat16", seed=ROUTED_SEED)
    return make_checkpoint(name, out, dtype="bfloat16")


@pytest.fixture(scope="session")
def truth(checkpoint: Any) -> Any:
    """``truth(name)``: transformers' float32 logits on :data:`support.loader_ranks.TOKENS` for
    the checkpoint (an FP8 one's: for its dequantisation), computed on the CPU."""
    from support.loader_ranks import reference_logits

    def get(name: str) -> torch.Tensor:
        directory = Path(checkpoint(name))
        return reference_logits(
            directory.parent / "reference" if name.endswith("_fp8") else directory
        )

    return get
