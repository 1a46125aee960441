"""One variant of ``megastart bench warmup`` on one rank, in a fresh process.

Started by :mod:`megastart.bench.warmup` (one process per rank and variant,
with the torchrun environment of its parent), so every variant gets fresh NCCL
communicators and reads its own ``NCCL_*`` environment. It builds a Megatron
``GPTModel`` for the layout on CUDA, wraps it in Megatron's DDP and optimizer,
runs the variant's warmup, then two training steps, and reads the device's
free memory and PyTorch's reserved memory between the phases. Memory that
left the device but not through PyTorch's allocator is what NCCL (and other
libraries outside the allocator) took. The result goes to the parent through
the rendezvous store.

Variants: ``lazy`` (no warmup: the communicators connect inside the first
step), ``megastart`` (:func:`megastart.warmup_communicators`), ``allreduce1``
(a 1-element all-reduce per group, AReaL's and ms-swift's warmup today) and
``runtime_connect0`` (the same, with ``NCCL_RUNTIME_CONNECT=0`` so NCCL
connects every algorithm and protocol when it creates a communicator).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("lazy", "megastart", "allreduce1", "runtime_connect0")
VARIANT_ENV = {"runtime_connect0": {"NCCL_RUNTIME_CONNECT": "0"}}
"""Environment a variant's processes get on top of the parent's."""
COMMON_ENV = {
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP buffers are large and not what is measured
    "CUDA_MODULE_LOADING": "EAGER",  # no kernel-image loads inside the measured step
}


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and layout options, shared with the launcher."""
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: 2)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (default: 1)")
    parser.add_argument("--experts", type=int, default=0, help="MoE experts (0: dense)")
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Megatron's distributed optimizer (default: on)",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megastart.bench.warmup_worker")
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--prefix", required=True, help="store prefix of this variant's world")
    add_layout_arguments(parser)
    args = parser.parse_args(argv)
    store = _connect()
    result = measure(args, store)
    store.set(f"{args.prefix}/result/{result['rank']}", json.dumps(result))


def measure(args: argparse.Namespace, store: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # Like verl and AReaL: no device_id, so communicators are created lazily.
    dist.init_process_group(
        "nccl",
        store=dist.PrefixStore(args.prefix, store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            expert_model_parallel_size=args.ep,
        )
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        config, model, optimizer = _build(args)
        step = _train_step(args, config, model, optimizer)
        _load_libraries()
        start = _reading()
        seconds = _timed(lambda: _warm(args.variant, config, model.ddp_config))
        warmed = _reading()
        torch.cuda.reset_peak_memory_stats()
        first_step_s = _timed(step)
        first = _reading()
        step()
        second = _reading()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return {
        "variant": args.variant,
        "rank": rank,
        "warmup_s": seconds,
        "first_step_s": first_step_s,
        "warmup_nccl_bytes": _outside_allocator(start, warmed),
        "first_step_nccl_bytes": _outside_allocator(warmed, first),
        "second_step_nccl_bytes": _outside_allocator(first, second),
        "persistent_nccl_bytes": _outside_allocator(start, second),
        "first_step_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "free_bytes_before_warmup": start[0],
    }


def _warm(variant: str, config: Any, ddp_config: Any) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if variant == "megastart":
        from megastart.warmup.api import warmup_communicators

        warmup_communicators(model_config=config, ddp_config=ddp_config)
    elif variant in ("allreduce1", "runtime_connect0"):
        from megastart.warmup.groups import step_groups

        for warm in step_groups(parallel_state, config, ddp_config):
            dist.all_reduce(torch.ones(1, device="cuda"), group=warm.group)
    torch.cuda.synchronize()


def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    moe = {}
    if args.experts:
        moe = {
            "num_moe_experts": args.experts,
            "moe_router_topk": 2,
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False,
        }
    config = TransformerConfig(
        num_layers=args.layers_per_stage * args.pp,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep,
        sequence_parallel=args.tp > 1,
        pipeline_dtype=torch.bfloat16,
        params_dtype=torch.bfloat16,
        bf16=True,
        variable_seq_lengths=False,
        **moe,
    )
    config.finalize_model_grads_func = finalize_model_grads
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=args.experts or None, moe_grouped_gemm=False
        ),
        vocab_size=args.vocab,
        max_sequence_length=args.seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
    ).cuda()
    ddp = DistributedDataParallel(  # wrapped as Megatron-LM, verl and AReaL wrap it
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=args.distributed_optimizer
        ),
        module=Float16Module(config, model),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-5,
            bf16=True,
            use_distributed_optimizer=args.distributed_optimizer,
            clip_grad=1.0,
        ),
        [ddp],
    )
    return config, ddp, optimizer


def _train_step(
    args: argparse.Namespace, config: Any, model: Any, optimizer: Any
) -> Callable[[], None]:
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.randint(0, args.vocab, (1, args.seq_len), device="cuda")
    positions = torch.arange(args.seq_len, device="cuda").unsqueeze(0)

    def forward_step(data_iterator: Any, chunk: Any) -> tuple[Any, Any]:
        next(data_iterator)
        output = chunk(tokens, positions, attention_mask=None, labels=tokens)

        def loss(output_tensor: Any) -> tuple[Any, dict[str, Any]]:
            value = output_tensor.float().mean()
            return value, {"loss": value.detach()}

        return output, loss

    def step() -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(args.micro_batches)),
            model=[model],
            num_microbatches=args.micro_batches,
            seq_length=args.seq_len,
            micro_batch_size=1,
            forward_only=False,
        )
        optimizer.step()
        torch.cuda.synchronize()

    return step


def _load_libraries() -> None:
    """Create the cuBLAS handles and workspaces (main thread and autograd's) before the
    first reading: they live outside PyTorch's allocator and are not NCCL's."""
    import torch

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        torch.nn.functional.linear(
            x, w, torch.zeros(64, device="cuda", dtype=dtype)
        ).sum().backward()
        (x @ w).sum().backward()
    torch.cuda.synchronize()


def _connect() -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=datetime.timedelta(minutes=10),
    )


def _reading() -> tuple[int, int]:
    """(free device bytes, bytes PyTorch's allocator holds), after the device is idle."""
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0]), int(torch.cuda.memory_reserved())


def _outside_allocator(before: tuple[int, int], after: tuple[int, int]) -> int:
    """Device memory taken between two readings that PyTorch's allocator does not hold."""
    return (before[0] - after[0]) - (after[1] - before[1])


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
