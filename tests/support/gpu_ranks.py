"""What each rank runs in the GPU suite (tests/gpu): models as the hosts build them on a GPU
(Transformer Engine layer specs, grouped-GEMM experts, bf16 CUDA parameters), every parameter
NaN before each load, so that nothing a load leaves untouched passes.

Every function takes the ``device``: ``"cuda"`` on the GPU machine; ``"cpu"`` (Megatron's local
specs, the CPU shims) runs the same code where there is no GPU, which is how the suite's own
code is checked before it goes to the GPU machine.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from support.bridge_ranks import build as build_by_bridge
from support.bridge_ranks import differences, load_by_registry, poison, state
from support.loader_ranks import TOKENS, settings

DTYPE = torch.bfloat16


@contextmanager
def megatron_on(device: str, layout: dict[str, int]) -> Iterator[None]:
    """Megatron set up for ``layout`` on ``device``; afterwards torn down, and a failed load or
    a warmup forgotten."""
    from megastart.harness.cpu import destroy_megatron, initialize_megatron
    from megastart.loader.api import reset_state
    from megastart.warmup.api import reset_state as reset_warmup

    # each model sets TE's attention variables (NVTE_FUSED_ATTN, ...) for its attention backend
    # and refuses values another left: as in a user's process, each starts without them
    attention = {k: v for k, v in os.environ.items() if k.startswith("NVTE_") and "_ATTN" in k}
    initialize_megatron(**layout, device=device)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("NVTE_") and "_ATTN" in k]:
            del os.environ[k]
        os.environ.update(attention)
        destroy_megatron()
        reset_state()
        reset_warmup()


def build_te(checkpoint: str, device: str) -> list[Any]:
    """This rank's chunks for the checkpoint's config, bf16: Transformer Engine's specs on a
    GPU, Megatron's local ones on the CPU."""
    from transformers import AutoConfig

    from megastart.harness.model import build_gpt_chunks

    spec = "transformer_engine" if device == "cuda" else "local"
    return build_gpt_chunks(AutoConfig.from_pretrained(checkpoint), dtype=DTYPE, layer_spec=spec)


def parameters(chunks: list[Any]) -> dict[str, torch.Tensor]:
    """Every parameter of this rank, by chunk and name, on the CPU."""
    return {
        f"{i}:{name}": p.detach().cpu().clone()
        for i, chunk in enumerate(chunks)
        for name, p in chunk.named_parameters()
    }


def left_nan(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n, t in tensors.items() if t.is_floating_point() and t.isnan().any())


def te_modules(chunks: list[Any]) -> int:
    """How many of the chunks' modules are Transformer Engine's (or megatron-core's TE wrappers)."""
    te = ("transformer_engine", "megatron.core.extensions.transformer_engine")
    return sum(type(m).__module__.startswith(te) for c in chunks for m in c.modules())


GROUPED = re.compile(r"experts\.linear_fc[12]\.weight\d+$")
"""A grouped-GEMM expert weight (``TEGroupedMLP``)."""


def bridge_and_megastart(
    checkpoint: str, device: str, built_in: bool, layout: dict[str, int] | None = None
) -> dict[str, Any]:
    """This rank's model as Megatron-Bridge's provider builds it for ``layout`` (default: world
    size 1), loaded by the bridge's own ``load_hf_weights``, by megastart through the bridge's
    registry (``load_for_engine``, as verl's and NeMo-RL's hooks call it) and, with
    ``built_in``, by ``load_hf_checkpoint`` with megastart's own table; what differs from the
    bridge's load."""
    from megastart import load_hf_checkpoint

    layout = layout or {}
    with megatron_on(device, layout), logged() as lines:
        bridge, chunks = build_by_bridge(checkpoint, layout, "bfloat16", device)
        poison(chunks)
        bridge.load_hf_weights(chunks, checkpoint)
        theirs, nan = state(chunks), left_nan(parameters(chunks))
        poison(chunks)
        report = load_by_registry(chunks, bridge, checkpoint, device)
        result: dict[str, Any] = dict(
            te_modules=te_modules(chunks),
            grouped=sum(bool(GROUPED.search(n)) for n in theirs),
            dtypes=sorted({str(t.dtype) for t in theirs.values()}),
            bridge_left_nan=nan,
            by_registry=report is not None,
            said=list(lines),  # why megastart left the load to the bridge, if it did
            registry_differs=differences(theirs, state(chunks)),
        )
        if built_in:
            poison(chunks)
            load_hf_checkpoint(chunks, checkpoint, settings=settings())
            result["table_differs"] = differences(theirs, state(chunks))
        return result


def loads_on_the_bridges_model(checkpoint: str, device: str) -> dict[str, str | None]:
    """World size 1: the model the bridge's provider builds, loaded by the bridge's own
    ``load_hf_weights`` and by megastart's built-in table; each one's error, or None."""
    from megastart import load_hf_checkpoint

    with megatron_on(device, {}):
        bridge, chunks = build_by_bridge(checkpoint, {}, "bfloat16", device)
        loads = {
            "bridge": lambda: bridge.load_hf_weights(chunks, checkpoint),
            "megastart": lambda: load_hf_checkpoint(chunks, checkpoint, settings=settings()),
        }
        said: dict[str, str | None] = {}
        for who, load in loads.items():
            try:
                load()
                said[who] = None
            except Exception as e:  # what each says is the result
                said[who] = f"{type(e).__name__}: {e}"
        return said


def load_and_forward(checkpoint: str, device: str) -> dict[str, Any]:
    """World size 1: megastart's load (strict: a checkpoint tensor no parameter takes is an
    error) into the NaN model, its logits on :data:`TOKENS`, what it left NaN, the
    ``_extra_state`` entries of the model's state dict, and the lines megastart logged."""
    from megastart import load_hf_checkpoint
    from megastart.harness.model import forward_logits

    with megatron_on(device, {}), logged() as lines:
        chunks = build_te(checkpoint, device)
        for p in (p for c in chunks for p in c.parameters()):
            p.data.fill_(float("nan"))
        report = load_hf_checkpoint(chunks, checkpoint, settings=settings(strict=True))
        return dict(
            te_modules=te_modules(chunks),
            grouped=sum(bool(GROUPED.search(n)) for c in chunks for n, _ in c.named_parameters()),
            left_nan=left_nan(parameters(chunks)),
            extra_state=[k for c in chunks for k in c.state_dict() if k.endswith("_extra_state")],
            tensors=report.tensors,
            left_to_host=report.left_to_host,
            lines=lines,
            logits=forward_logits(chunks, TOKENS.to(device)).cpu(),
        )


@contextmanager
def logged() -> Iterator[list[str]]:
    """The messages megastart logs at WARNING and above, while inside."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megastart").addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger("megastart").removeHandler(handler)


TE_TO_LOCAL = (
    (r"self_attention\.linear_qkv\.layer_norm_weight$", "input_layernorm.weight"),
    (r"linear_q_up_proj\.layer_norm_weight$", "q_layernorm.weight"),
    (r"linear_kv_up_proj\.layer_norm_weight$", "kv_layernorm.weight"),
    (r"mlp\.linear_fc1\.layer_norm_weight$", "pre_mlp_layernorm.weight"),
    (r"experts\.linear_fc([12])\.weight(\d+)$", r"experts.local_experts.\2.linear_fc\1.weight"),
)
"""Where Transformer Engine's specs name a parameter other than Megatron's local specs: the
norms fused into the next linear, the grouped experts."""


def local_name(te_name: str) -> str:
    """The local specs' name of a Transformer Engine model's parameter."""
    for pattern, local in TE_TO_LOCAL:
        name, found = re.subn(pattern, local, te_name)
        if found:
            return name
    return te_name


DOWN_PROJECTION = re.compile(r"self_attention\.linear_(q|kv)_down_proj\.weight$")
"""MLA's down projections: Transformer Engine's spec holds them whole on every TP rank
(``TELinear``, duplicated); the local spec splits their rows over TP (``ColumnParallelLinear``)."""


def whole_down_projections(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The local spec's parameters with its MLA down projections' TP shards gathered whole
    (rows in TP rank order), as Transformer Engine's spec holds them."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    out = dict(local)
    for name in sorted(n for n in local if DOWN_PROJECTION.search(n)):
        shards = [torch.empty_like(local[name]) for _ in range(size)]
        dist.all_gather(shards, local[name].contiguous(), group=group)
        out[name] = torch.cat(shards)
    return out


def te_load_and_local_load(checkpoint: str, layout: dict[str, int], device: str) -> dict[str, Any]:
    """Several ranks sharing the GPU over gloo: this rank's load of the Transformer Engine model
    with CUDA parameters, and what differs from its load, in the same layout, of the model with
    Megatron's local specs on the CPU (the model the CPU suite checks against transformers)."""
    from megastart import load_hf_checkpoint
    from megastart.harness.model import build_gpt_chunks

    with megatron_on("cpu", layout):
        from transformers import AutoConfig

        local = build_gpt_chunks(AutoConfig.from_pretrained(checkpoint), dtype=DTYPE)
        load_hf_checkpoint(local, checkpoint, settings=settings())
        reference = parameters(local)
        if device == "cuda":  # Transformer Engine's spec
            reference = whole_down_projections(reference)
        del local
    with megatron_on(device, layout):
        chunks = build_te(checkpoint, device)
        poison(chunks)
        load_hf_checkpoint(chunks, checkpoint, settings=settings())
        loaded = {local_name(n): t for n, t in parameters(chunks).items()}
        return dict(
            devices=sorted({p.device.type for c in chunks for p in c.parameters()}),
            te_modules=te_modules(chunks),
            grouped=sum(bool(GROUPED.search(n)) for c in chunks for n, _ in c.named_parameters()),
            parameters=len(loaded),
            differs=differences(reference, loaded),
        )


def warmup_then_train(checkpoint: str, device: str) -> dict[str, Any]:
    """World size 1 over NCCL: the warmup as a host runs it before the first step, what the
    same warmup says when called inside a CUDA graph capture, then one training step of the
    loaded model."""
    from megatron.core import parallel_state

    from megastart import load_hf_checkpoint
    from megastart.warmup.api import reset_state, warmup_communicators
    from megastart.warmup.settings import CommWarmupSettings

    with megatron_on(device, {}):
        chunks = build_te(checkpoint, device)
        load_hf_checkpoint(chunks, checkpoint, settings=settings())
        warm = dict(
            settings=CommWarmupSettings(timeout_s=60.0),
            model_config=chunks[0].config,
            parallel_state=parallel_state,
            trigger="pre_first_step",
        )
        report = warmup_communicators(**warm)
        reset_state()
        refused = None
        if device == "cuda":
            try:
                # thread_local: NCCL's watchdog thread may query events meanwhile
                with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
                    warmup_communicators(**warm)
            except RuntimeError as e:
                refused = str(e)
        return dict(
            operations=report.operations,
            groups=report.groups,
            refused_in_capture=refused,
            **train_step(chunks[0], device),
        )


def train_step(chunk: Any, device: str) -> dict[str, Any]:
    """One step of next-token training (cross entropy, SGD) on :data:`TOKENS`."""
    chunk.train()
    before = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    tokens = TOKENS.to(device)
    batch, seq = tokens.shape
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(diagonal=1)
    logits = chunk(input_ids=tokens, position_ids=positions, attention_mask=mask)
    vocab = chunk.hf_config.vocab_size
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1, :vocab].float().reshape(-1, vocab), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    grads = [p.grad for p in chunk.parameters() if p.grad is not None]
    torch.optim.SGD(chunk.parameters(), lr=1e-2).step()
    changed = sum(not torch.equal(before[n], p) for n, p in chunk.named_parameters())
    return dict(
        loss=loss.item(),
        grads=len(grads),
        grads_finite=all(bool(g.isfinite().all()) for g in grads),
        without_grad=[n for n, p in chunk.named_parameters() if p.grad is None],
        changed=changed,
        total=len(before),
    )


def mbridge_and_megastart(checkpoint: str, device: str) -> dict[str, Any]:
    """World size 1: the model mbridge builds (Transformer Engine's specs, bf16, wrapped as verl
    wraps it), loaded by mbridge's own ``load_weights`` and by ``load_hf_checkpoint`` (which
    takes the chunks unwrapped, as the verl adapter hands them over); what differs."""
    from mbridge import AutoBridge

    from megastart import load_hf_checkpoint

    with megatron_on(device, {}):
        from megatron.core.utils import unwrap_model

        bridge = AutoBridge.from_pretrained(checkpoint)
        models = bridge.get_model(bf16=True, wrap_with_ddp=False)  # in Float16Module
        chunks = unwrap_model(models)
        poison(chunks)
        bridge.load_weights(models, checkpoint)
        theirs, nan = state(chunks), left_nan(parameters(chunks))
        poison(chunks)
        load_hf_checkpoint(chunks, checkpoint, settings=settings())
        return dict(
            te_modules=te_modules(chunks),
            bridge_left_nan=nan,
            differs=differences(theirs, state(chunks)),
        )
