"""DeepSeek-V3 (and Kimi-K2, DeepSeek-R1: the same layout) and GLM-4.5 from the built-in
tables: the loaded Megatron model's logits equal the ``transformers`` model's in every
layout; the multi-token-prediction layers a hub checkpoint holds are left unread by a model
without them; and DeepSeek's FP8 release format loads as its block dequantisation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.loader_ranks import load_as_nodes, load_parameters, load_with_mtp, reference_logits
from support.quantise import rewrite_shards
from test_loader_fp8 import assert_same_parameters, fp8_and_reference
from test_loader_logits import assert_logits_match

from megastart.harness.launch import RankPool

LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "tp2": (2, {"tp": 2}),
    "ep2": (2, {"ep": 2}),
    "pp2": (2, {"pp": 2}),
    "tp2_ep2_etp1": (2, {"tp": 2, "ep": 2, "etp": 1}),
    "tp2_pp2_ep2_etp1": (4, {"tp": 2, "pp": 2, "ep": 2, "etp": 1}),
}

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v3": ("deepseek_v3", {}),  # MLA with a low-rank query (q_lora_rank)
    "deepseek_v3_plain_q": ("deepseek_v3", {"q_lora_rank": None}),  # as DeepSeek-V2-Lite
    "glm4_moe": ("glm4_moe", {}),
}

CASES = [
    pytest.param(model, layout, id=f"{model}-{layout}")
    for model in MODELS
    for layout in LAYOUTS
    if layout != "tp2_pp2_ep2_etp1" or model == "deepseek_v3"
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``model -> (directory, transformers logits)``, each made once."""
    from megastart.harness.checkpoints import make_checkpoint

    made: dict[str, tuple[str, torch.Tensor]] = {}

    def get(model: str) -> tuple[str, torch.Tensor]:
        if model not in made:
            arch, fields = MODELS[model]
            directory = make_checkpoint(arch, tmp_path_factory.mktemp(model), **fields)
            made[model] = (str(directory), reference_logits(directory))
        return made[model]

    return get


@pytest.mark.parametrize(("model", "layout"), CASES)
def test_logits_match_transformers(
    rank_pools: dict[int, RankPool], checkpoints: Any, model: str, layout: str
) -> None:
    world, parallel = LAYOUTS[layout]
    directory, expected = checkpoints(model)
    results = rank_pools[world].run(load_as_nodes, directory, parallel, 2, {"strict": True})
    assert_logits_match(results, expected)


MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
"""An MTP layer's own Megatron parameters and their checkpoint tensors (in its layer)."""


def multi_token_prediction_layer(tensors: dict[str, torch.Tensor], layers: int) -> None:
    """Append a copy of the last layer as the hub's MTP layer ``layers``, with norms and a
    projection of its own (random), as DeepSeek-V3's and GLM-4.5's released checkpoints hold it."""
    last = f"model.layers.{layers - 1}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[name.replace(last, f"model.layers.{layers}.")] = tensors[name].clone()
    if "model.norm.weight" in tensors:
        hidden = tensors["model.norm.weight"].shape[0]
        extra = f"model.layers.{layers}."
        generator = torch.Generator().manual_seed(layers)
        shapes = {"eh_proj.weight": (hidden, 2 * hidden)}
        for hf in MTP_OWN.values():
            tensors[extra + hf] = torch.randn(shapes.get(hf, (hidden,)), generator=generator)


@pytest.mark.parametrize("model", ["deepseek_v3", "glm4_moe"])
def test_multi_token_prediction_layers_are_left_unread_by_a_model_without_them(
    rank_pools: dict[int, RankPool], checkpoints: Any, model: str, tmp_path: Path
) -> None:
    import shutil

    from megastart.loader.checkpoint import read_config

    directory, expected = checkpoints(model)
    copy = Path(shutil.copytree(directory, tmp_path / model))
    layers = read_config(copy)["num_hidden_layers"]
    rewrite_shards(copy, lambda tensors: multi_token_prediction_layer(tensors, layers))
    results = rank_pools[2].run(load_as_nodes, str(copy), {"ep": 2}, 2, {"strict": True})
    assert_logits_match(results, expected)


@pytest.mark.parametrize(("model", "layout"), [("deepseek_v3", {"tp": 2}), ("glm4_moe", {"ep": 2})])
def test_multi_token_prediction_layer_loads_into_a_model_that_has_one(
    rank_pools: dict[int, RankPool], checkpoints: Any, model: str, layout: dict, tmp_path: Path
) -> None:
    """The MTP layer's transformer layer is the checkpoint's layer ``num_hidden_layers`` (a
    copy of the last decoder layer here, so it must equal that layer's parameters on every
    rank); its norms and ``eh_proj`` (split over TP like a column-parallel layer) are its own."""
    import shutil

    from safetensors import safe_open

    from megastart.loader.checkpoint import read_config, read_metadata

    directory, _ = checkpoints(model)
    copy = Path(shutil.copytree(directory, tmp_path / model))
    layers = read_config(copy)["num_hidden_layers"]
    rewrite_shards(copy, lambda tensors: multi_token_prediction_layer(tensors, layers))
    meta = read_metadata(copy, allow_pickle=False)

    def hf(name: str) -> torch.Tensor:
        entry = meta.tensors[f"model.layers.{layers}.{name}"]
        with safe_open(copy / entry.file, "pt") as f:
            return f.get_tensor(entry.name)

    for tp_rank, params in rank_pools[2].run(load_with_mtp, str(copy), layout):
        inner = "mtp.layers.0.transformer_layer."
        copied = [n for n in params if n.startswith(inner)]
        assert copied
        for name in copied:
            decoder = name.replace(inner, f"decoder.layers.{layers - 1}.")
            assert torch.equal(params[name], params[decoder]), name
        for megatron, checkpoint in MTP_OWN.items():
            got, want = params[f"mtp.layers.0.{megatron}"], hf(checkpoint)
            rows = got.shape[0]
            if megatron == "eh_proj.weight":
                want = want[tp_rank * rows : (tp_rank + 1) * rows]
            assert torch.equal(got, want), megatron


def test_deepseek_fp8_release_loads_as_its_block_dequantisation(
    rank_pools: dict[int, RankPool], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """DeepSeek-V3's FP8 projections (MLA's included) with 16x16 blocks, so that every
    tensor has several; the router, its bias and the norms stay in bf16, as released."""
    from megastart.harness.checkpoints import make_checkpoint

    out = tmp_path_factory.mktemp("deepseek-fp8")
    bf16 = make_checkpoint("deepseek_v3", out / "bf16", dtype="bfloat16")
    fp8, reference = fp8_and_reference(bf16, out, (16, 16))
    layout = {"tp": 2, "ep": 2, "etp": 1}
    pool = rank_pools[2]
    assert_same_parameters(
        pool.run(load_parameters, fp8, layout, {"bucket_mb": 0.01}),
        pool.run(load_parameters, reference, layout, {"bucket_mb": 0.01}),
    )
