"""What each rank runs in the hostile-checkpoint tests (module-level, so RankPool can pickle
them by reference): a checkpoint replaced mid-load, a file-handle limit, the loader's lines."""

from __future__ import annotations

import logging
import os
import resource
import shutil
import time
from pathlib import Path
from typing import Any

from support.loader_ranks import build, load_expecting_error, megatron, settings


def load_while_replacing_the_checkpoint(checkpoint: str, overrides: dict[str, Any]) -> str:
    """Rank 0 replaces every shard (``os.replace`` of a copy: a new inode, the same layout)
    right after it applies its first bucket, as a sync job or a second save would."""
    import torch.distributed as dist

    from megastart.loader.stream import stream

    original = stream.Stream.apply

    def apply_then_replace(self: Any, index: int, payload: Any, *slots: Any) -> None:
        original(self, index, payload, *slots)
        if index == 0:
            for shard in sorted(Path(checkpoint).glob("*.safetensors")):
                shutil.copyfile(shard, f"{shard}.new")
                os.replace(f"{shard}.new", shard)

    if dist.get_rank() == 0:
        stream.Stream.apply = apply_then_replace  # type: ignore[method-assign]
    try:
        return load_expecting_error(checkpoint, {"tp": 2}, overrides)
    finally:
        stream.Stream.apply = original  # type: ignore[method-assign]


def timed_error(checkpoint: str, overrides: dict[str, Any], build_from: str) -> tuple[str, float]:
    """The error this rank's load raised, and how long the load took to raise it (the model
    built beforehand from ``build_from``'s config)."""
    from megastart import load_hf_checkpoint

    with megatron({"tp": 2}):
        chunks = build(build_from)
        start = time.monotonic()
        try:
            load_hf_checkpoint(chunks, checkpoint, settings=settings(**overrides))
        except Exception as e:
            return f"{type(e).__name__}: {e}", time.monotonic() - start
        return "loaded", time.monotonic() - start


def load_with_few_file_handles(checkpoint: str, overrides: dict[str, Any], spare: int) -> str:
    """The load's outcome with this process allowed ``spare`` more open files than it holds
    when the load starts (as a container's ``ulimit -n`` would); ``"loaded"`` or the error."""
    from megastart import load_hf_checkpoint

    with megatron({"tp": 2}):
        chunks = build(checkpoint)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        held = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (held + spare, hard))
        try:
            load_hf_checkpoint(chunks, checkpoint, settings=settings(**overrides))
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return "loaded"


def load_for_host(checkpoint: str, host_dequantises: frozenset[str]) -> tuple[str, list[str]]:
    """``load_for_engine`` as a host whose loader dequantises ``host_dequantises``: its outcome
    (``"left to the host"``, ``"loaded"`` or the error) and the lines this rank logged."""
    from megatron.core import parallel_state

    from megastart.loader.api import load_for_engine
    from megastart.records import EngineContext

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("megastart")
    logger.addHandler(handler)
    try:
        with megatron({"tp": 2}):
            engine = EngineContext(
                host="test",
                host_version="0",
                model_chunks=build(checkpoint),
                parallel_state=parallel_state,
                device="cpu",
                host_dequantises=host_dequantises,
            )
            try:
                report = load_for_engine(engine, checkpoint)
            except Exception as e:
                return f"{type(e).__name__}: {e}", lines
            return ("left to the host" if report is None else "loaded"), lines
    finally:
        logger.removeHandler(handler)


def load_with_stalled_metadata(
    checkpoint: str, overrides: dict[str, Any], stall_s: float
) -> tuple[str, float]:
    """Rank 0's read of the shards' headers stalls for ``stall_s`` (storage that does not
    answer); the error each rank raised, and how long it took."""
    import torch.distributed as dist

    from megastart.loader.checkpoint import headers

    original = headers.read_headers

    def stalled(*args: Any) -> Any:
        time.sleep(stall_s)
        return original(*args)

    if dist.get_rank() == 0:
        headers.read_headers = stalled
    try:
        return timed_error(checkpoint, overrides, checkpoint)
    finally:
        headers.read_headers = original
