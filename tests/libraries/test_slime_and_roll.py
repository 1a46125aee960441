"""slime's and ROLL's own HF loaders go through ``on_model_load``: megastart loads the model
(logits as transformers computes them) and the host's loader does not run; with no plugin
handling the load, the host's loader runs as before.

slime and ROLL cannot be installed from the package index: their host modules here are
stand-ins with the wrapped functions' exact signatures and call order
(``tests/support/standins``, whose README names the commits they mirror); the models, the
process groups and megastart are real.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megastart.harness.launch import RankPool

NO_PLUGIN_LOADS = {"MEGASTART_BLOCKLIST": "rank0_loader,comm_warmup"}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.Tensor]:
    from support.loader_ranks import reference_logits

    from megastart.harness.checkpoints import make_checkpoint

    directory = make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    return str(directory), reference_logits(directory)


def test_slimes_hf_start_is_megastarts_load(rank_pools: dict[int, RankPool], qwen3: Any) -> None:
    from support.standin_ranks import slime_hf_start

    checkpoint, reference = qwen3
    for out in rank_pools[2].run(slime_hf_start, checkpoint, {"tp": 2}):
        assert "slime.backends.megatron_utils.hf_to_megatron" in out["attached"]
        assert out["calls"] == [("on_model_load", {"host": "slime", "report": True})]
        assert out["slime_loaded"] == [] and out["iteration"] == 0
        torch.testing.assert_close(out["logits"], reference, rtol=1e-4, atol=1e-4)


def test_slimes_own_loader_runs_when_no_plugin_loads(
    rank_pools: dict[int, RankPool], qwen3: Any
) -> None:
    from support.standin_ranks import slime_hf_start

    checkpoint, _ = qwen3
    for out in rank_pools[2].run(slime_hf_start, checkpoint, {"tp": 2}, **NO_PLUGIN_LOADS):
        assert out["calls"] == [("on_model_load", {"host": "slime", "report": False})]
        assert out["slime_loaded"] == [checkpoint]


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2, "vpp": 2}], ids=["tp2", "pp2_vpp2"])
def test_rolls_from_pretrained_is_megastarts_load(
    rank_pools: dict[int, RankPool], qwen3: Any, layout: dict[str, int]
) -> None:
    """ROLL's converter returns state dicts: megastart fills the models ROLL built, answers
    with their own state, and ROLL's key checks pass."""
    from support.standin_ranks import roll_from_pretrained

    checkpoint, reference = qwen3
    for out in rank_pools[2].run(roll_from_pretrained, checkpoint, layout):
        assert "mcore_adapter.models.model_factory" in out["attached"]
        assert out["calls"] == [("on_model_load", {"host": "roll", "report": True})]
        assert out["converted"] == []
        torch.testing.assert_close(out["logits"], reference, rtol=1e-4, atol=1e-4)


def test_rolls_own_converter_runs_when_no_plugin_loads(
    rank_pools: dict[int, RankPool], qwen3: Any
) -> None:
    from support.standin_ranks import roll_from_pretrained

    checkpoint, _ = qwen3
    for out in rank_pools[2].run(roll_from_pretrained, checkpoint, {"tp": 2}, **NO_PLUGIN_LOADS):
        assert out["calls"] == [("on_model_load", {"host": "roll", "report": False})]
        assert out["converted"] == [0]
