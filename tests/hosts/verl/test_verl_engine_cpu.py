"""verl's own ``MegatronEngine`` code, with the adapter attached through the real
activation (verl 0.9: installed = on; verl 0.7: the variable), on CPU over gloo at
TP=2: ``on_model_load`` dispatches from inside verl's ``_build_megatron_module``, a
``LoadReport`` skips verl's loader, ``None`` falls through to it. On both of verl
0.9's HF-load branches: mbridge's ``load_weights`` (``vanilla_mbridge: True``) and,
where megatron-bridge is installed, verl's default, Megatron-Bridge's
``load_hf_weights``."""

from __future__ import annotations

from functools import partial
from importlib import metadata

import pytest
import torch
import verl_bridge_cpu
import verl_cpu
from packaging.version import Version

PROBE_ONLY = {"MEGASTART_BLOCKLIST": "rank0_loader,comm_warmup"}


def why_megatron_bridge_cannot_run() -> str | None:
    try:
        metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        return "needs megatron-bridge (the verl nox session's second step installs it)"
    core = metadata.version("megatron-core")
    if Version(core) < Version("0.18"):
        return f"megatron-bridge 0.5 needs megatron-core >= 0.18; {core} is installed"
    return None


NO_MEGATRON_BRIDGE = why_megatron_bridge_cannot_run()


def test_a_load_report_skips_verls_own_loader(pool, checkpoint):

    ranks = pool.run(
        verl_cpu.load_on_rank, checkpoint, MEGASTART_VERL_PROBE_MODE="handle", **PROBE_ONLY
    )
    for out in ranks:
        assert out["attached"]["verl.workers.engine.megatron.transformer_impl"] is True
        # the library adapters beneath it are attached too, and passed through (one call)
        assert out["attached"]["mbridge.core.bridge"] is True
        assert out["attached"]["megatron.core.pipeline_parallel.schedules"] is True
        verl_cpu.check_probe_handled_load(out, checkpoint, "MegatronEngineWithLMHead")


def test_none_falls_through_to_verls_own_loader(pool, checkpoint):
    ranks = pool.run(
        verl_cpu.load_on_rank, checkpoint, MEGASTART_VERL_PROBE_MODE="pass", **PROBE_ONLY
    )
    for out in ranks:
        assert [call["hook"] for call in out["calls"]] == ["on_model_load"]
        verl_cpu.check_loaded_from_hf(out, checkpoint)


def test_megastarts_rank0_loader_loads_what_verls_loader_loads(pool, checkpoint):
    verl_cpu.check_same_weights_one_reader(pool.run(verl_cpu.loaders_on_rank, checkpoint))


def test_pre_first_step_runs_once_before_verls_first_step(pool, checkpoint):
    ranks = pool.run(verl_cpu.first_steps_on_rank, checkpoint, **PROBE_ONLY)
    for out in ranks:
        assert [call["hook"] for call in out["calls"]] == ["on_model_load", "pre_first_step"]
        assert out["calls"][1]["is_restart"] is False
        # How far verl's step gets on CPU: through verl's forward_backward_batch
        # (batch split, token all-reduce) into Megatron's schedule, which
        # allocates on "cuda". Both calls get there; the hook ran only before the first.
        assert len(out["stops"]) == 2
        for stop in out["stops"]:
            assert stop["verl_step_ran"]
            assert stop["innermost"][0].endswith("torch/cuda/__init__.py")
            assert stop["torch_called_from"] == (
                stop["torch_called_from"][0],
                "forward_backward_no_pipelining",
            )
            assert stop["torch_called_from"][0].endswith(
                "megatron/core/pipeline_parallel/schedules.py"
            )


@pytest.mark.skipif(
    Version(metadata.version("verl")) < Version("0.9"),
    reason="the recover checkpoint cannot be written on CPU: verl 0.8's save_checkpoint calls "
    "torch.cpu.empty_cache(), which does not exist; verl 0.7's needs a DDP-wrapped (trainable) "
    "engine, which Megatron's optimizer cannot build on CPU",
)
def test_post_recover_load_runs_after_verls_resume_load(pool, checkpoint, tmp_path):
    recover_dir = str(tmp_path / "global_step_1" / "actor")
    ranks = pool.run(verl_cpu.recover_on_rank, checkpoint, recover_dir, **PROBE_ONLY)
    for out in ranks:
        assert [call["hook"] for call in out["calls"]] == ["on_model_load", "post_recover_load"]
        recover = out["calls"][1]
        assert recover["checkpoint"] == recover_dir
        assert recover["is_restart"] is True
        # the hook saw the restored weights, not the overwritten ones (3.0 everywhere)
        assert recover["first_param_sum"] == out["saved_sum"]


CRITICS_ON_THE_ENGINE = pytest.mark.skipif(
    Version(metadata.version("verl")) < Version("0.8"),
    reason="verl 0.7 builds Megatron critics only in its legacy CriticWorker",
)


@pytest.fixture(scope="module")
def reward_checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2_reward")
    verl_cpu.save_tiny_qwen2(path, reward_model=True)
    return str(path)


@CRITICS_ON_THE_ENGINE
def test_a_critic_loads_through_on_model_load(pool, checkpoint):
    ranks = pool.run(
        verl_cpu.load_on_rank,
        checkpoint,
        value_model=True,
        MEGASTART_VERL_PROBE_MODE="handle",
        **PROBE_ONLY,
    )
    for out in ranks:
        verl_cpu.check_probe_handled_load(
            out, checkpoint, "MegatronEngineWithValueHead", value_model=True
        )
        assert out["params"]["output_layer.weight"].shape == (1, 64)  # verl's value head


@CRITICS_ON_THE_ENGINE
def test_a_critic_falls_through_to_verl_when_rank0_loader_is_blocked(pool, checkpoint):
    ranks = pool.run(
        verl_cpu.load_on_rank,
        checkpoint,
        value_model=True,
        MEGASTART_VERL_PROBE_MODE="pass",
        **PROBE_ONLY,
    )
    for out in ranks:
        verl_cpu.check_critic_fell_through_to_verl(out, checkpoint)


@CRITICS_ON_THE_ENGINE
def test_megastarts_rank0_loader_loads_a_critic_as_verls_loader_does(pool, checkpoint):
    """Every parameter equal to what verl's loader (mbridge) writes, the value head
    included: both leave it as verl built it (the checkpoint's LM head is not one)."""
    ranks = pool.run(verl_cpu.loaders_on_rank, checkpoint, verl_cpu.critic_weights)
    summary = verl_cpu.check_same_weights_one_reader(ranks)
    assert "left to the host: ['output_layer.weight']" in summary
    lm_head = verl_cpu.hf_tensor(checkpoint, "lm_head.weight")
    for out in ranks:
        head = out["params"]["rank0_loader"]["output_layer.weight"]
        assert not any(torch.equal(head[0], row) for row in lm_head)


@CRITICS_ON_THE_ENGINE
def test_a_critic_takes_a_reward_checkpoints_score_head(pool, reward_checkpoint):
    """From a ``Qwen2ForSequenceClassification`` checkpoint the value head is its
    ``score.weight``, the backbone its decoder. (verl's mbridge loader refuses this
    checkpoint: "Weights {'lm_head.weight'} not found in safetensors files".)"""
    ranks = pool.run(
        verl_cpu.load_on_rank,
        reward_checkpoint,
        value_model=True,
        MEGASTART_BLOCKLIST="comm_warmup,verl_probe",
    )
    for out in ranks:
        verl_cpu.check_critic_from_reward_checkpoint(out, reward_checkpoint)


@pytest.mark.skipif(NO_MEGATRON_BRIDGE is not None, reason=str(NO_MEGATRON_BRIDGE))
@pytest.mark.parametrize("role", ["actor", "ref", "critic"])
def test_rank0_loader_loads_what_megatron_bridge_loads_on_verls_default_engine(
    pool, checkpoint, role
):
    # verl's default engine config: Megatron-Bridge's provider builds the model, the
    # adapter shadows load_hf_weights on the engine's bridge (whose registry then maps
    # the checkpoint); with rank0_loader blocked, Megatron-Bridge's own load_hf_weights
    # fills the same model. A critic's value head keeps verl's initialisation either way.
    weights = partial(verl_bridge_cpu.loaded_weights, role=role)
    verl_cpu.check_same_weights_one_reader(pool.run(verl_cpu.loaders_on_rank, checkpoint, weights))
