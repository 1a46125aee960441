"""The CPU harness is exact: Megatron chunks built by megastart.harness.model, filled by a plain
reference copier, give the transformers model's logits on every rank, for every layout.

This is what the loader's logit tests stand on: if forward_logits or build_gpt_chunks
were off (rotary layout, norm eps, softmax scale, vocab padding, pipeline order),
these tests fail without any loader involved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.harness_ranks import reference_copy_logits, shims_during_and_after

from megastart.harness.checkpoints import (
    ARCHITECTURES,
    make_checkpoint,
    parameter_count,
    scaled_config,
)

TOKENS = torch.tensor([[3, 17, 299, 42, 0, 8, 150, 77, 5, 260], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])

LAYOUTS = {  # all on 4 ranks, so one pool serves every case
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "tp2pp2": dict(tp=2, pp=2),
    "tp2pp2vpp2": dict(tp=2, pp=2, vpp=2),
}
MODELS = {  # name -> (arch, tied)
    "llama-untied": ("llama", False),
    "llama-tied": ("llama", True),
    "mistral": ("mistral", False),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", True),
    "qwen3_moe": ("qwen3_moe", False),
    "qwen2_moe": ("qwen2_moe", False),
    "mixtral": ("mixtral", False),
}
MOE_LAYOUTS = {"ep2": dict(ep=2), "tp2ep2": dict(tp=2, ep=2), "ep4pp1etp1": dict(ep=4, etp=1)}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``name -> (config, state_dict, logits)`` of the checkpoint read back by transformers."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[Any, dict[str, torch.Tensor], torch.Tensor]] = {}

    def get(name: str) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
        if name not in cache:
            arch, tied = MODELS[name]
            directory = make_checkpoint(
                arch, tmp_path_factory.mktemp(name), tie_word_embeddings=tied
            )
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            with torch.no_grad():
                logits = model(TOKENS).logits
            cache[name] = (model.config, model.state_dict(), logits)
        return cache[name]

    return get


def assert_every_rank_matches(results: list[torch.Tensor], expected: torch.Tensor) -> None:
    for rank, logits in enumerate(results):
        assert logits.shape == expected.shape, f"rank {rank}"
        diff = (logits - expected).abs().max().item()
        assert diff <= 1e-4, f"rank {rank}: max abs logit difference {diff:.3g}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_reference_copy_logits_match_transformers(
    rank_pools: Any, hf_models: Any, model: str, layout: str
) -> None:
    config, state, expected = hf_models(model)
    results = rank_pools[4].run(reference_copy_logits, config, state, LAYOUTS[layout], TOKENS)
    assert_every_rank_matches(results, expected)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
@pytest.mark.parametrize("model", ["qwen2_moe", "mixtral"])
def test_expert_parallel_logits_match_transformers(
    rank_pools: Any, hf_models: Any, model: str, layout: str
) -> None:
    config, state, expected = hf_models(model)
    results = rank_pools[4].run(reference_copy_logits, config, state, MOE_LAYOUTS[layout], TOKENS)
    assert_every_rank_matches(results, expected)


def test_uneven_pipeline_stages_match_transformers(rank_pools: Any, hf_models: Any) -> None:
    config, state, expected = hf_models("qwen3")
    uneven = {"num_layers_in_first_pipeline_stage": 1}  # 1 layer on stage 0, 3 on stage 1
    results = rank_pools[4].run(reference_copy_logits, config, state, dict(pp=2), TOKENS, **uneven)
    assert_every_rank_matches(results, expected)


def test_destroy_megatron_undoes_the_shims(rank_pools: Any) -> None:
    for during, restored, still_initialized in rank_pools[4].run(shims_during_and_after):
        assert during == "cpu"
        assert restored
        assert not still_initialized


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_checkpoint_holds_one_tensor_per_expert(tmp_path: Path, arch: str) -> None:
    directory = make_checkpoint(arch, tmp_path)
    names = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    expert = {
        "qwen3_moe": "model.layers.0.mlp.experts.3.down_proj.weight",
        "mixtral": "model.layers.0.block_sparse_moe.experts.3.w2.weight",
    }[arch]
    assert expert in names
    assert not any("gate_up_proj" in name for name in names)
    assert len(set(names.values())) > 1  # sharded


def test_checkpoint_weights_are_all_random(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    directory = make_checkpoint("qwen2", tmp_path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in directory.glob("*.safetensors"):
        tensors |= load_file(shard)
    assert set(json.loads((directory / "config.json").read_text())["architectures"]) == {
        "Qwen2ForCausalLM"
    }
    norm = tensors["model.layers.0.input_layernorm.weight"]
    bias = tensors["model.layers.0.self_attn.q_proj.bias"]
    assert not torch.allclose(norm, torch.ones_like(norm))  # a swapped norm would show
    assert not torch.allclose(bias, torch.zeros_like(bias))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_scaled_config_is_near_the_target_size(arch: str) -> None:
    config = scaled_config(arch, 300_000_000)
    assert abs(parameter_count(config) * 2 - 300e6) < 0.15 * 300e6
    assert str(config.dtype).removeprefix("torch.") == "bfloat16"
