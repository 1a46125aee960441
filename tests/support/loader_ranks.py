"""What each rank runs in the loader tests (module-level, so RankPool can pickle them by reference).

Every function sets up Megatron for one layout, builds the model from a
checkpoint's ``config.json``, loads with ``megastart.load_hf_checkpoint``, and
tears Megatron down again so the next case can reuse the same ranks.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any

import torch

from megastart.loader.settings import Rank0LoaderSettings

TOKENS = (torch.arange(16).reshape(2, 8) * 37) % 250


def reference_logits(checkpoint: str | os.PathLike[str]) -> torch.Tensor:
    """Ground truth: the ``transformers`` model read back from the checkpoint, fp32, on :data:`TOKENS`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


@contextmanager
def megatron(layout: dict[str, int]):
    """Megatron set up for ``layout``; afterwards torn down, and a failed load forgotten."""
    from megastart.harness.cpu import destroy_megatron, initialize_megatron
    from megastart.loader.api import reset_state

    initialize_megatron(**layout)
    try:
        yield
    finally:
        destroy_megatron()
        reset_state()


def build(checkpoint: str, **config_overrides: Any) -> list[Any]:
    """This rank's chunks for the checkpoint's config; ``config_overrides`` replace
    TransformerConfig fields (uneven pipeline stages; ``context_parallel_size=1``,
    since Megatron's local attention cannot be built with CP > 1)."""
    import dataclasses

    from transformers import AutoConfig

    from megastart.harness import model

    original = model.transformer_config
    model.transformer_config = lambda *a, **k: dataclasses.replace(
        original(*a, **k), **config_overrides
    )
    try:
        return model.build_gpt_chunks(AutoConfig.from_pretrained(checkpoint))
    finally:
        model.transformer_config = original


def settings(**overrides: Any) -> Rank0LoaderSettings:
    return Rank0LoaderSettings(
        **{"bucket_mb": 0.05, "progress": False, "timeout_s": 60.0, **overrides}
    )


def load_and_forward(
    checkpoint: str, layout: dict[str, int], overrides: dict[str, Any], **config_overrides: Any
) -> tuple[Any, torch.Tensor]:
    """The load report and the full logits on :data:`TOKENS`, on every rank."""
    from megastart import load_hf_checkpoint
    from megastart.harness.model import forward_logits

    with megatron(layout):
        chunks = build(checkpoint, **config_overrides)
        report = load_hf_checkpoint(chunks, checkpoint, settings=settings(**overrides))
        return report, forward_logits(chunks, TOKENS)


def load_parameters(
    checkpoint: str, layout: dict[str, int], overrides: dict[str, Any] | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """This rank's TP rank and its loaded parameters (for layouts Megatron cannot run on CPU)."""
    from megatron.core import parallel_state

    from megastart import load_hf_checkpoint

    with megatron(layout):
        chunks = build(checkpoint, context_parallel_size=1)
        load_hf_checkpoint(chunks, checkpoint, settings=settings(**(overrides or {})))
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        return tp_rank, {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


def load_as_nodes(
    checkpoint: str,
    layout: dict[str, int],
    ranks_per_node: int,
    overrides: dict[str, Any],
    **config_overrides: Any,
) -> tuple[Any, torch.Tensor]:
    """:func:`load_and_forward` with ``LOCAL_RANK`` set as on nodes of ``ranks_per_node`` ranks."""
    with simulated_nodes(ranks_per_node):
        return load_and_forward(checkpoint, layout, overrides, **config_overrides)


def load_parameters_as_nodes(
    checkpoint: str, layout: dict[str, int], ranks_per_node: int, overrides: dict[str, Any]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The load report and this rank's loaded parameters (every chunk's, by name), on nodes of
    ``ranks_per_node`` ranks."""
    from megastart import load_hf_checkpoint

    with simulated_nodes(ranks_per_node), megatron(layout):
        chunks = build(checkpoint)
        report = load_hf_checkpoint(chunks, checkpoint, settings=settings(**overrides))
        return report, {
            f"{i}.{name}": p.detach().clone()
            for i, chunk in enumerate(chunks)
            for name, p in chunk.named_parameters()
        }


@contextmanager
def simulated_nodes(ranks_per_node: int):
    """``LOCAL_RANK`` as on nodes of ``ranks_per_node`` consecutive ranks (the loader's node key)."""
    import torch.distributed as dist

    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(dist.get_rank() % ranks_per_node)
    try:
        yield
    finally:
        os.environ["LOCAL_RANK"] = saved or "0"


def load_expecting_error(
    checkpoint: str,
    layout: dict[str, int],
    overrides: dict[str, Any],
    build_from: str | None = None,
) -> str:
    """The error this rank raised, as ``Type: message`` (``"loaded"`` if none)."""
    from megastart import load_hf_checkpoint

    with megatron(layout):
        chunks = build(build_from or checkpoint)
        try:
            load_hf_checkpoint(chunks, checkpoint, settings=settings(**overrides))
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "loaded"


def load_for_engine_counting_warnings(checkpoint: str) -> tuple[Any, int]:
    """``load_for_engine`` through an EngineContext; its result and the warnings this rank logged."""
    from megatron.core import parallel_state

    from megastart.loader.api import load_for_engine
    from megastart.records import EngineContext

    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    logger = logging.getLogger("megastart")
    logger.addHandler(handler)
    try:
        with megatron({}):
            engine = EngineContext(
                host="test",
                host_version="0",
                model_chunks=build(checkpoint),
                parallel_state=parallel_state,
                device="cpu",
            )
            return load_for_engine(engine, checkpoint), len(warnings)
    finally:
        logger.removeHandler(handler)


def process_groups_before_and_after_loads(
    checkpoint: str, layout: dict[str, int]
) -> dict[str, Any]:
    """How many process groups torch.distributed holds before a load, after it, and after a
    second one; and the control plane's groups after each load."""
    from torch.distributed import distributed_c10d

    from megastart import load_hf_checkpoint
    from megastart.distributed import kept_control

    with megatron(layout):
        chunks = build(checkpoint)
        counts = [len(distributed_c10d._world.pg_map)]
        kept = []
        for _ in range(2):
            load_hf_checkpoint(chunks, checkpoint, settings=settings(reader="node"))
            counts.append(len(distributed_c10d._world.pg_map))
            kept.append(kept_control(timeout_s=60.0))
        return {
            "registered": counts,
            "control": kept[0].group_ranks,
            "same_control": kept[0] is kept[1],
        }


def load_counting_received_bytes(
    checkpoint: str, layout: dict[str, int], ranks_per_node: int
) -> tuple[int, int, Any]:
    """This rank's pipeline stage, the bucket bytes broadcast to it, and the load report.

    Counts the ``uint8`` payloads of the loader's broadcasts (:class:`Channel`, over its
    groups between node leaders and inside a node) this rank does not send (the real
    broadcast still runs).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megastart import load_hf_checkpoint
    from megastart.loader.stream.transport import Channel

    original = Channel._broadcast
    received = [0]

    def counting(self: Channel, tensor: torch.Tensor, group: Any) -> Any:
        if self.src != dist.get_rank() and tensor.dtype == torch.uint8:
            received[0] += tensor.nbytes
        return original(self, tensor, group)

    with simulated_nodes(ranks_per_node), megatron(layout):
        chunks = build(checkpoint)
        Channel._broadcast = counting  # type: ignore[method-assign]
        try:
            report = load_hf_checkpoint(chunks, checkpoint, settings=settings())
        finally:
            Channel._broadcast = original  # type: ignore[method-assign]
        return parallel_state.get_pipeline_model_parallel_rank(), received[0], report


Attempt = tuple[str, str, float]
"""What one call raised on one rank: its type, its message, and how long the call took."""


def attempt(call: Any) -> Attempt:
    start = time.monotonic()
    try:
        call()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "loaded", "", time.monotonic() - start


def host_group_works() -> float:
    """A new group of the host over WORLD, and an all-reduce on it: what a host does next."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    dist.destroy_process_group(group)
    return value.item()


def timed_load(checkpoint: str, layout: dict[str, int], overrides: dict[str, Any]) -> Attempt:
    from megastart import load_hf_checkpoint

    with megatron(layout):
        chunks = build(checkpoint)
        return attempt(
            lambda: load_hf_checkpoint(chunks, checkpoint, settings=settings(**overrides))
        )


def load_per_rank_settings(
    checkpoint: str, layout: dict[str, int], overrides_by_rank: dict[int, dict[str, Any]]
) -> Attempt:
    """A load, each rank with its own settings overrides."""
    import torch.distributed as dist

    return timed_load(checkpoint, layout, overrides_by_rank.get(dist.get_rank(), {}))


def load_with_resolved_settings(checkpoint: str, layout: dict[str, int]) -> Attempt:
    """A load with this process's resolved settings (its environment), as a host's is."""
    from megastart import load_hf_checkpoint

    with megatron(layout):
        chunks = build(checkpoint)
        return attempt(lambda: load_hf_checkpoint(chunks, checkpoint))


def load_seeing_shared_segments(
    checkpoint: str, layout: dict[str, int], ranks_per_node: int, overrides: dict[str, Any]
) -> tuple[set[str], set[str], set[str]]:
    """What this rank had mapped while it copied its slices (as ``/proc/self/maps`` names it):
    the loader's shared segments and the checkpoint's files; and the segments still mapped
    after the load."""
    from megastart import load_hf_checkpoint
    from megastart.loader.stream import stream
    from megastart.loader.stream.shm import PREFIX

    def mapped(part: str) -> set[str]:
        lines = open("/proc/self/maps").read().splitlines()
        return {line.split(None, 5)[5] for line in lines if part in line and len(line.split()) > 5}

    segments: set[str] = set()
    files: set[str] = set()
    original = stream.Stream.apply

    def apply_and_look(self: Any, index: int, payload: Any, *slots: Any) -> None:
        segments.update(mapped(PREFIX))
        files.update(os.path.basename(f) for f in mapped(checkpoint))
        original(self, index, payload, *slots)

    stream.Stream.apply = apply_and_look  # type: ignore[method-assign]
    try:
        with simulated_nodes(ranks_per_node), megatron(layout):
            chunks = build(checkpoint)
            load_hf_checkpoint(chunks, checkpoint, settings=settings(**overrides))
    finally:
        stream.Stream.apply = original  # type: ignore[method-assign]
    return segments, files, mapped(PREFIX)


def parameter_shapes(checkpoint: str, layout: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """This rank's loaded parameters (and buffers), canonical name -> local shape."""
    from megastart.loader.checkpoint import read_metadata
    from megastart.loader.mapping.model import local_needs

    with megatron(layout):
        params = local_needs(build(checkpoint), read_metadata(checkpoint, allow_pickle=False))[0]
        return {p.name: p.shape for p in params}


def load_with_mtp(checkpoint: str, layout: dict[str, int]) -> tuple[int, dict[str, torch.Tensor]]:
    """This rank's TP rank and parameters after a strict load into a model built with one
    multi-token-prediction layer (on the last pipeline stage)."""
    from megatron.core import parallel_state

    from megastart import load_hf_checkpoint

    with megatron(layout):
        chunks = build(checkpoint, mtp_num_layers=1)
        load_hf_checkpoint(chunks, checkpoint, settings=settings(strict=True))
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        return tp_rank, {n: p.detach().clone() for n, p in chunks[-1].named_parameters()}
