"""Rank functions for the AReaL tests: AReaL's real ``MegatronEngine`` (with
megastart attached: the pools start ranks with ``areal_cpu.ACTIVATION``) around real Megatron-core GPT chunks on CPU over gloo.

AReaL's ``MegatronEngine.initialize`` cannot run without a GPU (it builds the
model under ``torch.device(LOCAL_RANK)``, a CUDA device), so :func:`engine_on_cpu`
does what ``initialize`` does with CPU parts: AReaL's own ``create_process_group``
(gloo on AReaL's CPU platform), megastart's demo GPT chunks in AReaL's
``_MegatronModelList``, AReaL's ``MegatronCheckpointManager``, then AReaL's
``_load_model_from_hf``, where megastart's ``on_model_load`` runs.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

from areal_cpu import import_megatron_engine, python_path

HF_LOAD_SECONDS: list[float] = []
"""Wall time of each ``_load_model_from_hf`` call ``engine_on_cpu`` made in this process."""

VALUE_HEADS_BEFORE_LOAD: list[Any] = []
"""The value head of each critic ``engine_on_cpu`` built, as AReaL initialised it (last stage)."""

EXPERIMENT = SimpleNamespace(experiment_name="megastart-areal", trial_name="t0")


def engine_on_cpu(
    checkpoint: str,
    *,
    tp: int,
    engine_class: type | None = None,
    critic: bool = False,
    bridge_type: str = "mbridge",
    trainable: bool = False,
) -> Any:
    """A real (attached) ``MegatronEngine`` on this rank, weights loaded from ``checkpoint``;
    a ``critic`` gets AReaL's ``ValueHead`` as ``make_mcore_model(is_critic=True)`` gives it.

    ``bridge_type="megatron-bridge"`` (AReaL's ``actor.megatron.bridge_type``): AReaL's own
    ``_build_hf_mcore_bridge`` makes the engine's ``AutoBridge``, whose provider builds the
    chunks (on the CPU: :func:`support.bridge_ranks.build`), and AReaL's loader is then the
    bridge's ``load_hf_weights``.

    ``trainable``: the config has an optimizer, as an actor's has (a reference's and a
    critic's HF loads are never deferred); the CPU engine builds no optimizer (with megatron-core
    0.17 on CPU, AReaL's distributed optimizer neither saves its state nor leaves a recovered
    model's weights as loaded: docs/hosts/areal.md)."""
    import torch
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.cli_args import MegatronEngineConfig, OptimizerConfig, TrainEngineConfig
    from areal.engine.megatron_utils.checkpointer import MegatronCheckpointManager
    from transformers import AutoConfig

    from megastart.harness.cpu import initialize_megatron
    from megastart.harness.model import build_gpt_chunks

    module = import_megatron_engine()
    world = int(os.environ["WORLD_SIZE"])
    initialize_megatron(tp=tp)
    _rng_tracker_state()
    config = TrainEngineConfig(
        experiment_name=EXPERIMENT.experiment_name,
        trial_name=EXPERIMENT.trial_name,
        path=checkpoint,
        dtype="float32",
        is_critic=critic,
        optimizer=OptimizerConfig() if trainable else None,
        megatron=MegatronEngineConfig(bridge_type=bridge_type),
    )
    engine = (engine_class or module.MegatronEngine)(config)
    engine.create_process_group(
        ParallelStrategy(tensor_parallel_size=tp, data_parallel_size=world // tp)
    )
    engine.hf_config = AutoConfig.from_pretrained(checkpoint)
    engine.device = torch.device("cpu")
    if bridge_type == "megatron-bridge":
        from support.bridge_ranks import build

        _, chunks = build(checkpoint, {"tp": tp}, bridge=engine._build_hf_mcore_bridge())
    else:
        chunks = build_gpt_chunks(engine.hf_config)
    if critic:
        from areal.models.mcore.registry import _replace_output_layer_with_value_head

        for chunk in chunks:
            if chunk.post_process:
                _replace_output_layer_with_value_head(chunk, chunk.config)
                VALUE_HEADS_BEFORE_LOAD.append(chunk.output_layer.weight.detach().clone())
    engine.model = module._MegatronModelList(chunks)
    _in_process_write_results()
    engine.checkpointer = MegatronCheckpointManager(
        model=engine.model, optimizer=None, lr_scheduler=None
    )
    start = time.perf_counter()
    with engine.device:
        engine._load_model_from_hf(checkpoint)
    HF_LOAD_SECONDS.append(time.perf_counter() - start)
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
    import torch
    from areal.api import StepInfo

    handler = recover_handler(fileroot)
    step = StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=2)
    parts = Stateless()
    handler.dump(engine, step, parts, parts, parts, parts)
    # Rank 0 writes the recover info after the last collective; a restart reads it
    # in a later run, so wait for it as the end of this run would.
    torch.distributed.barrier()
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
        import traceback

        frames = [
            f
            for f in traceback.extract_tb(error.__traceback__)
            if "site-packages/areal/" in f.filename
        ]
        where = (
            f" at {frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno} ({frames[-1].name})"
            if frames
            else ""
        )
        return f"{type(error).__name__}: {error}{where}"
    return "completed"


ROLLOUT_MEMBER = """
import json, sys
from datetime import timedelta
import torch
from areal.engine.core.distributed import init_custom_process_group
init_method, world_size = sys.argv[1], int(sys.argv[2])
group = init_custom_process_group(backend="gloo", world_size=world_size, init_method=init_method,
                                  rank=1, group_name="update_weight_group_0",
                                  timeout=timedelta(seconds=120))
tensor = torch.zeros(4)
torch.distributed.broadcast(tensor, 0, group=group)
print(json.dumps(tensor.tolist()))
"""
"""The rollout side of the weight-update group (SGLang workers in production): it
joins, then takes the first broadcast on the group to be the weight push."""


def weight_update_group_on_head(gen_world_size: int = 1) -> Any:
    """A weight-update group made the way ``_init_weight_update_from_distributed`` does.

    The pipeline head calls AReaL's ``init_custom_process_group`` as rank 0 of
    ``gen_world_size + 1`` ranks under ``update_weight_group_0``; the rollout
    member is a separate process (:data:`ROLLOUT_MEMBER`).
    """
    import subprocess
    import sys
    from datetime import timedelta

    from areal.engine.core.distributed import init_custom_process_group
    from areal.utils.network import find_free_ports

    init_method = f"tcp://127.0.0.1:{find_free_ports(1)[0]}"
    member = subprocess.Popen(
        [sys.executable, "-c", ROLLOUT_MEMBER, init_method, str(gen_world_size + 1)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": python_path()},
    )
    try:
        group = init_custom_process_group(
            backend="gloo",
            world_size=gen_world_size + 1,
            init_method=init_method,
            rank=0,
            group_name="update_weight_group_0",
            timeout=timedelta(seconds=120),
        )
    except BaseException:
        member.kill()
        raise
    return SimpleNamespace(group=group, member=member)


def push_weights(update: Any) -> list[float]:
    """The first weight broadcast on the update group, as ``update_weights`` issues it;
    what the rollout member received."""
    import json

    import torch

    try:
        torch.distributed.broadcast(torch.arange(4, dtype=torch.float32), 0, group=update.group)
        out, _ = update.member.communicate(timeout=60)
    finally:
        update.member.kill()
    return json.loads(out.strip().splitlines()[-1])
