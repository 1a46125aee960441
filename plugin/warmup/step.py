"""One warmup step (an operation on one group's communicator, issued asynchronously), and the
buffer it sends: shared by the collective steps (:mod:`.ops`) and the point-to-point ones
(:mod:`.p2p`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Step:
    group: str
    """Name of the group the communicator belongs to (``"world"`` for WORLD's pairs)."""
    op: str
    """``"<operation>:<message bytes>"``, e.g. ``"reduce_scatter:33554432"``."""
    ranks: tuple[int, ...]
    """Global ranks taking part (the pair, for point-to-point)."""
    start: Callable[[], list[dist.Work]]
    """Allocates the buffers and issues the operation asynchronously."""


def buffer(nbytes: int, multiple: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer of about ``nbytes``, its length a multiple of ``multiple``."""
    import torch

    per = max(1, -(-nbytes // (4 * multiple)))
    return torch.ones(per * multiple, dtype=torch.float32, device=device)
