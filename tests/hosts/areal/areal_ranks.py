"""Rank functions for the AReaL tests: AReaL's real ``MegatronEngine`` (with
megastart attached) around real Megatron-core GPT chunks on CPU over gloo.

AReaL's ``MegatronEngine.initialize`` cannot run without a GPU (it builds the
model under ``torch.device(LOCAL_RANK)``, a CUDA device), so :func:`engine_on_cpu`
does what ``initialize`` does with CPU parts: AReaL's own ``create_process_group``
(gloo on AReaL's CPU platform), megastart's demo GPT chunks in AReaL's
``_MegatronModelList``, AReaL's ``MegatronCheckpointManager``, then AReaL's
``_load_model_from_hf``, where megastart's ``on_model_load`` runs.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace
from typing import Any

from areal_cpu import import_megatron_engine

import megastart.autoload  # noqa: F401  (what megastart.areal_worker does first)

EXPERIMENT = SimpleNamespace(experiment_name="megastart-areal", trial_name="t0")


def engine_on_cpu(checkpoint: str, *, tp: int, engine_class: type | None = None) -> Any:
    """A real (attached) ``MegatronEngine`` on this rank, weights loaded from ``checkpoint``."""
    import torch
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.cli_args import TrainEngineConfig
    from areal.engine.megatron_utils.checkpointer import MegatronCheckpointManager
    from transformers import AutoConfig

    from megastart.demo.cpu import initialize_megatron
    from megastart.demo.model import build_gpt_chunks

    module = import_megatron_engine()
    world = int(os.environ["WORLD_SIZE"])
    initialize_megatron(tp=tp)
    _rng_tracker_state()
    config = TrainEngineConfig(
        experiment_name=EXPERIMENT.experiment_name,
        trial_name=EXPERIMENT.trial_name,
        path=checkpoint,
        dtype="float32",
    )
    engine = (engine_class or module.MegatronEngine)(config)
    engine.create_process_group(
        ParallelStrategy(tensor_parallel_size=tp, data_parallel_size=world // tp)
    )
    engine.hf_config = AutoConfig.from_pretrained(checkpoint)
    engine.device = torch.device("cpu")
    engine.model = module._MegatronModelList(build_gpt_chunks(engine.hf_config))
    _in_process_write_results()
    engine.checkpointer = MegatronCheckpointManager(
        model=engine.model, optimizer=None, lr_scheduler=None
    )
    with engine.device:
        engine._load_model_from_hf(checkpoint)
    engine._initialized = True
    return engine


def _rng_tracker_state() -> None:
    """AReaL saves and requires Megatron's model-parallel RNG state, which
    ``model_parallel_cuda_manual_seed`` creates on a GPU; on CPU it is the CPU state."""
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.states_ = {"model-parallel-rng": torch.get_rng_state()}


def _in_process_write_results() -> None:
    """Megatron's checkpoint writer collects its threads' results through a queue of a
    spawned ``multiprocessing`` manager, which a daemonic pool worker may not start;
    a synchronous save needs only an in-process queue. Its preload step also calls
    ``torch.cuda.synchronize()``, which has nothing to wait for on CPU."""
    import queue

    import torch

    torch.cuda.synchronize = lambda *args, **kwargs: None

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def recording_engine_class() -> type:
    """``MegatronEngine`` whose weight push to the rollout engine is a recording stand-in.

    ``connect_engine`` and ``update_weights`` talk to SGLang; everything else,
    ``load`` and ``save`` included, is AReaL's own (wrapped by megastart).
    """
    from megastart_areal_probe import record

    module = import_megatron_engine()

    class RecordingEngine(module.MegatronEngine):
        def connect_engine(self, engine: Any, meta: Any) -> None:
            self.rollout_engine = engine
            record("connect_engine")

        def update_weights(self, meta: Any) -> None:
            record("update_weights", version=meta.version)

    return RecordingEngine


class RolloutStandIn:
    """The inference engine's calls that ``RecoverHandler`` and the trainer make."""

    def __init__(self) -> None:
        from megastart_areal_probe import record

        self._record = record

    def pause(self) -> None:
        self._record("rollout.pause")

    def resume(self) -> None:
        self._record("rollout.resume")

    def offload(self) -> None:
        self._record("rollout.offload")

    def pause_generation(self) -> None:
        self._record("rollout.pause_generation")

    def set_version(self, version: int) -> None:
        self._record("rollout.set_version", version=version)


class Stateless:
    """Saver / evaluator / stats logger / dataloader: only their (empty) state matters."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        pass


def parameter_sums(engine: Any) -> list[float]:
    return [float(p.detach().double().sum()) for p in engine.model.parameters()]


def recover_handler(fileroot: str) -> Any:
    from areal.api import FinetuneSpec
    from areal.api.cli_args import RecoverConfig
    from areal.utils.recover import RecoverHandler

    config = RecoverConfig(
        mode="on",
        experiment_name=EXPERIMENT.experiment_name,
        trial_name=EXPERIMENT.trial_name,
        fileroot=fileroot,
        freq_steps=1,
        no_save_optim=True,
        no_load_optim=True,
    )
    return RecoverHandler(config, FinetuneSpec(1, 8, 4))


def save_recover_checkpoint(engine: Any, fileroot: str) -> list[float]:
    """AReaL's ``RecoverHandler.dump`` after step 0; the parameters' sums it saved."""
    from areal.api import StepInfo

    handler = recover_handler(fileroot)
    step = StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=2)
    parts = Stateless()
    handler.dump(engine, step, parts, parts, parts, parts)
    return parameter_sums(engine)


def zero_parameters(engine: Any) -> None:
    import torch

    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()


def recover(engine: Any, fileroot: str) -> Any:
    """AReaL's real ``RecoverHandler.load``, as ``PPOTrainer`` calls it (xccl weight update)."""
    from areal.api import WeightUpdateMeta

    parts = Stateless()
    meta = WeightUpdateMeta(type="xccl")
    return recover_handler(fileroot).load(
        engine,
        parts,
        parts,
        parts,
        parts,
        inference_engine=RolloutStandIn(),
        weight_update_meta=meta,
    )


def first_forward(engine: Any) -> str:
    """AReaL's ``forward_batch`` (what ``compute_logp`` calls); how far it gets on CPU."""
    import torch

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)}
    try:
        engine.forward_batch(batch)
    except Exception as error:  # reported by the test: how far AReaL's code runs on CPU
        return f"{type(error).__name__}: {error}"
    return "completed"


def weight_update_group_on_head(gen_world_size: int = 1) -> Any:
    """A weight-update group made the way ``_init_weight_update_from_distributed`` does.

    Rank 0 (the pipeline head) calls AReaL's ``init_custom_process_group`` as
    rank 0 of ``gen_world_size + 1`` ranks under ``update_weight_group_0``; the
    rollout side (SGLang workers in production) is a thread here that joins
    and then waits for the first weight broadcast, as SGLang does.
    """
    import torch
    from areal.engine.core.distributed import init_custom_process_group
    from areal.utils.network import find_free_ports

    port = find_free_ports(1)[0]
    init_method = f"tcp://127.0.0.1:{port}"
    received: dict[str, Any] = {}

    def rollout_worker() -> None:
        group = init_custom_process_group(
            backend="gloo",
            world_size=gen_world_size + 1,
            init_method=init_method,
            rank=1,
            group_name="update_weight_group_0",
            timeout=__import__("datetime").timedelta(seconds=60),
        )
        tensor = torch.zeros(4)
        torch.distributed.broadcast(tensor, 0, group=group)
        received["first_broadcast"] = tensor.tolist()

    thread = threading.Thread(target=rollout_worker, daemon=True)
    thread.start()
    group = init_custom_process_group(
        backend="gloo",
        world_size=gen_world_size + 1,
        init_method=init_method,
        rank=0,
        group_name="update_weight_group_0",
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    return SimpleNamespace(group=group, thread=thread, received=received)


def push_weights(update: Any) -> list[float]:
    """The first weight broadcast on the update group, as ``update_weights`` would issue it."""
    import torch

    tensor = torch.arange(4, dtype=torch.float32)
    torch.distributed.broadcast(tensor, 0, group=update.group)
    deadline = time.monotonic() + 30
    while "first_broadcast" not in update.received and time.monotonic() < deadline:
        time.sleep(0.05)
    return update.received.get("first_broadcast", [])
