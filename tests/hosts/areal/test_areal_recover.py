"""AReaL's real recover path and first step with megastart attached, on real
Megatron-core GPT chunks over gloo (2 ranks, tensor parallel 2)."""

from __future__ import annotations

import pytest
from areal_cpu import activated_pool

PROBE_ONLY = {
    "MEGASTART_BLOCKLIST": "rank0_loader,comm_warmup",
    "AREAL_PROBE_HANDLE_LOAD": "1",
}


def _recover_then_step(checkpoint: str, fileroot: str) -> dict:
    from areal_ranks import (
        engine_on_cpu,
        first_forward,
        parameter_sums,
        recording_engine_class,
        recover,
        save_recover_checkpoint,
        zero_parameters,
    )
    from megastart_areal_probe import record

    engine = engine_on_cpu(checkpoint, tp=2, engine_class=recording_engine_class())
    saved = save_recover_checkpoint(engine, fileroot)
    zero_parameters(engine)
    record("weights.zeroed")
    info = recover(engine, fileroot)
    restored = parameter_sums(engine)
    return {
        "saved": saved,
        "restored": restored,
        "global_step": info.last_step_info.global_step,
        "forward": first_forward(engine),
    }


def test_post_recover_load_runs_after_the_checkpoint_load_and_before_update_weights(
    checkpoint, tmp_path
):
    from megastart_areal_probe import events

    log = tmp_path / "events.jsonl"
    with activated_pool({**PROBE_ONLY, "AREAL_PROBE_LOG": str(log)}) as ranks:
        results = ranks.run(_recover_then_step, checkpoint, str(tmp_path / "fileroot"))
    for rank, out in enumerate(results):
        assert out["global_step"] == 0
        assert out["restored"] == pytest.approx(out["saved"]), f"rank {rank}: not restored"
        print(f"rank {rank}: AReaL's forward_batch on CPU: {out['forward']}")
        seen = [e for e in events(str(log)) if e["rank"] == rank]
        names = [e["event"] for e in seen]
        assert names[:2] == ["on_model_load", "weights.zeroed"]
        assert names[2:7] == [
            "post_recover_load",
            "connect_engine",
            "rollout.pause",
            "update_weights",
            "rollout.resume",
        ]
        assert "pre_first_step" in names[7:]
        hooks = {e["event"]: e for e in seen}
        assert hooks["on_model_load"]["checkpoint"] == checkpoint
        assert hooks["post_recover_load"]["is_restart"] is True
        assert hooks["post_recover_load"]["checkpoint"].endswith("recover_checkpoint")
        assert hooks["pre_first_step"]["is_restart"] is True
        assert names.count("pre_first_step") == 1


def _retried_calls(checkpoint: str, fileroot: str) -> dict:
    from areal_ranks import (
        engine_on_cpu,
        parameter_sums,
        recording_engine_class,
        recover,
        save_recover_checkpoint,
        zero_parameters,
    )

    from megastart.distributed import FailedBefore

    engine = engine_on_cpu(checkpoint, tp=2, engine_class=recording_engine_class())
    save_recover_checkpoint(engine, fileroot)
    try:
        recover(engine, fileroot)
    except RuntimeError as error:
        first = str(error)
    zero_parameters(engine)
    retried = {}
    for name, call in {
        "recover": lambda: recover(engine, fileroot),
        "hf_load": lambda: engine._load_model_from_hf(checkpoint),
        "step": lambda: engine.forward_batch({}),
    }.items():
        try:
            call()
            retried[name] = "ran"
        except FailedBefore as error:
            retried[name] = f"{error} (cause: {error.__cause__})"
    return {"first": first, "retried": retried, "untouched": not any(parameter_sums(engine))}


def test_a_retried_rpc_reraises_the_failed_hook_before_any_collective(checkpoint, tmp_path):
    env = {**PROBE_ONLY, "AREAL_PROBE_FAIL": "post_recover_load"}
    with activated_pool(env) as ranks:
        results = ranks.run(_retried_calls, checkpoint, str(tmp_path / "fileroot"))
    for out in results:
        assert out["first"] == "areal_probe: post_recover_load failed on purpose"
        for name, message in out["retried"].items():
            assert "post_recover_load already failed in this process" in message, name
            assert "failed on purpose" in message, name
        # the retried recover load did not run AReaL's (collective) checkpoint load
        assert out["untouched"]
