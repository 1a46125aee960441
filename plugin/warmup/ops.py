"""The warmup's steps: one operation, on one group, in one message size, with a bounded wait.

:func:`plan` turns the groups of :mod:`megastart.warmup.groups` into the list
of steps this rank performs, in the order every rank agrees on; :func:`perform`
runs them. Buffers are allocated when a step runs and freed after it, so the
plan holds no memory.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from megastart.warmup import p2p
from megastart.warmup.groups import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    PIPELINE_P2P,
    REDUCE_SCATTER,
    RING_P2P,
    WarmGroup,
)
from megastart.warmup.step import Step, buffer

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def plan(
    groups: Sequence[WarmGroup],
    *,
    message_bytes: Sequence[int],
    model_config: Any,
    parallel_state: ModuleType,
) -> list[Step]:
    """This rank's steps: per group (in the given order) each operation, in each size."""
    sizes = sorted(set(message_bytes))
    steps: list[Step] = []
    for warm in groups:
        device = _device(warm.group)
        planned: set[str] = set()  # an operation may come from two rows (scalar or not)
        for op in warm.ops:
            one_size = op.scalar or len(warm.ranks) == 1  # one rank: nothing to connect
            for nbytes in sizes[:1] if one_size else sizes:
                label = f"{op.kind}:{nbytes}"
                if label in planned:
                    continue
                planned.add(label)
                if op.kind == PIPELINE_P2P:
                    steps += p2p.pipeline_steps(
                        warm,
                        nbytes,
                        device,
                        model_config=model_config,
                        wrap=_interleaved(parallel_state),
                        smallest=nbytes == sizes[0],
                    )
                elif op.kind == RING_P2P:
                    steps += p2p.ring_steps(warm, nbytes, device)
                else:
                    steps.append(
                        Step(
                            warm.name, label, warm.ranks, _collective(op.kind, warm, nbytes, device)
                        )
                    )
    return steps


def perform(steps: Sequence[Step], *, timeout_s: float) -> list[tuple[str, str]]:
    """Run the steps in order, each bounded by ``timeout_s``; the (group, operation) pairs done."""
    timeout = datetime.timedelta(seconds=timeout_s)
    done = []
    for step in steps:
        try:
            for work in step.start():
                if not work.wait(timeout):
                    raise TimeoutError(f"did not complete within {timeout_s:g} s")
        except Exception as e:
            raise RuntimeError(
                f"comm_warmup: {step.op} on group {step.group} (global ranks {list(step.ranks)}) "
                f"failed: {type(e).__name__}: {e}"
            ) from e
        done.append((step.group, step.op))
    return done


def _collective(
    kind: str, warm: WarmGroup, nbytes: int, device: torch.device
) -> Callable[[], list[dist.Work]]:
    import torch.distributed as dist

    size, group = len(warm.ranks), warm.group
    # torch >= 2.10 names the single-tensor collectives *_single; the NCCL kernels
    # are the ones Megatron's all_gather_into_tensor / reduce_scatter_tensor issue.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def start() -> list[dist.Work]:
        whole = buffer(nbytes, size, device)
        if kind == ALL_REDUCE:
            return [dist.all_reduce(whole, group=group, async_op=True)]
        if kind == ALL_TO_ALL:
            return [dist.all_to_all_single(whole.clone(), whole, group=group, async_op=True)]
        part = whole[: whole.numel() // size].clone()
        if kind == ALL_GATHER:
            return [all_gather(whole, part, group=group, async_op=True)]
        if kind == REDUCE_SCATTER:
            return [reduce_scatter(part, whole, group=group, async_op=True)]
        raise ValueError(f"comm_warmup: unknown collective {kind!r}")

    return start


def _device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's tensors live: the current CUDA device for NCCL groups, else CPU."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _interleaved(parallel_state: ModuleType) -> bool:
    """Whether the virtual pipeline (interleaved schedule) sends from the last stage to the first."""
    size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return size is not None and size > 1
