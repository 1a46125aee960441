"""Rank functions of tests/gpu/test_gpu_warm_loads.py: the rank-0 loader into CUDA parameters,
with the CUDA driver's registrations recorded (the real calls still made) or refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from support.loader_ranks import build, megatron, settings

GLOO = {"transport": "gloo"}
"""Ranks sharing one GPU: NCCL refuses two ranks on one device (the benchmark's choice too)."""


class RecordingDriver:
    """The loader's CUDA driver, recording every registration and unregistration and what the
    driver answered; ``refuse``: answer ``cudaErrorMemoryAllocation`` (2) instead of
    registering, as a locked-memory limit does."""

    def __init__(self, driver: Any, refuse: bool) -> None:
        self._driver = driver
        self._refuse = refuse
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[tuple[int, int]] = []

    def register(self, address: int, nbytes: int, flags: int) -> int:
        if self._refuse:
            return 2
        error = self._driver.register(address, nbytes, flags)
        if not error:
            self.registered.append((address, flags))
        return error

    def unregister(self, address: int) -> int:
        error = self._driver.unregister(address)
        self.unregistered.append((address, error))
        return error


@contextmanager
def recorded_driver(refuse: bool) -> Iterator[list[RecordingDriver]]:
    """Every driver the loader makes in the block, recording (or refusing) its calls."""
    from megastart.loader.stream import registration

    made: list[RecordingDriver] = []
    original = registration.cuda_driver

    def recording(device: Any) -> Any:
        made.append(RecordingDriver(original(device), refuse))
        return made[-1]

    registration.cuda_driver = recording
    try:
        yield made
    finally:
        registration.cuda_driver = original


@contextmanager
def copied_straight() -> Iterator[list[int]]:
    """The bytes each copier of the block copied straight out of registered mappings."""
    from megastart.loader.stream.copier import Copier

    counts: list[int] = []
    original = Copier.close

    def close(self: Copier) -> None:
        counts.append(self.registered_bytes)
        original(self)

    Copier.close = close
    try:
        yield counts
    finally:
        Copier.close = original


def cuda_chunks(checkpoint: str) -> list[Any]:
    """This rank's chunks on its GPU (rank modulo the GPUs: several ranks may share one), their
    parameters NaN, so a parameter the load misses shows."""
    import torch.distributed as dist

    from megastart.harness.cpu import remove_shims

    chunks = build(checkpoint, context_parallel_size=1)
    remove_shims()
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    chunks = [chunk.to("cuda") for chunk in chunks]
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.fill_(float("nan"))
    return chunks


def load_into_cuda(
    checkpoint: str, layout: dict[str, int], overrides: dict[str, Any], refuse: bool = False
) -> dict[str, Any]:
    """Load into CUDA parameters; this rank's parameters (on the CPU), the driver's record,
    the bytes copied straight from registered mappings, and the loader's log lines."""
    import logging

    from megastart import load_hf_checkpoint

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines()
    logger = logging.getLogger("megastart")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with megatron(layout), recorded_driver(refuse) as drivers, copied_straight() as straight:
            chunks = cuda_chunks(checkpoint)
            load_hf_checkpoint(chunks, checkpoint, settings=settings(**GLOO, **overrides))
            torch.cuda.synchronize()
            params = {n: p.detach().cpu() for n, p in chunks[0].named_parameters()}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {
        "params": params,
        "registered": [r for d in drivers for r in d.registered],
        "unregistered": [u for d in drivers for u in d.unregistered],
        "straight_bytes": sum(straight),
        "lines": lines,
    }


def failing_load_into_cuda(
    checkpoint: str, layout: dict[str, int], overrides: dict[str, Any], failing_rank: int
) -> dict[str, Any]:
    """Load into CUDA parameters while ``failing_rank`` fails applying its third bucket; the
    error every rank raised, and the driver's record."""
    import torch.distributed as dist

    from megastart import load_hf_checkpoint
    from megastart.loader.stream.stream import Stream

    original = Stream.apply
    calls = [0]

    def apply(self: Stream, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected: applying a bucket failed")
        original(self, *args, **kwargs)

    if dist.get_rank() == failing_rank:
        Stream.apply = apply
    error = ""
    try:
        with megatron(layout), recorded_driver(False) as drivers:
            chunks = cuda_chunks(checkpoint)
            try:
                load_hf_checkpoint(chunks, checkpoint, settings=settings(**GLOO, **overrides))
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
    finally:
        Stream.apply = original
    return {
        "error": error,
        "registered": [r for d in drivers for r in d.registered],
        "unregistered": [u for d in drivers for u in d.unregistered],
    }
