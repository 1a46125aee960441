"""verl 0.7's own legacy Megatron workers, with the adapter attached through the real
activation (``AUTOWRAPT_BOOTSTRAP=megastart.bootstrap``, verl 0.7's route), on CPU over gloo at
TP=2: ``on_model_load`` dispatches from inside ``_build_model_optimizer`` in both of
its HF branches (verl's legacy ``load_megatron_gptmodel_weights`` and mbridge), a
``LoadReport`` skips verl's loader, ``None`` falls through to it, and
``pre_first_step`` runs once before the worker's first step."""

from __future__ import annotations

import pytest
import verl_cpu
import verl_legacy_cpu

pytest.importorskip("verl.workers.megatron_workers", reason="needs verl 0.7 (legacy workers)")

PROBE_ONLY = {"MEGASTART_BLOCKLIST": "rank0_loader,comm_warmup"}
LOADERS = {"load_megatron_gptmodel_weights": False, "mbridge": True}
"""verl's two HF branches in the legacy workers -> ``use_mbridge``."""


@pytest.mark.parametrize("use_mbridge", LOADERS.values(), ids=LOADERS.keys())
def test_a_load_report_skips_verls_own_loader(pool, checkpoint, use_mbridge):

    ranks = pool.run(
        verl_legacy_cpu.load_on_rank,
        checkpoint,
        use_mbridge=use_mbridge,
        MEGASTART_VERL_PROBE_MODE="handle",
        **PROBE_ONLY,
    )
    for out in ranks:
        assert out["attached"]["verl.workers.megatron_workers"] is True
        verl_cpu.check_probe_handled_load(out, checkpoint, "ActorRolloutRefWorker")


@pytest.mark.parametrize("use_mbridge", LOADERS.values(), ids=LOADERS.keys())
def test_none_falls_through_to_verls_own_loader(pool, checkpoint, use_mbridge):
    ranks = pool.run(
        verl_legacy_cpu.load_on_rank,
        checkpoint,
        use_mbridge=use_mbridge,
        MEGASTART_VERL_PROBE_MODE="pass",
        **PROBE_ONLY,
    )
    for out in ranks:
        assert [call["hook"] for call in out["calls"]] == ["on_model_load"]
        verl_cpu.check_loaded_from_hf(out, checkpoint)


def test_megastarts_rank0_loader_loads_what_verls_legacy_loader_loads(pool, checkpoint):
    ranks = pool.run(verl_cpu.loaders_on_rank, checkpoint, verl_legacy_cpu.reference_weights)
    verl_cpu.check_same_weights_one_reader(ranks)


def test_pre_first_step_runs_once_before_the_workers_first_step(pool, checkpoint):
    ranks = pool.run(verl_legacy_cpu.first_steps_on_rank, checkpoint, **PROBE_ONLY)
    for out in ranks:
        assert [call["hook"] for call in out["calls"]] == ["on_model_load", "pre_first_step"]
        assert out["calls"][1]["is_restart"] is False
        # How far verl's step gets on CPU: through the worker's compute_ref_log_prob and
        # MegatronPPOActor's compute_log_prob and forward_backward_batch into Megatron's
        # schedule, which allocates on "cuda". Both calls get there; the hook ran only
        # before the first.
        assert len(out["stops"]) == 2
        for stop in out["stops"]:
            steps = [
                name
                for name in stop["verl_functions"]
                if name in ("compute_ref_log_prob", "compute_log_prob", "forward_backward_batch")
            ]
            assert steps == ["compute_ref_log_prob", "compute_log_prob", "forward_backward_batch"]
            assert stop["innermost"][0].endswith("torch/cuda/__init__.py"), stop
            assert stop["torch_called_from"][1] == "forward_backward_no_pipelining", stop


def test_an_actor_worker_loads_through_the_hook_then_stops_in_megatrons_optimizer(pool, checkpoint):
    ranks = pool.run(
        verl_legacy_cpu.actor_on_rank, checkpoint, MEGASTART_VERL_PROBE_MODE="handle", **PROBE_ONLY
    )
    for out in ranks:
        assert [call["hook"] for call in out["calls"]] == ["on_model_load"]
        assert out["calls"][0]["engine_class"] == "ActorRolloutRefWorker"
        # the actor's build goes on to its optimizer, which allocates on "cuda"
        assert "get_megatron_optimizer" in out["stop"]["verl_functions"], out["stop"]
        assert out["stop"]["innermost"][0].endswith("torch/cuda/__init__.py"), out["stop"]


@pytest.fixture(scope="module")
def reward_checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2_reward")
    verl_legacy_cpu.save_tiny_qwen2_with_tokenizer(path, reward_model=True)
    return str(path)


@pytest.mark.parametrize("use_mbridge", LOADERS.values(), ids=LOADERS.keys())
def test_a_critic_worker_loads_through_on_model_load(pool, checkpoint, use_mbridge):
    ranks = pool.run(
        verl_legacy_cpu.critic_on_rank,
        checkpoint,
        use_mbridge=use_mbridge,
        MEGASTART_VERL_PROBE_MODE="handle",
        **PROBE_ONLY,
    )
    for out in ranks:
        verl_cpu.check_probe_handled_load(out, checkpoint, "CriticWorker", value_model=True)
        assert out["params"]["output_layer.weight"].shape == (1, 64)  # verl's value head
        # the critic's build goes on to its optimizer, which allocates on "cuda"
        assert "get_megatron_optimizer" in out["stop"]["verl_functions"], out["stop"]


@pytest.mark.parametrize("use_mbridge", LOADERS.values(), ids=LOADERS.keys())
def test_a_critic_falls_through_to_verl_when_rank0_loader_is_blocked(pool, checkpoint, use_mbridge):
    ranks = pool.run(
        verl_legacy_cpu.critic_on_rank,
        checkpoint,
        use_mbridge=use_mbridge,
        MEGASTART_VERL_PROBE_MODE="pass",
        **PROBE_ONLY,
    )
    for out in ranks:
        verl_cpu.check_critic_fell_through_to_verl(out, checkpoint)


def test_megastarts_rank0_loader_loads_a_critic_as_verls_legacy_loader_does(pool, checkpoint):
    """Every parameter equal to what ``load_megatron_gptmodel_weights(..., is_value_model=True)``
    writes; the value head (weight and bias) stays as verl built it in both."""
    ranks = pool.run(verl_cpu.loaders_on_rank, checkpoint, verl_legacy_cpu.critic_weights)
    summary = verl_cpu.check_same_weights_one_reader(ranks)
    assert "left to the host: ['output_layer.bias', 'output_layer.weight']" in summary


def test_a_critic_takes_a_reward_checkpoints_score_head(pool, reward_checkpoint):
    """From a ``Qwen2ForSequenceClassification`` checkpoint (mbridge branch) the value head
    is its ``score.weight``, the backbone its decoder. verl 0.7's own paths cannot load
    this checkpoint into a critic: mbridge looks for an ``lm_head.weight``, and the legacy
    builder refuses the architecture ("'Qwen2ForSequenceClassification' is not a valid
    SupportedModel") before its loader, which would read ``score.weight``, runs."""
    ranks = pool.run(
        verl_legacy_cpu.critic_on_rank,
        reward_checkpoint,
        use_mbridge=True,
        MEGASTART_BLOCKLIST="comm_warmup,verl_probe",
    )
    for out in ranks:
        verl_cpu.check_critic_from_reward_checkpoint(out, reward_checkpoint)
