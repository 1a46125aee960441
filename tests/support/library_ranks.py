"""What each rank runs in the library-adapter tests: megastart activated as any host without a
plugin group activates it (``megastart.activation.activate()``, what
``AUTOWRAPT_BOOTSTRAP=megastart.bootstrap`` does at start-up), then Megatron-Bridge,
mbridge and megatron-core called the way NeMo-RL, slime, ROLL and Megatron-LM call them.

:class:`Recorder` is a megastart plugin registered in the rank: it records every hook call
(and, wrapping ``on_model_load``, what the plugins returned), and how many micro-batches the
schedule had run when ``pre_first_step`` was called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import megastart
from support.bridge_ranks import build as bridge_build
from support.bridge_ranks import differences, import_megatron_bridge, poison, state

FORWARD_STEPS: list[int] = []
"""Micro-batches run by :func:`forward_step` in this rank."""


class Recorder:
    """Every hook call of this rank, in order: ``(hook, detail)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    @megastart.hookimpl(wrapper=True)
    def on_model_load(self, engine: Any, checkpoint: str) -> Any:
        report = yield
        self.calls.append(("on_model_load", {"host": engine.host, "report": report is not None}))
        return report

    @megastart.hookimpl
    def post_recover_load(self, engine: Any, checkpoint: str) -> None:
        self.calls.append(
            ("post_recover_load", {"host": engine.host, "restart": engine.is_restart})
        )

    @megastart.hookimpl
    def pre_first_step(self, engine: Any) -> None:
        self.calls.append(
            ("pre_first_step", {"host": engine.host, "steps_before": len(FORWARD_STEPS)})
        )


@contextmanager
def recording() -> Iterator[Recorder]:
    """megastart activated in this rank, with a :class:`Recorder` registered while the block runs."""
    from megastart.activation import activate
    from megastart.manager import get_plugin_manager

    activate()
    recorder = Recorder()
    pm = get_plugin_manager()
    pm.register(recorder)
    FORWARD_STEPS.clear()
    try:
        yield recorder
    finally:
        pm.unregister(recorder)


def attached() -> list[str]:
    """The host modules whose adapters are attached in this rank."""
    from megastart.engines import adapters

    return sorted(name for name, adapter in adapters().items() if adapter.attached)


def theirs_then_ours(
    recorder: Any, chunks: list[Any], load: Callable[[], object]
) -> dict[str, Any]:
    """``load`` into poisoned ``chunks`` once with a host adapter answering above (the library
    loads itself) and once as a script calls it: both states, and the hooks each reached."""
    from megastart.engines.base import answering

    poison(chunks)
    with answering("on_model_load"):
        load()
    theirs, calls_theirs = state(chunks), list(recorder.calls)
    poison(chunks)
    load()
    return {
        "theirs": theirs,
        "ours": state(chunks),
        "calls_theirs": calls_theirs,
        "calls": recorder.calls[len(calls_theirs) :],
        "attached": attached(),
    }


def bridge_load_hf_weights(checkpoint: str, layout: dict[str, int]) -> dict[str, Any]:
    """``AutoBridge.load_hf_weights`` once with megastart answering above (the bridge's own
    load) and once as a script calls it: both states, and the hooks each load reached."""
    from support.loader_ranks import megatron

    with recording() as recorder, megatron(layout):
        import_megatron_bridge()
        bridge, chunks = bridge_build(checkpoint, layout)
        return theirs_then_ours(
            recorder, chunks, lambda: bridge.load_hf_weights(chunks, checkpoint)
        )


def provider_with_load_weights(checkpoint: str, layout: dict[str, int]) -> dict[str, Any]:
    """NeMo-RL's import: ``to_megatron_provider(load_weights=True)`` and
    ``provide_distributed_model``; this rank's state and hook calls, and the state of the
    bridge's own ``load_hf_weights`` of the same model for comparison."""
    from megastart.engines.base import answering
    from support.loader_ranks import megatron

    with recording() as recorder, megatron(layout):
        import_megatron_bridge()
        bridge, chunks = bridge_build(checkpoint, layout)
        poison(chunks)
        with answering("on_model_load"):
            bridge.load_hf_weights(chunks, checkpoint)
        theirs = state(chunks)
        chunks = provide(bridge, layout, load_weights=True)
        return {"theirs": theirs, "ours": state(chunks), "calls": recorder.calls}


def provide(bridge: Any, layout: dict[str, int], *, load_weights: bool) -> list[Any]:
    """The chunks of ``bridge.to_megatron_provider(load_weights)``, set up for the CPU as
    :func:`support.bridge_ranks.build` does."""
    from megastart.harness.model import cpu_block_spec
    from support.bridge_ranks import CPU_OFF

    provider = bridge.to_megatron_provider(load_weights=load_weights)
    provider.transformer_layer_spec = cpu_block_spec
    for fused in CPU_OFF:
        if hasattr(provider, fused):
            setattr(provider, fused, False)
    provider.tensor_model_parallel_size = layout.get("tp", 1)
    provider.pipeline_model_parallel_size = layout.get("pp", 1)
    provider.sequence_parallel = False
    provider.params_dtype = torch.float32
    provider.finalize()
    return provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
    )


def forward_step(data: Iterator[torch.Tensor], model: Any) -> tuple[torch.Tensor, Any]:
    """Megatron's forward-step contract (:func:`megastart.demo.train._forward_step`), counted."""
    from megastart.demo.train import _forward_step

    FORWARD_STEPS.append(1)
    return _forward_step(data, model)


def cached_schedule_steps(checkpoint: str, layout: dict[str, int]) -> dict[str, Any]:
    """A Megatron-LM / ROLL loop: the model in megatron-core's DDP, ``get_forward_backward_func()``
    cached once, a forward-only pass (a log-prob pass) first, then two training passes."""
    from megastart.warmup.api import last_report
    from support.loader_ranks import build, megatron

    with recording() as recorder, megatron(layout):
        before = last_report()
        chunks = build(checkpoint)
        with ddp_schedule(chunks) as run:
            run(forward_only=True)
            run(forward_only=False)
            run(forward_only=False)
        return {
            "calls": recorder.calls,
            "steps": len(FORWARD_STEPS),
            "warmup": warmed_since(before),
            "attached": attached(),
        }


def warmed_since(before: Any) -> str | None:
    """The trigger of this process's warmup if one ran since ``before`` (a report or ``None``)."""
    from megastart.warmup.api import last_report

    report = last_report()
    return None if report is None or report is before else report.trigger


@contextmanager
def ddp_schedule(chunks: list[Any], micro_batches: int = 2) -> Iterator[Any]:
    """``run(forward_only)``: one pass of the schedule ``get_forward_backward_func()``
    returned once, over ``chunks[0]`` in megatron-core's DDP (CPU stand-ins of the demo)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megastart.demo.train import cuda_factories_on_cpu

    config = chunks[0].config
    vocab = chunks[0].vocab_size
    tokens = torch.randint(
        0, vocab, (micro_batches, 1, 17), generator=torch.Generator().manual_seed(0)
    )
    schedule = get_forward_backward_func()
    with cuda_factories_on_cpu():
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), chunks[0])

        def run(*, forward_only: bool) -> Any:
            return schedule(
                forward_step_func=forward_step,
                data_iterator=iter(tokens),
                model=[model],
                num_microbatches=micro_batches,
                seq_length=16,
                micro_batch_size=1,
                forward_only=forward_only,
            )

        yield run


def nemo_rl_sequence(checkpoint: str, saved: str, layout: dict[str, int]) -> dict[str, Any]:
    """NeMo-RL's start in one worker process: the HF checkpoint converted in a first Megatron
    world (``to_megatron_provider(load_weights=True)``, ``provide_distributed_model``, saved
    with ``dist_checkpointing``, as :mod:`megastart.demo.restart` does on CPU),
    ``destroy_model_parallel()``, a second world initialised
    and loaded from the saved checkpoint, then trained (a log-prob pass, two training
    passes). The hook calls, the warmups per world, the process groups megastart's load
    left behind, and whether the trained model holds the converted weights."""
    from megatron.core import parallel_state

    from megastart.demo.restart import restore_checkpoint, save_checkpoint
    from megastart.harness.cpu import initialize_megatron
    from megastart.warmup.api import last_report
    from support.loader_ranks import megatron

    with recording() as recorder:
        with megatron(layout):  # the conversion world
            before = last_report()
            bridge = import_megatron_bridge().AutoBridge.from_hf_pretrained(checkpoint)
            groups_before = process_groups()
            converted = provide(bridge, layout, load_weights=True)
            groups_left = process_groups() - groups_before
            save_checkpoint(converted, saved)  # megatron-core's dist_checkpointing
            warmup_in_conversion = warmed_since(before)
            before = last_report()
            parallel_state.destroy_model_parallel()  # as NeMo-RL does, then a new world
            initialize_megatron(**layout)
            chunks = provide(bridge, layout, load_weights=False)
            restore_checkpoint(chunks, saved)  # a bare dist_checkpointing.load: no hook
            same = not differences(state(converted), state(chunks))
            with ddp_schedule(chunks) as run:
                run(forward_only=True)
                run(forward_only=False)
                run(forward_only=False)
            warmup = warmed_since(before)
    return {
        "calls": recorder.calls,
        "groups_left": len(groups_left),
        "warmup_in_conversion": warmup_in_conversion,
        "warmup": warmup,
        "same": same,
    }


def process_groups() -> set[Any]:
    """Every process group torch.distributed knows in this process."""
    import torch.distributed.distributed_c10d as c10d

    return set(c10d._world.pg_map)


def mbridge_load_weights(checkpoint: str, layout: dict[str, int]) -> dict[str, Any]:
    """mbridge's ``Bridge.load_weights`` into megastart's harness model (a Qwen2 checkpoint, on
    Megatron's local spec: :mod:`support.mbridge_cpu`), once with megastart answering above
    (mbridge's own load) and once as a script calls it."""
    import mbridge

    from support.loader_ranks import build, megatron
    from support.mbridge_cpu import use_local_spec_in_mbridge

    use_local_spec_in_mbridge()
    with recording() as recorder, megatron(layout):
        bridge = mbridge.AutoBridge.from_pretrained(checkpoint, dtype=torch.float32)
        chunks = build(checkpoint)
        return theirs_then_ours(recorder, chunks, lambda: bridge.load_weights(chunks, checkpoint))


def library_load_seeing(
    checkpoint: str, sources: list[str], layout: dict[str, int]
) -> dict[str, Any]:
    """A library's HF loader of ``checkpoint``'s model called on every rank, each rank given
    its own entry of ``sources`` (a directory mounted on some nodes only): which load ran here
    (megastart's, through ``on_model_load``, or the library's own), and the state it left."""
    import torch.distributed as dist

    from megastart.engines.megatron_core import MegatronCoreScheduleAdapter
    from support.loader_ranks import build, megatron

    source = sources[dist.get_rank()]
    own: list[str] = []

    def libraries_own_load(model: list[Any], path: str) -> list[Any]:
        own.append(path)
        return model

    adapter = MegatronCoreScheduleAdapter()  # a library adapter: its load_if_served
    with recording() as recorder, megatron(layout):
        chunks = build(checkpoint)
        poison(chunks)
        adapter.load_if_served(
            libraries_own_load,
            (chunks, source),
            {},
            source,
            context=adapter.model_context,
            model_at=0,
        )
        return {"own": own, "calls": recorder.calls, "state": state(chunks)}
