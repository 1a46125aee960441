"""Megatron's world as this process sees it, and the latches that hold for one world only.

A process may tear Megatron's parallel state down and build a new one
(NeMo-RL converts a checkpoint in one world, calls ``destroy_model_parallel``,
and trains in the next). What ran once in the old world (the first step's hook,
the communicator warmup) must run once again in the new one: its groups are
cold. megastart's megatron-core adapter calls :func:`new_world` after every
``destroy_model_parallel``.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_world = 0


def new_world() -> None:
    """Megatron's parallel state was destroyed: every :class:`OncePerWorld` is due again."""
    global _world
    with _lock:
        _world += 1


class OncePerWorld:
    """Whether something ran in the current world (set by :meth:`mark`)."""

    def __init__(self) -> None:
        self._marked_in: int | None = None

    @property
    def done(self) -> bool:
        return self._marked_in == _world

    def mark(self) -> None:
        self._marked_in = _world

    def clear(self) -> None:
        self._marked_in = None


def capturing_cuda_graph() -> bool:
    """Whether this thread's CUDA stream is capturing a graph: no hook or warmup runs then (a
    collective would be recorded into the graph, not run)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def training_device() -> Any:
    """The device this rank trains on, even while the host has offloaded the parameters."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
