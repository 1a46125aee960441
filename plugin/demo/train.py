"""One real Megatron training step on CPU: the pipeline schedule over gloo, then an optimizer step.

What runs is what a Megatron-core host runs for one step (verl's and AReaL's
Megatron engines do the same): the chunks wrapped in Megatron's
``DistributedDataParallel``; Megatron's optimizer from
``get_megatron_optimizer`` (Adam, fp32 parameters, no distributed optimizer;
without Transformer Engine or Apex its inner optimizer is ``torch.optim.AdamW``);
``get_forward_backward_func()`` (the 1F1B schedule,
``forward_backward_pipelining_without_interleaving``, when PP > 1) with
next-token cross-entropy on random tokens, ``finalize_model_grads`` (gradient
all-reduces), then ``optimizer.step()``. Gradient clipping is off: Megatron's
clipping asserts ``torch.cuda.FloatTensor`` gradients.

CPU stand-ins (demo only, see DESIGN.md "Testing without GPUs"): Megatron
creates a few scalars with ``device="cuda"`` (the schedule's token count, the
optimizer's loss scale and grad-norm buffers), which :func:`cuda_factories_on_cpu`
redirects to the CPU; ``torch.cuda.synchronize`` (after batched pipeline
send/recv) does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from megatron.core.models.gpt import GPTModel


def train_step(
    chunks: list[GPTModel], *, micro_batches: int = 2, seq_length: int = 32, seed: int = 0
) -> dict[str, Any]:
    """Run one training step on every rank together; what it did, as plain data.

    Every rank draws the same random token batch (``seed``), so the pipeline's
    first and last stages agree on inputs and labels.

    :returns: ``schedule`` and ``optimizer`` (what ran), ``loss`` (mean over the
        micro-batches; ``None`` off the last pipeline stage), ``grad_norm``,
        ``updated`` (the optimizer applied the step), ``params_changed`` /
        ``params`` (this rank's parameters the step changed / all of them).
    """
    import torch
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if len(chunks) != 1:
        raise NotImplementedError(
            f"train_step: {len(chunks)} virtual pipeline chunks; the CPU demo trains one chunk per rank"
        )
    config = chunks[0].config
    vocab = chunks[0].hf_config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (micro_batches, 1, seq_length + 1), generator=generator)
    before = [p.detach().clone() for p in chunks[0].parameters()]
    with cuda_factories_on_cpu():
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), chunks[0])
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-4,
                params_dtype=config.params_dtype,
                bf16=False,
                fp16=False,
                use_distributed_optimizer=False,
                clip_grad=0.0,
            ),
            [model],
        )
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = model.no_sync
        config.grad_scale_func = optimizer.scale_loss
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        schedule = get_forward_backward_func()
        losses = schedule(
            forward_step_func=_forward_step,
            data_iterator=iter(tokens),
            model=[model],
            num_microbatches=micro_batches,
            seq_length=seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        updated, grad_norm, _ = optimizer.step()
    model.eval()
    changed = sum(
        not torch.equal(old, new.detach())
        for old, new in zip(before, chunks[0].parameters(), strict=True)
    )
    inner = [
        type(o.optimizer).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    return {
        "schedule": schedule.__name__,
        "optimizer": f"{type(optimizer).__name__}({', '.join(inner)})",
        "loss": sum(float(x["lm loss"]) for x in losses) / len(losses) if losses else None,
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "updated": bool(updated),
        "params_changed": changed,
        "params": len(before),
    }


def _forward_step(data: Iterator[torch.Tensor], model: Any) -> tuple[torch.Tensor, Any]:
    """Megatron's forward-step contract: this micro-batch's output and its loss function."""
    import torch

    tokens = next(data)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    seq = inputs.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0)
    causal_mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(diagonal=1)
    output = model(inputs, position_ids, causal_mask, labels=labels)
    return output, partial(_loss, torch.ones_like(labels, dtype=torch.float32))


def _loss(mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = (per_token_loss.float() * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach()}


@contextlib.contextmanager
def cuda_factories_on_cpu() -> Iterator[None]:
    """Inside the block, tensors created with ``device="cuda"`` are created on the CPU,
    and ``torch.cuda.synchronize`` does nothing (demo-only CPU stand-ins)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class _CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.synchronize = synchronize
