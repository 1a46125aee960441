"""comm_warmup on real Megatron parallel state over gloo: every rank warms exactly the
(group, operation) pairs the train step uses, in both message sizes, and nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from megastart.harness.launch import RankPool

SMALL, LARGE = 4096, 65536
SETTINGS = {"timeout_s": 30.0, "message_bytes": (SMALL, LARGE)}


def both(*kinds: str) -> set[str]:
    return {f"{kind}:{n}" for kind in kinds for n in (SMALL, LARGE)}


def small(*kinds: str) -> set[str]:
    return {f"{kind}:{SMALL}" for kind in kinds}


def on(group: str, ops: set[str]) -> set[tuple[str, str]]:
    return {(group, op) for op in ops}


# Megatron's pipeline p2p (p2p_communication._p2p_ops), unbatched, per stage. At
# pipeline size 2 the odd stage sends (and the even stage receives) over WORLD.
UNBATCHED_PP2 = {
    0: on("pp", both("send_next")) | on("world", both("recv_next")),
    1: on("pp", both("recv_prev")) | on("world", both("send_prev")),
}
FIRST, MIDDLE, LAST = ("send_next", "recv_next"), ("send_next", "recv_next", "recv_prev", "send_prev"), ("recv_prev", "send_prev")  # fmt: skip
UNBATCHED_PP4 = {0: on("pp", both(*FIRST)), 1: on("pp", both(*MIDDLE)), 2: on("pp", both(*MIDDLE)), 3: on("pp", both(*LAST))}  # fmt: skip
BATCHED_PP4 = {
    0: on("pp", both("batch_send_recv_next")),
    1: on("pp", both("batch_send_recv_next", "batch_send_recv_prev")),
    2: on("pp", both("batch_send_recv_next", "batch_send_recv_prev")),
    3: on("pp", both("batch_send_recv_prev")),
}
# No DDP config given: both the plain DDP all-reduce and the distributed
# optimizer's reduce-scatter / all-gather, and both grad-norm groups (mp, dist_opt).
GRADS = both("all_reduce", "reduce_scatter", "all_gather")
# One-rank groups the step still calls collectives on (Megatron has no size check
# there; NCCL spends ~390 MiB creating each): one small message per operation.
ONE_RANK_GRADS = small("all_reduce", "reduce_scatter", "all_gather")

LAYOUTS: dict[str, dict[str, Any]] = {
    # world 4, ranks = tp + 2 * stage: tp (0,1) (2,3); pp and embedding (0,2) (1,3)
    "tp2_pp2": {
        "world": 4,
        "parallel": {"tp": 2, "pp": 2},
        "config": {"sequence_parallel": True, "batch_p2p_comm": False},
        "expected": {
            r: on("tp", both("all_reduce", "all_gather", "reduce_scatter"))
            | on("pp", both("all_reduce"))
            | UNBATCHED_PP2[r // 2]
            | on("dp_cp", ONE_RANK_GRADS)
            | on("embedding", both("all_reduce"))
            | on("mp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(4)
        },
    },
    # pipeline size 2, unbatched (one direction over WORLD) plus the batched shape
    # exchange that variable sequence lengths add
    "pp2": {
        "world": 2,
        "parallel": {"pp": 2},
        "config": {
            "batch_p2p_comm": False,
            "variable_seq_lengths": True,
            "moe_token_dispatcher_type": "alltoall",  # Megatron requires it with variable lengths
        },
        "expected": {
            r: on("pp", both("all_reduce"))
            | UNBATCHED_PP2[r]
            | on("pp", small("batch_send_recv_next" if r == 0 else "batch_send_recv_prev"))
            | on("tp", small("all_reduce"))
            | on("dp_cp", ONE_RANK_GRADS)
            | on("embedding", both("all_reduce"))
            | on("mp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(2)
        },
    },
    # no model config: every variant (unbatched and batched p2p, expert groups)
    "pp4_no_config": {
        "world": 4,
        "parallel": {"pp": 4},
        "config": None,
        "expected": {
            r: on("pp", both("all_reduce"))
            | UNBATCHED_PP4[r]
            | BATCHED_PP4[r]
            | (on("embedding", both("all_reduce")) if r in (0, 3) else set())
            | on("tp", small("all_reduce", "all_gather", "reduce_scatter"))
            | on("dp_cp", ONE_RANK_GRADS)
            | on("expert_dp", ONE_RANK_GRADS)
            | on("mp", small("all_reduce"))
            | on("expert_tp_pp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(4)
        },
    },
    # interleaved schedule: the last stage also sends to the first (a third phase)
    "pp4_vpp2": {
        "world": 4,
        "parallel": {"pp": 4, "vpp": 2},
        "config": {"batch_p2p_comm": False},
        "expected": {
            r: on("pp", both("all_reduce", *MIDDLE))
            | (on("embedding", both("all_reduce")) if r in (0, 3) else set())
            | on("tp", small("all_reduce"))
            | on("dp_cp", ONE_RANK_GRADS)
            | on("mp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(4)
        },
    },
    # tp (0,1) (2,3); dp and dp_cp (0,2) (1,3): two communicators over the same ranks
    "dp2_tp2": {
        "world": 4,
        "parallel": {"tp": 2},
        "config": {"sequence_parallel": False},
        "expected": {
            r: on("tp", both("all_reduce"))
            | on("dp_cp", GRADS)
            | on("dp", small("all_reduce"))
            | on("mp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(4)
        },
    },
    # the same with Megatron's distributed optimizer: gradients reduce-scattered,
    # parameters all-gathered, grad norm over the optimizer-instance group only
    "dp2_tp2_distributed_optimizer": {
        "world": 4,
        "parallel": {"tp": 2},
        "config": {"sequence_parallel": False},
        "distributed_optimizer": True,
        "expected": {
            r: on("tp", both("all_reduce"))
            | on("dp_cp", both("reduce_scatter", "all_gather"))
            | on("dp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(4)
        },
    },
    # ep, tp_ep and expert_tp_pp (0,1) (2,3); expert_dp (0,2) (1,3); dp 4
    "ep2_expert_dp2": {
        "world": 4,
        "parallel": {"ep": 2},
        "config": {"num_moe_experts": 4, "moe_token_dispatcher_type": "alltoall"},
        "expected": {
            r: on("dp_cp", GRADS)
            | on("dp", small("all_reduce"))
            | on("tp", small("all_reduce"))
            | on("mp", small("all_reduce"))
            | on("ep", both("all_to_all"))
            | on("tp_ep", both("all_gather", "reduce_scatter"))
            | on("expert_dp", GRADS)
            | on("expert_tp_pp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(4)
        },
    },
    # the ring of two: each rank sends to its next and receives from its previous
    "cp2": {
        "world": 2,
        "parallel": {"cp": 2},
        "config": {"context_parallel_size": 2},
        "expected": {
            r: on("cp", both("all_reduce", "batch_send_next", "batch_recv_prev"))
            | on("dp_cp", GRADS)
            | on("tp", small("all_reduce"))
            | on("mp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(2)
        },
    },
    # world 6, odd pipeline, interleaved: pp (0,2,4) (1,3,5); the wrap link 4 -> 0
    # shares stage 0 with link 0 -> 2, so it runs in a phase of its own
    "tp2_pp3_vpp2": {
        "world": 6,
        "parallel": {"tp": 2, "pp": 3, "vpp": 2},
        "config": {"batch_p2p_comm": False},
        "expected": {
            r: on("tp", both("all_reduce"))
            | on("pp", both("all_reduce", *MIDDLE))
            | (on("embedding", both("all_reduce")) if r // 2 in (0, 2) else set())
            | on("dp_cp", ONE_RANK_GRADS)
            | on("mp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(6)
        },
    },
    # world 6: tp (0,1,2) (3,4,5) with sizes that must divide by 3; pp (0,3) (1,4)
    # (2,5), three pairs over WORLD at once
    "tp3_pp2": {
        "world": 6,
        "parallel": {"tp": 3, "pp": 2},
        "config": {"sequence_parallel": True, "batch_p2p_comm": False},
        "expected": {
            r: on("tp", both("all_reduce", "all_gather", "reduce_scatter"))
            | on("pp", both("all_reduce"))
            | UNBATCHED_PP2[r // 3]
            | on("dp_cp", ONE_RANK_GRADS)
            | on("embedding", both("all_reduce"))
            | on("mp", small("all_reduce"))
            | on("dist_opt", small("all_reduce"))
            for r in range(6)
        },
    },
}


def model_config(parallel: dict[str, int], overrides: dict[str, Any]) -> Any:
    import torch
    from megatron.core.transformer import TransformerConfig

    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    return TransformerConfig(
        num_layers=2 * pp,
        hidden_size=96,
        num_attention_heads=6,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=parallel.get("ep", 1),
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        **overrides,
    )


def warm_layout(
    parallel: dict[str, int], config: dict[str, Any] | None, distributed_optimizer: bool | None
) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig

    from megastart.harness.cpu import destroy_megatron, initialize_megatron
    from megastart.warmup.api import reset_state, warmup_communicators
    from megastart.warmup.settings import CommWarmupSettings

    initialize_megatron(**parallel)
    try:
        report = warmup_communicators(
            settings=CommWarmupSettings(**SETTINGS),
            model_config=None if config is None else model_config(parallel, config),
            ddp_config=None
            if distributed_optimizer is None
            else DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer),
        )
        return {
            "rank": dist.get_rank(),
            "operations": list(report.operations),
            "groups": list(report.groups),
            "gpu_free": (report.gpu_free_before, report.gpu_free_after),
        }
    finally:
        reset_state()
        destroy_megatron()


@pytest.fixture(scope="module")
def pools() -> Any:
    opened: dict[int, RankPool] = {}

    def pool(world: int) -> RankPool:
        if world not in opened or not opened[world].alive:
            opened[world] = RankPool(world, timeout_s=300)
        return opened[world]

    yield pool
    for pool_ in opened.values():
        pool_.close()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_warms_exactly_the_step_groups_and_operations(pools: Any, layout: str) -> None:
    spec = LAYOUTS[layout]
    results = pools(spec["world"]).run(
        warm_layout, spec["parallel"], spec["config"], spec.get("distributed_optimizer")
    )
    for result in results:
        rank, operations = result["rank"], result["operations"]
        assert len(operations) == len(set(operations)), f"rank {rank} repeated an operation"
        assert set(operations) == spec["expected"][rank], f"rank {rank}"
        assert result["gpu_free"] == (None, None)  # CPU: no GPU reading


def test_the_table_says_which_getters_the_installed_megatron_has() -> None:
    """Every row whose ``megatron`` range holds the installed megatron-core finds its
    getter with its arguments there, and no other row does."""
    import inspect
    from importlib import metadata

    from megatron.core import parallel_state
    from packaging.specifiers import SpecifierSet

    from megastart.warmup.groups import TABLE

    installed = metadata.version("megatron-core")

    def has(row: Any) -> bool:
        getter = getattr(parallel_state, row.getter, None)
        if getter is None:
            return False
        parameters = inspect.signature(getter).parameters
        present = row.present is None or hasattr(parallel_state, row.present)
        return present and all(name in parameters for name, _ in row.kwargs)

    wrong = [
        (row.name, row.megatron)
        for row in TABLE
        if has(row) != SpecifierSet(row.megatron).contains(installed)
    ]
    assert wrong == [], f"megatron-core {installed}"


def groups_with_weight_remat() -> str:
    from megatron.core import parallel_state

    from megastart.warmup.groups import step_groups

    parallel_state.initialize_model_parallel(gtp_remat_size=2)
    try:
        step_groups(parallel_state)
    except ValueError as e:
        return str(e)
    finally:
        parallel_state.destroy_model_parallel()
    return "no error"


def megatron_has_weight_remat() -> bool:
    from megatron.core import parallel_state

    return hasattr(parallel_state, "get_gtp_weight_remat_world_size")


@pytest.mark.skipif(
    not megatron_has_weight_remat(), reason="weight rematerialisation is new in megatron-core 0.19"
)
def test_weight_rematerialisation_is_refused_with_the_group_size(pools: Any) -> None:
    for message in pools(2).run(groups_with_weight_remat):
        assert "parallel_state.get_gtp_weight_remat_world_size() is 2" in message
        assert "MEGASTART_BLOCKLIST=comm_warmup" in message
