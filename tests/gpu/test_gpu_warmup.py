"""The warmup on one GPU over NCCL, as a host runs it before the first step: every group has
one rank, so it warms only the groups Megatron's step still issues collectives on at size one
(NCCL makes a communicator for each), each with one small message; it refuses to run inside a
CUDA graph capture (its collectives would be recorded into the graph, not run); and a
training step of the loaded Transformer Engine model follows it."""

from __future__ import annotations

from typing import Any

from support.gpu_ranks import warmup_then_train

from megastart.harness.launch import RankPool
from megastart.warmup.groups import TABLE
from megastart.warmup.settings import CommWarmupSettings


def test_warmup_on_one_gpu_warms_size_one_groups_only_refuses_capture_and_a_step_follows(
    nccl: RankPool, checkpoint: Any
) -> None:
    (got,) = nccl.run(warmup_then_train, checkpoint("qwen3_moe"), "cuda")
    print(f"GPU-RESULT warmup: {got}")
    at_size_one = {row.name for row in TABLE if row.at_size_one}
    smallest = min(CommWarmupSettings().message_bytes)
    assert {group for group, _ in got["operations"]} <= at_size_one, got["operations"]
    assert all(op.endswith(f":{smallest}") for _, op in got["operations"]), got["operations"]
    assert got["refused_in_capture"] and "CUDA graph capture" in got["refused_in_capture"]
    assert got["grads"] > 0 and got["grads_finite"]
    # an expert no token was routed to has no gradient; every other parameter has one (in
    # bf16 an SGD step too small for a weight's precision leaves it as it was: some move)
    assert all(".mlp.experts." in n for n in got["without_grad"]), got["without_grad"]
    assert got["changed"] > 0, "the step changed no parameter"
