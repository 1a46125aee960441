"""What each rank runs in the resume tests: Megatron-LM's ``save_checkpoint`` and, to resume,
Megatron-LM's or Megatron-Bridge's ``load_checkpoint``, as ``pretrain`` and NeMo-RL call them,
with megastart activated before either is imported (as ``AUTOWRAPT_BOOTSTRAP`` does)."""

from __future__ import annotations

from typing import Any

import torch

from support.bridge_ranks import differences
from support.library_ranks import recording, state, warmed_since


def megatron_lm_resume(
    checkpoint: str, saved: str, layout: dict[str, int], loader: str = "megatron-lm"
) -> dict[str, Any]:
    """Megatron-LM's (and slime's) resume: ``save_checkpoint`` at iteration 5 of the model in
    megatron-core's DDP, then ``load_checkpoint`` into a fresh one, as ``pretrain`` calls them
    (``torch_dist``, no optimizer, no RNG); then a fresh start's load of a directory without a
    checkpoint (iteration 0). ``loader="megatron-bridge"`` resumes with Megatron-Bridge's
    ``load_checkpoint`` instead (NeMo-RL's), which reads Megatron-LM's checkpoints. The hook
    calls, the iterations, and whether the resumed model holds the saved weights."""
    import sys

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from megastart.activation import activate
    from support.te_stub import import_with_te_stub

    activate()  # before the import, as AUTOWRAPT_BOOTSTRAP activates at start-up
    import_with_te_stub("megatron.training.checkpointing")  # Python 3.12's typing.override
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    from megastart.demo.restart import _writer_processes_allowed
    from megastart.demo.train import cuda_factories_on_cpu
    from megastart.warmup.api import last_report
    from support.loader_ranks import build, megatron

    argv, sys.argv = sys.argv, ["pretrain_gpt.py"]
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    args.tensor_model_parallel_size = layout.get("tp", 1)
    args.pipeline_model_parallel_size = layout.get("pp", 1)
    args.save = args.load = saved
    args.ckpt_format = "torch_dist"
    args.no_save_optim = args.no_load_optim = args.no_save_rng = args.no_load_rng = True
    args.exit_on_missing_checkpoint = False
    args.use_dist_ckpt = True  # what validate_args derives from ckpt_format
    global_vars.set_args(args)
    # what Megatron-LM's initialize_megatron sets up before any load
    init_num_microbatches_calculator(0, None, 1, 1, 1)
    with recording() as recorder, megatron(layout), cuda_factories_on_cpu():
        before = last_report()

        def ddp_model() -> list[Any]:
            chunk = build(checkpoint)[0]
            return [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk)]

        trained = ddp_model()
        cuda_rng_state = torch.cuda.get_rng_state  # saved with the checkpoint: none on CPU
        torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
        try:
            with _writer_processes_allowed():
                save_checkpoint(5, trained, None, None, 0)
        finally:
            torch.cuda.get_rng_state = cuda_rng_state
        load = load_checkpoint if loader == "megatron-lm" else bridge_loader(args)
        resumed = ddp_model()
        iteration, _ = load(resumed, None, None)
        warmup = warmed_since(before)
        same = not differences(state(trained), state(resumed))
        args.load = saved + "-empty"
        fresh, _ = load(ddp_model(), None, None)
        destroy_num_microbatches_calculator()
        return {
            "calls": recorder.calls,
            "iterations": (iteration, fresh),
            "same": same,
            "warmup": warmup,
        }


def bridge_loader(args: Any) -> Any:
    """Megatron-Bridge's ``load_checkpoint(state, model, optimizer, scheduler)`` as NeMo-RL calls
    it, with a state of the fields a model-only ``torch_dist`` resume reads (its
    ``CheckpointConfig``; ``args.load`` read at each call)."""
    from types import SimpleNamespace

    from support.te_stub import import_with_te_stub

    load_checkpoint = import_with_te_stub("megatron.bridge.training.checkpointing").load_checkpoint
    from megatron.bridge.training.config import CheckpointConfig

    def load(model: Any, optimizer: Any, scheduler: Any) -> Any:
        checkpoint = CheckpointConfig(
            load=args.load, ckpt_format="torch_dist", load_optim=False, load_rng=False
        )
        cfg = SimpleNamespace(
            checkpoint=checkpoint,
            model=SimpleNamespace(
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                fp16=False,
                bf16=False,
            ),
            optimizer=SimpleNamespace(use_distributed_optimizer=False),
            rng=SimpleNamespace(data_parallel_random_init=False),
            ddp=SimpleNamespace(use_megatron_fsdp=False),
            peft=None,
        )
        loggers = dict.fromkeys(("wandb_logger", "mlflow_logger", "comet_logger"))
        state = SimpleNamespace(
            cfg=cfg, train_state=None, fault_tolerance_state=SimpleNamespace(), **loggers
        )
        return load_checkpoint(state, model, optimizer, scheduler)

    return load
