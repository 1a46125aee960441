"""A host without an adapter of its own (NeMo-RL, slime, ROLL, Megatron-LM, a plain script)
gets megastart through the libraries it calls: Megatron-Bridge's HF loader goes through
``on_model_load`` (and loads bit for bit what the bridge loads), megatron-core's schedules
through ``pre_first_step`` once, before the first micro-batch, however the schedule was
cached; ``library_adapters=false`` keeps them detached.

On CPU over gloo, megastart activated in each rank as ``AUTOWRAPT_BOOTSTRAP`` does it. The
Megatron-Bridge cases run where it is installed (the ``verl`` nox session's second
environment: megatron-core 0.19.2, megatron-bridge 0.5.1).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from support.bridge_ranks import differences

from megastart.harness.launch import RankPool

HAS_BRIDGE = importlib.util.find_spec("megatron.bridge") is not None
needs_bridge = pytest.mark.skipif(not HAS_BRIDGE, reason="Megatron-Bridge is not installed here")
needs_mbridge = pytest.mark.skipif(
    importlib.util.find_spec("mbridge") is None or HAS_BRIDGE,
    reason="mbridge runs on megatron-core < 0.17, without Megatron-Bridge (the verl session's "
    "first environment)",
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> str:
    from megastart.harness.checkpoints import make_checkpoint

    return str(make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3")))


def assert_loaded_as_the_library(runs: list[dict[str, Any]], module: str, host: str) -> None:
    """Each rank of :func:`support.library_ranks.theirs_then_ours`: the library's own load
    reached no hook, megastart's reached ``on_model_load`` once (``host``'s adapter on
    ``module``) and left the state the library's load leaves, bit for bit."""
    for rank, out in enumerate(runs):
        assert module in out["attached"]
        assert out["calls_theirs"] == [], f"rank {rank}: a host adapter above answered the load"
        assert out["calls"] == [("on_model_load", {"host": host, "report": True})]
        assert not any(t.isnan().any() for t in out["ours"].values()), f"rank {rank}"
        assert not differences(out["theirs"], out["ours"]), f"rank {rank}"


@needs_bridge
def test_auto_bridge_load_hf_weights_is_megastarts_load_bit_for_bit(
    rank_pools: dict[int, RankPool], qwen3: str
) -> None:
    from support.library_ranks import bridge_load_hf_weights

    runs = rank_pools[2].run(bridge_load_hf_weights, qwen3, {"tp": 2})
    assert_loaded_as_the_library(
        runs, "megatron.bridge.models.conversion.model_bridge", "megatron-bridge"
    )


@needs_mbridge
def test_mbridge_load_weights_is_megastarts_load_bit_for_bit(
    rank_pools: dict[int, RankPool], tmp_path: Any
) -> None:
    from support.library_ranks import mbridge_load_weights

    from megastart.harness.checkpoints import make_checkpoint

    # a vocabulary both pad alike (mbridge to a multiple of 128 x TP, megastart's harness its own)
    qwen2 = str(make_checkpoint("qwen2", tmp_path, vocab_size=512))
    runs = rank_pools[2].run(mbridge_load_weights, qwen2, {"tp": 2})
    assert_loaded_as_the_library(runs, "mbridge.core.bridge", "mbridge")


@needs_bridge
def test_a_provider_with_load_weights_is_loaded_by_megastart_bit_for_bit(
    rank_pools: dict[int, RankPool], qwen3: str
) -> None:
    """NeMo-RL's import: ``to_megatron_provider(load_weights=True)``, then
    ``provide_distributed_model`` runs the bridge's loader as a pre-wrap hook."""
    from support.library_ranks import provider_with_load_weights

    for rank, out in enumerate(rank_pools[2].run(provider_with_load_weights, qwen3, {"tp": 2})):
        assert out["calls"] == [("on_model_load", {"host": "megatron-bridge", "report": True})]
        assert not differences(out["theirs"], out["ours"]), f"rank {rank}"


@pytest.mark.parametrize("seen_on", [0, 1], ids=["rank0-sees-it", "rank1-sees-it"])
def test_a_checkpoint_directory_seen_on_some_ranks_only_is_loaded_as_rank_0_sees_it(
    rank_pools: dict[int, RankPool], qwen3: str, tmp_path: Any, seen_on: int
) -> None:
    """A directory mounted on some nodes only: every rank loads the way rank 0 sees it (its
    reader), megastart's load or the library's own, never some one and some the other (their
    collectives would never meet)."""
    from support.library_ranks import library_load_seeing

    sources = [qwen3 if rank == seen_on else str(tmp_path / "not-mounted") for rank in range(2)]
    runs = rank_pools[2].run(library_load_seeing, qwen3, sources, {"tp": 2})
    for rank, out in enumerate(runs):
        if seen_on == 0:
            assert out["own"] == [], f"rank {rank} ran the library's own load"
            assert out["calls"] == [("on_model_load", {"host": "megatron-core", "report": True})]
            assert not any(t.isnan().any() for t in out["state"].values()), f"rank {rank}"
        else:
            assert out["own"] == [sources[rank]], f"rank {rank} did not run the library's load"
            assert out["calls"] == [], f"rank {rank} went through megastart: {out['calls']}"


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_pre_first_step_runs_once_before_a_cached_schedules_first_micro_batch(
    rank_pools: dict[int, RankPool], qwen3: str, layout: dict[str, int]
) -> None:
    """As Megatron-LM and ROLL call it: ``get_forward_backward_func()`` cached once, a
    forward-only (log-prob) pass first, then training passes."""
    from support.library_ranks import cached_schedule_steps

    for out in rank_pools[2].run(cached_schedule_steps, qwen3, layout):
        assert "megatron.core.pipeline_parallel.schedules" in out["attached"]
        assert out["calls"] == [("pre_first_step", {"host": "megatron-core", "steps_before": 0})], (
            out["calls"]
        )
        assert out["warmup"] == "pre_first_step"
        assert out["steps"] > 0


def test_library_adapters_off_keeps_them_detached_and_the_schedule_unhooked(
    qwen3: str,
) -> None:
    from support.library_ranks import cached_schedule_steps

    with RankPool(2, timeout_s=120, env={"MEGASTART_LIBRARY_ADAPTERS": "0"}) as pool:
        for out in pool.run(cached_schedule_steps, qwen3, {"tp": 2}):
            assert not any(name.startswith("megatron.") for name in out["attached"])
            assert out["calls"] == [] and out["warmup"] is None


@needs_bridge
def test_nemo_rl_sequence_loads_through_megastart_and_warms_the_training_world_once(
    rank_pools: dict[int, RankPool], qwen3: str, tmp_path: Any
) -> None:
    """Convert in one world, ``destroy_model_parallel``, train in the next: megastart's load
    converts, leaves no process group behind, and the training world is warmed once."""
    from support.library_ranks import nemo_rl_sequence

    saved = tmp_path / "converted"
    for rank, out in enumerate(rank_pools[2].run(nemo_rl_sequence, qwen3, str(saved), {"tp": 2})):
        assert out["calls"] == [
            ("on_model_load", {"host": "megatron-bridge", "report": True}),
            ("pre_first_step", {"host": "megatron-core", "steps_before": 0}),
        ], f"rank {rank}: {out['calls']}"
        assert out["groups_left"] == 0
        assert out["warmup_in_conversion"] is None
        assert out["warmup"] == "pre_first_step"
        assert out["same"], f"rank {rank}: the training world does not hold the converted weights"


@pytest.mark.parametrize(
    "loader",
    ["megatron-lm", pytest.param("megatron-bridge", marks=needs_bridge)],
)
def test_a_resume_through_load_checkpoint_runs_post_recover_load_once_and_a_fresh_start_none(
    rank_pools: dict[int, RankPool], qwen3: str, tmp_path: Any, loader: str
) -> None:
    """Megatron-LM's ``load_checkpoint`` (slime's resume too) and Megatron-Bridge's (NeMo-RL's)
    of a real ``torch_dist`` checkpoint saved at iteration 5: ``post_recover_load`` once, the
    warmup there; a load that finds no checkpoint (iteration 0) fires nothing."""
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron.training ships with megatron-core wheels from 0.19")
    from support.resume_ranks import megatron_lm_resume

    saved = str(tmp_path / "saved")
    runs = rank_pools[2].run(megatron_lm_resume, qwen3, saved, {"tp": 2}, loader)
    for rank, out in enumerate(runs):
        assert out["iterations"] == (5, 0)
        assert out["calls"] == [("post_recover_load", {"host": loader, "restart": True})]
        assert out["warmup"] == "post_recover_load"
        assert out["same"], f"rank {rank}: the resumed model does not hold the saved weights"
