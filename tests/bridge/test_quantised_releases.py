"""Quantised releases whose Megatron-Bridge hook dequantises them load as the bridge loads them,
bit for bit, each rank dequantising only the rows it takes: gpt-oss's MXFP4 (``X_blocks`` /
``X_scales``, made here from a bf16 checkpoint as OpenAI's releases are) into a model built by
the bridge's own provider, every parameter NaN before each load; Kimi-K2.5's INT4
(compressed-tensors' ``pack-quantized``) on a routed expert's tensors, against its bridge's
hook and mapping (:mod:`support.quantised_ranks`).

The model is float32, so that the bf16 rounding the bridge's ``dequantize_mxfp4`` applies
before the copy shows; the buckets are 10 KiB, so each packed tensor travels as row blocks
of an expert or two while its scales arrive whole before it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:  # imported with shims, by the ranks
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.bridge_ranks import bridge_and_megastart
from support.quantise import quantise_mxfp4
from support.quantised_ranks import kimi_k25_int4_expert

from megastart.harness.checkpoints import make_checkpoint
from megastart.harness.launch import RankPool

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
        for name in theirs:
            same = torch.equal(theirs[name].nan_to_num(7.0), ours[name].nan_to_num(7.0))
            assert same, f"rank {rank}: {name} differs from the bridge's load"


@pytest.mark.parametrize("intermediate", [64, 96], ids=["groups_split_evenly", "a_group_split"])
def test_kimi_k25_int4_experts_load_as_its_bridge_dequantises_them(
    rank_pools: dict[int, RankPool], intermediate: int
) -> None:
    """On tensors (no model: Kimi-K2.5's vision tower is the hub's remote code), expert TP 2:
    ``linear_fc1``'s rows and ``linear_fc2``'s columns of each rank; with 96 columns a rank's
    half of ``down_proj`` starts inside a group of 32 and inside a packed word."""
    for rank, loaded in enumerate(rank_pools[2].run(kimi_k25_int4_expert, intermediate)):
        for theirs, ours, name in loaded:
            assert name.startswith("expert_"), name
            assert not ours.isnan().any(), f"rank {rank}: rows left unplaced by {name}"
            assert torch.equal(theirs, ours), f"rank {rank}: {name} differs"


INT4_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
EXPERT = "language_model.model.layers.1.mlp.experts.0.down_proj.weight"
INT4_HEADERS = {
    EXPERT + "_packed": ("int32", (64, 12)),
    EXPERT + "_scale": ("bfloat16", (64, 3)),
    EXPERT + "_shape": ("int32", (2,)),
    "language_model.model.norm.weight": ("bfloat16", (64,)),
}


@pytest.mark.parametrize(
    ("config", "extra", "packing"),
    [
        ({"quantization_config": INT4_CONFIG}, {}, "int4"),
        ({"text_config": {"quantization_config": INT4_CONFIG}}, {}, "int4"),
        ({"quantization_config": INT4_CONFIG}, {"x.qweight": ("int32", (8, 8))}, ""),
        ({"quantization_config": {"quant_method": "mxfp4"}}, {}, ""),
    ],
    ids=["int4", "int4-in_text_config", "int4-with_gptq_tensors", "mxfp4-without_blocks"],
)
def test_packed_releases_are_told_from_their_headers(
    config: dict, extra: dict, packing: str
) -> None:
    """Dequantised only where every non-float tensor is the packing's (else refused)."""
    from megastart.loader.checkpoint.quantised import find_quantisation

    found = find_quantisation(config, {**INT4_HEADERS, **extra})
    assert found is not None and found.packing == packing, found


def _read(report: object, directory: Path) -> list[str]:
    """The checkpoint's tensors, where the report counts every one of them read."""
    import json

    names = list(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
    assert getattr(report, "tensors", None) == len(names), (report, len(names))
    return names
