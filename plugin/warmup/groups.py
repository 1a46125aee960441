"""Which process groups a Megatron-core train step uses, and which operations it issues on each.

The groups come from ``megatron.core.parallel_state`` getters only, never from
``torch.distributed``'s process-group registry: the registry also holds groups
shared with other programs (AReaL's weight-update group spans the SGLang
workers), and a collective on one of those waits forever.

:data:`TABLE` is the contract: one row per getter, with the operations the
step issues there and why. Read against megatron-core 0.16: ``tensor_parallel``
(mappings, layers, cross entropy), ``distributed`` (DDP buckets,
``finalize_model_grads``), ``optimizer`` (``clip_grads``, the distributed
optimizer), ``transformer/moe/token_dispatcher.py`` and
``pipeline_parallel/p2p_communication.py``; and checked against 0.17.1, 0.18.2
and 0.19.2, where the rows hold unchanged except as each row's ``megatron``
field says. ``_p2p_ops`` is the same in all four. 0.19 adds generalised tensor
parallelism with weight rematerialisation (``gtp_weight_remat_size``); with it
at its default of 1 its groups are the data-parallel ones the table names, and
with more :func:`step_groups` refuses (its operations are not in the table).

Groups of one rank count too where the step calls collectives on them without
a size check (DDP's gradient sync, the grad norm, vocab-parallel cross
entropy): NCCL creates a communicator for each, about 390 MiB of device memory
with NCCL 2.28 (measured on an H200), inside the first step if nothing did
before.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
PIPELINE_P2P = "pipeline_p2p"
"""Send/recv between adjacent pipeline stages, as ``p2p_communication`` issues it."""
RING_P2P = "ring_p2p"
"""Send to the next, receive from the previous rank of a ring (context-parallel attention)."""


@dataclass(frozen=True, slots=True)
class Op:
    kind: str
    """One of the operation names above."""
    scalar: bool = False
    """The step only moves a few scalars here: warm the smallest message size only
    (a large message would connect buffers the step never uses)."""
    when: str | None = None
    """A condition (a key of :data:`MODEL_CONDITIONS` or :data:`DDP_CONDITIONS`); ``None``: always."""


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    """The group's name in reports."""
    getter: str
    """The ``parallel_state`` function returning this rank's group."""
    kwargs: tuple[tuple[str, Any], ...]
    """Arguments of the getter."""
    ops: tuple[Op, ...]
    """What the step issues on the group, in the order warmed."""
    why: str
    """Who issues them."""
    present: str | None = None
    """A ``parallel_state`` predicate that must hold for the getter to have a group."""
    when: str | None = None
    """A condition for the whole row (``"moe"``: expert groups, which Megatron
    builds for dense models too)."""
    at_size_one: bool = False
    """The step issues these operations even when the group has one rank (Megatron
    has no size check there), and NCCL creates a communicator for it: about
    390 MiB of device memory each with NCCL 2.28 on an H200, measured. Warmed
    with one small message per operation (a single rank has nothing to connect)."""
    megatron: str = ">=0.16"
    """The tested megatron-core releases whose ``parallel_state`` has this getter with
    these arguments (a version specifier, checked by the tests on each release CI
    runs). On any release, a row whose getter or arguments are missing is skipped."""


_GRADS = (
    Op(ALL_REDUCE, when="no_distributed_optimizer"),
    Op(REDUCE_SCATTER, when="distributed_optimizer"),
    Op(ALL_GATHER, when="distributed_optimizer"),
)

TABLE: tuple[Row, ...] = (
    Row("tp", "get_tensor_model_parallel_group", (),
        (Op(ALL_REDUCE), Op(ALL_GATHER, when="sequence_parallel"),
         Op(REDUCE_SCATTER, when="sequence_parallel")),
        "row-parallel linear outputs and vocab-parallel cross entropy / log-probs "
        "all-reduce (the latter also at size 1); sequence parallel all-gathers and "
        "reduce-scatters activations", at_size_one=True),
    Row("cp", "get_context_parallel_group", (),
        (Op(ALL_REDUCE), Op(RING_P2P, when="cp_p2p"), Op(ALL_GATHER, when="cp_all_gather"),
         Op(ALL_TO_ALL, when="cp_a2a")),
        "context-parallel attention exchanges K/V by cp_comm_type (ring send/recv, "
        "all-gather or all-to-all); losses are all-reduced over it"),
    Row("dp_cp", "get_data_parallel_group", (("with_context_parallel", True),), _GRADS,
        "DDP all-reduces gradients, or with the distributed optimizer reduce-scatters "
        "gradients and all-gathers parameters (also at size 1)", at_size_one=True),
    Row("intra_dp_cp", "get_data_parallel_group",
        (("with_context_parallel", True), ("partial_data_parallel", True)), _GRADS,
        "the same, within one distributed-optimizer instance (the dp_cp group itself "
        "unless num_distributed_optimizer_instances > 1)", at_size_one=True),
    Row("dp_cp_ag", "get_data_parallel_group",
        (("with_context_parallel", True), ("independent_all_gather", True)), (Op(ALL_GATHER),),
        "parameter all-gather on its own communicator, when Megatron made one (from 0.18 "
        "Megatron-FSDP's, made by create_all_gather_groups and kept out of parallel_state)",
        present="has_separate_all_gather_group", megatron=">=0.16,<0.18"),
    Row("dp", "get_data_parallel_group", (), (Op(ALL_REDUCE, scalar=True),),
        "hosts (verl, AReaL) average losses and metrics over data parallel"),
    Row("pp", "get_pipeline_model_parallel_group", (), (Op(ALL_REDUCE), Op(PIPELINE_P2P)),
        "activations forward and gradients backward between stages; losses and token "
        "counts are broadcast or all-reduced from the last stage"),
    Row("embedding", "get_embedding_group", (), (Op(ALL_REDUCE),),
        "finalize_model_grads all-reduces the tied word-embedding gradient between the "
        "first and the last stage"),
    Row("position_embedding", "get_position_embedding_group", (), (Op(ALL_REDUCE),),
        "finalize_model_grads all-reduces learned position-embedding gradients"),
    Row("ep", "get_expert_model_parallel_group", (), (Op(ALL_TO_ALL, when="moe_all_to_all"),),
        "the all-to-all token dispatcher sends tokens to the ranks holding their experts",
        when="moe"),
    Row("expert_tp", "get_expert_tensor_parallel_group", (), (Op(ALL_GATHER), Op(REDUCE_SCATTER)),
        "the all-to-all dispatcher gathers tokens within expert tensor parallel and "
        "reduce-scatters the expert outputs", when="moe"),
    Row("tp_ep", "get_expert_tensor_and_model_parallel_group", (),
        (Op(ALL_GATHER), Op(REDUCE_SCATTER)),
        "the all-gather dispatcher gathers tokens and routing maps and reduce-scatters "
        "outputs; the all-to-all dispatcher all-gathers tokens-per-expert counts", when="moe"),
    Row("expert_dp", "get_expert_data_parallel_group", (), _GRADS,
        "expert gradients: DDP all-reduce, or the distributed optimizer's reduce-scatter "
        "and parameter all-gather (the reduce-scatter AReaL PR #1548 left cold)", when="moe",
        at_size_one=True),
    Row("intra_expert_dp", "get_expert_data_parallel_group",
        (("partial_expert_data_parallel", True),), _GRADS,
        "the same, within one distributed-optimizer instance", when="moe", at_size_one=True),
    Row("mp", "get_model_parallel_group", (),
        (Op(ALL_REDUCE, scalar=True, when="no_distributed_optimizer"),),
        "grad norm (clip_grads) without the distributed optimizer, also at size 1",
        at_size_one=True),
    Row("expert_tp_pp", "get_expert_tensor_model_pipeline_parallel_group", (),
        (Op(ALL_REDUCE, scalar=True, when="no_distributed_optimizer"),),
        "the same for the expert parameters' optimizer", when="moe", at_size_one=True),
    Row("dist_opt", "get_intra_distributed_optimizer_instance_group", (),
        (Op(ALL_REDUCE, scalar=True, when="distributed_optimizer"),),
        "grad norm (clip_grads) with the distributed optimizer, also at size 1",
        at_size_one=True),
    Row("inter_dist_opt", "get_inter_distributed_optimizer_instance_group", (), (Op(ALL_REDUCE),),
        "gradients all-reduced across distributed-optimizer instances (when more than one)"),
)  # fmt: skip


def _cp_comm_types(config: Any) -> set[str]:
    kind = getattr(config, "cp_comm_type", None) or "p2p"
    return set(kind) if isinstance(kind, (list, tuple)) else {kind}


MODEL_CONDITIONS: dict[str, Callable[[Any], bool]] = {
    "moe": lambda config: bool(config.num_moe_experts),
    "sequence_parallel": lambda config: bool(config.sequence_parallel),
    "moe_all_to_all": lambda config: config.moe_token_dispatcher_type != "allgather",
    "cp_p2p": lambda config: bool(_cp_comm_types(config) & {"p2p", "a2a+p2p"}),
    "cp_all_gather": lambda config: "all_gather" in _cp_comm_types(config),
    "cp_a2a": lambda config: bool(_cp_comm_types(config) & {"a2a", "a2a+p2p"}),
}
"""Conditions on the model's ``TransformerConfig``; with none given, every one holds."""

DDP_CONDITIONS: dict[str, Callable[[Any], bool]] = {
    "distributed_optimizer": lambda ddp: bool(ddp.use_distributed_optimizer),
    "no_distributed_optimizer": lambda ddp: not ddp.use_distributed_optimizer,
}
"""Conditions on Megatron's ``DistributedDataParallelConfig``; with none given (the
hosts hand over unwrapped models), every one holds: both optimizers' operations
are warmed."""


@dataclass(frozen=True, slots=True)
class WarmGroup:
    """One process group to warm on this rank."""

    name: str
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    """Global ranks, in group-rank order."""
    ops: tuple[Op, ...]


def step_groups(
    parallel_state: ModuleType, model_config: Any = None, ddp_config: Any = None
) -> list[WarmGroup]:
    """The groups of :data:`TABLE` this rank belongs to, deduplicated, in the global order.

    A group object reached through several getters is warmed once, under the
    first row's name, with the union of the rows' operations (two objects over
    the same ranks are distinct communicators and are both warmed). Groups of
    size 1 (unless the row is ``at_size_one``) and getters the installed
    Megatron-core lacks are skipped.

    The order is by the group's sorted global ranks, then by table row: every
    member computes the same key for a group, so the ranks never wait on each
    other in a cycle.
    """
    import torch.distributed as dist

    _refuse_weight_remat(parallel_state)
    rank = dist.get_rank()
    found: dict[int, tuple[int, str, Any, list[Op]]] = {}
    for index, row in enumerate(TABLE):
        if not _holds(row.when, model_config, ddp_config):
            continue
        group = _get(parallel_state, row)
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        if isinstance(group, list):
            raise ValueError(
                f"comm_warmup: parallel_state.{row.getter}() returned {len(group)} groups "
                "(an encoder-decoder pipeline); comm_warmup supports decoder-only pipelines. "
                "Block it with MEGASTART_BLOCKLIST=comm_warmup."
            )
        ops = [op for op in row.ops if _holds(op.when, model_config, ddp_config)]
        if (group.size() < 2 and not row.at_size_one) or not ops:
            continue
        if id(group) in found:
            merged = found[id(group)][3]
            merged.extend(op for op in ops if op not in merged)
        else:
            found[id(group)] = (index, row.name, group, ops)
    groups = []
    for index, name, group, ops in found.values():
        ranks = tuple(dist.get_process_group_ranks(group))
        if rank not in ranks:
            raise ValueError(
                f"comm_warmup: parallel_state's {name} group {ranks} does not contain rank {rank}"
            )
        groups.append((tuple(sorted(ranks)), index, WarmGroup(name, group, ranks, tuple(ops))))
    return [warm for *_, warm in sorted(groups, key=lambda item: item[:2])]


def _refuse_weight_remat(parallel_state: ModuleType) -> None:
    """megatron-core 0.19's weight rematerialisation (GTP) above size 1 adds groups and
    operations the table does not have; warming only the others would leave them cold."""
    for getter in ("get_gtp_weight_remat_world_size", "get_expert_gtp_weight_remat_world_size"):
        size = getattr(parallel_state, getter, lambda: 1)()
        if size > 1:
            raise ValueError(
                f"comm_warmup: parallel_state.{getter}() is {size}; comm_warmup does not "
                "know the operations of megatron-core's weight rematerialisation (GTP). "
                "Block it with MEGASTART_BLOCKLIST=comm_warmup."
            )


def _holds(condition: str | None, model_config: Any, ddp_config: Any) -> bool:
    if condition in MODEL_CONDITIONS:
        return model_config is None or MODEL_CONDITIONS[condition](model_config)
    if condition in DDP_CONDITIONS:
        return ddp_config is None or DDP_CONDITIONS[condition](ddp_config)
    if condition is None:
        return True
    raise KeyError(f"comm_warmup: the table names an unknown condition {condition!r}")


def _get(parallel_state: ModuleType, row: Row) -> Any:
    """The row's group, or ``None`` where this Megatron-core has no such group."""
    getter = getattr(parallel_state, row.getter, None)
    if getter is None:
        return None
    if row.present is not None and not getattr(parallel_state, row.present, lambda: False)():
        return None
    kwargs = dict(row.kwargs)
    parameters = inspect.signature(getter).parameters
    if any(name not in parameters for name in kwargs):
        return None  # a variant (partial DP, separate all-gather) this version lacks
    if "check_initialized" in parameters:
        kwargs["check_initialized"] = False  # optional groups (embedding, ...) are None
    return getter(**kwargs)
