"""``warmup_communicators``: connect the train step's communicators now, while memory is light.

Collective over the training ranks (WORLD). The ranks first check in over a
gloo group of megastart's own, bounded by ``timeout_s``: a rank that never
arrives makes the others raise instead of waiting in a communicator's
creation. Then each rank plans its steps (:mod:`~megastart.warmup.groups`,
:mod:`~megastart.warmup.ops`), and all agree that every rank could; then they
run the steps, each bounded by ``timeout_s``, and agree again. A failure on any
rank is raised on every rank (:func:`megastart.distributed.all_or_none`).

A failed warmup leaves communicators half-connected, so a second call in the
same process (a host retrying its RPC) is refused by the process's one latch
(:data:`megastart.distributed.sticky.LATCH`) instead of issuing collectives that
the other ranks will never match. The hooks warm once per Megatron world: after
``destroy_model_parallel`` the new world's groups are cold, and are warmed again.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING, Any

from megastart.distributed.sticky import LATCH
from megastart.distributed.world import OncePerWorld, capturing_cuda_graph
from megastart.records import WarmupReport
from megastart.warmup.settings import CommWarmupSettings

if TYPE_CHECKING:
    from megastart.distributed import Control
    from megastart.records import EngineContext

log = logging.getLogger("megastart")

API_TRIGGER = "warmup_communicators"
_WHEN = {"post_recover_load": "post_recover", "pre_first_step": "first_step"}

PLUGIN = "comm_warmup"

_report: WarmupReport | None = None
"""This process's last successful warmup."""
_warmed = OncePerWorld()
"""Whether the hooks warmed this Megatron world."""


def warmup_communicators(
    *,
    settings: CommWarmupSettings | None = None,
    model_config: Any = None,
    ddp_config: Any = None,
    parallel_state: ModuleType | None = None,
    trigger: str = API_TRIGGER,
) -> WarmupReport:
    """Connect every communicator the Megatron train step uses, in every message-size class.

    Call on every training rank together, after Megatron's parallel state is
    initialised.

    :param settings: the ``comm_warmup`` settings (default: this process's
        resolved settings).
    :param model_config: the model's ``TransformerConfig``: selects the operations
        that depend on it (sequence parallel, batched pipeline p2p, MoE
        dispatcher, context-parallel exchange). ``None`` warms every variant.
    :param ddp_config: Megatron's ``DistributedDataParallelConfig``: with the
        distributed optimizer, gradients are reduce-scattered and the grad norm
        reduced over the optimizer-instance group; without, all-reduced and over
        the model-parallel group. ``None`` warms both (each extra communicator
        costs device memory).
    :param parallel_state: the ``megatron.core.parallel_state`` module in use.
    :param trigger: what ran it, for the report.
    :raises megastart.distributed.CollectiveError: on every rank, if any rank
        failed or did not arrive within ``timeout_s``.
    :raises megastart.distributed.FailedBefore: at once, when a warmup (or another
        collective of megastart's) already failed in this process.
    :raises RuntimeError: when called inside a CUDA graph capture, touching nothing.
    """
    global _report
    _refuse_inside_graph_capture()
    with LATCH.guard(PLUGIN):
        settings = settings if settings is not None else _settings()
        if parallel_state is None:
            parallel_state = import_module("megatron.core.parallel_state")
        _report = _warmup(settings, model_config, ddp_config, parallel_state, trigger)
        _warmed.mark()
    return _report


def _refuse_inside_graph_capture() -> None:
    """A collective issued while a CUDA graph is being captured is recorded into the graph, not
    run, or breaks the capture: the warmup belongs before the step is captured."""
    if capturing_cuda_graph():
        raise RuntimeError(
            "comm_warmup: called inside a CUDA graph capture (the current stream is capturing): "
            "its collectives would be recorded into the graph instead of connecting the "
            "communicators; call warmup_communicators before the train step is captured"
        )


def warmup_for_engine(engine: EngineContext, trigger: str) -> WarmupReport | None:
    """The ``comm_warmup`` hooks: warm once per process and Megatron world, at the hook
    ``when`` selects.

    :param trigger: ``"post_recover_load"`` or ``"pre_first_step"``.
    :returns: the report, or ``None`` when this hook is not the one to run it or
        the warmup already ran in this world.
    """
    settings = _settings(engine)
    if settings.when != "both" and settings.when != _WHEN[trigger]:
        return None
    if _warmed.done:
        return None
    first = engine.model_chunks[0] if engine.model_chunks else None
    return warmup_communicators(
        settings=settings,
        model_config=getattr(first, "config", None),
        ddp_config=engine.ddp_config,
        parallel_state=engine.parallel_state,
        trigger=trigger,
    )


def last_report() -> WarmupReport | None:
    """This process's successful warmup, for hosts that show what it did (``None``: none yet)."""
    return _report


def reset_state() -> None:
    """Forget this process's warmup, success or failure (the process's latch too).

    Only for a process that destroyed its process groups and built new ones
    (tests, demos): the new groups are cold again.
    """
    global _report
    _report = None
    _warmed.clear()
    LATCH.reset()


def _warmup(
    settings: CommWarmupSettings,
    model_config: Any,
    ddp_config: Any,
    parallel_state: ModuleType,
    trigger: str,
) -> WarmupReport:
    import torch.distributed as dist

    from megastart.distributed import (
        Board,
        CollectiveError,
        all_or_none,
        discarding_control,
        kept_control,
    )
    from megastart.warmup import groups, ops

    timeout_s = settings.timeout_s
    start = time.perf_counter()
    board = Board("comm_warmup")
    try:  # through the store: a rank that never comes is named, and no group is made
        board.check_in(timeout_s)
    except CollectiveError as e:
        raise CollectiveError(
            f"comm_warmup: rank {dist.get_rank()}: the training ranks did not all start the "
            f"warmup within timeout_s={timeout_s:g} s (a rank died, hung, or does not run it); "
            f"no communicator was touched: {e}"
        ) from e
    with discarding_control():  # the loader's, kept for the process: the warmup makes none
        with board.announcing():  # a rank that cannot make or agree stops the others now
            control = kept_control(timeout_s=timeout_s)
            _check_same_settings(settings, control)
        phase = partial(all_or_none, timeout_s=timeout_s, control=control, board=board)
        with phase("comm_warmup: plan"):
            warm = groups.step_groups(parallel_state, model_config, ddp_config)
            steps = ops.plan(
                warm,
                message_bytes=settings.message_bytes,
                model_config=model_config,
                parallel_state=parallel_state,
            )
        free_before = _gpu_free_bytes()
        with phase("comm_warmup: run"):
            done = ops.perform(steps, timeout_s=timeout_s)
        free_after = _gpu_free_bytes()
    report = WarmupReport(
        trigger=trigger,
        groups=tuple(dict.fromkeys(group for group, _ in done)),
        operations=tuple(done),
        seconds=time.perf_counter() - start,
        gpu_free_before=free_before,
        gpu_free_after=free_after,
    )
    if dist.get_rank() == 0:
        log.info("megastart: %s", report.summary())
    return report


def _check_same_settings(settings: CommWarmupSettings, control: Control) -> None:
    """Raise on every rank if the ranks' settings differ: their operations would not match."""
    from megastart.distributed import agree

    agree(
        "comm_warmup",
        {"message_bytes": tuple(settings.message_bytes), "timeout_s": settings.timeout_s},
        control=control,
        timeout_s=settings.timeout_s,
        fix="set the MEGASTART_COMM_WARMUP_* variables (or the megastart.comm_warmup config) "
        "the same on every rank",
    )


def _gpu_free_bytes() -> int | None:
    """Free device memory after returning PyTorch's unused cached blocks (``None`` off CUDA).

    Emptying the cache first makes the difference between two readings what
    NCCL allocated, not what PyTorch's allocator happened to hold; it also hands
    NCCL the memory it is about to ``cudaMalloc``.
    """
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def _settings(engine: EngineContext | None = None) -> CommWarmupSettings:
    """The ``comm_warmup`` section of the engine's settings, else of this process's."""
    if engine is not None and engine.settings is not None:
        resolved = engine.settings
    else:
        from megastart.manager import get_settings

        resolved = get_settings()
    section = resolved.sections.get("comm_warmup")
    return section if section is not None else CommWarmupSettings()
