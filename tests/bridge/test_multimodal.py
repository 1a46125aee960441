"""Vision-language models load as Megatron-Bridge loads them: the language model's decoder
and the vision tower (its parameters outside any GPT decoder, mostly ``ReplicatedMapping``
over ``visual.**``), bit for bit, on every rank. Models built by the bridge's own provider
on CPU; the tower is each rank's whole, the decoder its TP slice."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support.bridge_ranks import bridge_and_megastart
from support.multimodal import make_multimodal

from megastart.harness.launch import RankPool


@pytest.mark.parametrize(
    ("model_type", "layout"), [("qwen2_5_vl", {"tp": 2})], ids=["qwen2_5_vl-tp2"]
)
def test_a_vision_language_model_loads_as_megatron_bridge_loads_it(
    rank_pools: dict[int, RankPool],
    tmp_path_factory: pytest.TempPathFactory,
    model_type: str,
    layout: dict[str, int],
) -> None:
    directory = make_multimodal(model_type, Path(tmp_path_factory.mktemp(model_type)))
    for rank, (theirs, ours, report) in enumerate(
        rank_pools[2].run(bridge_and_megastart, str(directory), layout)
    ):
        assert report is not None, f"rank {rank}: megastart left the load to the bridge"
        tower = [n for n in theirs if ".visual." in n or n.startswith("0:visual.")]
        loaded = [n for n in tower if not theirs[n].isnan().any()]
        assert len(loaded) > 10, f"rank {rank}: the bridge loaded no tower: {tower[:5]}"
        for name in theirs:
            same = torch.equal(theirs[name].nan_to_num(7.0), ours[name].nan_to_num(7.0))
            assert same, f"rank {rank}: {name} differs from the bridge's load"
