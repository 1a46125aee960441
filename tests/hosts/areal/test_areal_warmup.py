"""megastart's real loader and warmup inside AReaL's real engine methods, next to
a weight-update group created the way AReaL creates it (2 ranks, TP 2, gloo)."""

from __future__ import annotations

import os
import sys

from areal_cpu import ACTIVATION
from support.pyrun import started_with

from megastart.harness.launch import RankPool


def pool(env: dict[str, str]) -> RankPool:
    with started_with(ACTIVATION):
        base = {"PYTHONPATH": os.pathsep.join(sys.path), "MEGASTART_COMM_WARMUP_TIMEOUT_S": "30"}
        return RankPool(2, timeout_s=300, env={**base, **env})


def _recover_next_to_update_group(checkpoint: str, fileroot: str, colocated: bool) -> dict:
    import torch.distributed as dist
    from areal_ranks import (
        RolloutStandIn,
        engine_on_cpu,
        first_forward,
        push_weights,
        recording_engine_class,
        recover,
        save_recover_checkpoint,
        weight_update_group_on_head,
    )
    from megastart_areal_probe import record

    from megastart.warmup.api import last_report

    engine = engine_on_cpu(checkpoint, tp=2, engine_class=recording_engine_class())
    update = weight_update_group_on_head() if dist.get_rank() == 0 else None
    registry = sorted(dist.distributed_c10d._world.pg_names.values())
    save_recover_checkpoint(engine, fileroot)
    recover(engine, fileroot)
    after_recover = last_report()
    if colocated:
        _initial_offload_as_ppo_trainer_does(RolloutStandIn())
    forward = first_forward(engine)
    report = last_report()
    record("done")
    return {
        "registry": registry,
        "after_recover": after_recover is not None,
        "trigger": report.trigger if report else None,
        "groups": list(report.groups) if report else [],
        "received": push_weights(update) if update else None,
        "forward": forward,
    }


def _initial_offload_as_ppo_trainer_does(rollout) -> None:
    """``PPOTrainer._apply_initial_offload_policy`` (AReaL 1.0.4), colocated actor and rollout."""
    from types import MethodType, SimpleNamespace

    from areal.trainer.rl_trainer import PPOTrainer

    trainer = SimpleNamespace(
        rollout=rollout,
        eval_rollout=None,
        _should_offload_rollout=True,
        _should_offload_ref=False,
        _should_offload_critic=False,
        _should_offload_teacher=False,
        _should_offload_actor=False,
    )
    trainer._offload_rollout = MethodType(PPOTrainer._offload_rollout, trainer)
    PPOTrainer._apply_initial_offload_policy(trainer)


def test_warmup_after_recover_load_leaves_the_weight_update_group_alone(checkpoint, tmp_path):
    from megastart_areal_probe import events

    log = tmp_path / "events.jsonl"
    env = {"AREAL_PROBE_LOG": str(log)}
    with pool(env) as ranks:
        results = ranks.run(
            _recover_next_to_update_group, checkpoint, str(tmp_path / "fileroot"), False
        )
    head = results[0]
    assert "update_weight_group_0" in head["registry"]  # the warmup could have seen it
    for rank, out in enumerate(results):
        assert out["after_recover"] and out["trigger"] == "post_recover_load"
        assert out["groups"] and not [g for g in out["groups"] if "update_weight" in g]
        names = [e["event"] for e in events(str(log)) if e["rank"] == rank]
        assert names.index("post_recover_load") < names.index("update_weights")
        print(f"rank {rank}: warmed {out['groups']}; AReaL forward_batch: {out['forward']}")
    # the rollout side's first message on the group is the weight push, nothing else
    assert head["received"] == [0.0, 1.0, 2.0, 3.0]


def test_colocated_areal_1_0_4_warms_at_the_first_step_after_the_offload(checkpoint, tmp_path):
    from megastart_areal_probe import events

    log = tmp_path / "events.jsonl"
    env = {"AREAL_PROBE_LOG": str(log), "MEGASTART_COMM_WARMUP_WHEN": "first_step"}
    with pool(env) as ranks:
        results = ranks.run(
            _recover_next_to_update_group, checkpoint, str(tmp_path / "fileroot"), True
        )
    for rank, out in enumerate(results):
        assert not out["after_recover"] and out["trigger"] == "pre_first_step"
        names = [e["event"] for e in events(str(log)) if e["rank"] == rank]
        # AReaL 1.0.4: RecoverHandler.load pushes the weights, then the trainer offloads
        assert names.index("update_weights") < names.index("rollout.offload")
        assert names.index("rollout.offload") < names.index("pre_first_step")
        print(f"rank {rank}: AReaL forward_batch after the warmup: {out['forward']}")
    assert results[0]["received"] == [0.0, 1.0, 2.0, 3.0]
