"""Restarts skip the HF load they would overwrite (:mod:`megastart.restart`), on real
megatron-core models over gloo: the resume replaces the deferred load only where it restored
every parameter, on every rank; anything else runs the load first."""

from __future__ import annotations

from pathlib import Path

import pytest

from megastart.harness.checkpoints import make_checkpoint

TP2 = {"tp": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("llama", tmp_path_factory.mktemp("hf")))


def test_a_resume_that_restores_every_parameter_replaces_the_hf_load(
    rank_pools, checkpoint, tmp_path
):
    from support.restart_ranks import first_life, second_life

    saved = str(tmp_path / "saved")
    pool = rank_pools[2]
    trained = pool.run(first_life, checkpoint, saved, TP2)
    resumed = pool.run(
        second_life, checkpoint, saved, TP2, resume=True, strict="assume_ok_unexpected"
    )
    size = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    for rank in range(2):
        assert resumed[rank]["ran"] == []  # the HF checkpoint was never read
        assert resumed[rank]["sums"] == trained[rank]
        assert resumed[rank]["skip"] == size


def test_a_fresh_start_runs_the_deferred_load_before_its_first_forward(
    rank_pools, checkpoint, tmp_path
):
    from support.restart_ranks import second_life

    fresh = rank_pools[2].run(second_life, checkpoint, "", TP2, resume=False, strict="")
    for rank in range(2):
        assert fresh[rank]["ran"] == ["hf"]


def test_a_resume_lacking_parameters_fails_on_every_rank_naming_them(
    rank_pools, checkpoint, tmp_path
):
    from support.restart_ranks import first_life, second_life

    saved = str(tmp_path / "partial")
    pool = rank_pools[2]
    pool.run(first_life, checkpoint, saved, TP2, "output_layer")
    failed = pool.run(second_life, checkpoint, saved, TP2, resume=True, strict="ignore_all")
    for rank in range(2):
        error = failed[rank]["error"]
        assert "output_layer.weight" in error, error
        assert "MEGASTART_RANK0_LOADER_SKIP_HF_LOAD_ON_RESUME=0" in error
        assert failed[rank]["ran"] == []
    assert failed[0]["error"] == failed[1]["error"]
