"""Where a rank finds a bucket's slots (:class:`Source`: a buffer, or the files' pages), and
what keeps a bucket's buffer in use until every rank has read it (:class:`InUse`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from megastart.loader.plan.buckets import Slot
from megastart.loader.stream.prefetch import slot_view

if TYPE_CHECKING:
    import torch


class Source(Protocol):
    """Where a rank finds a bucket's slots: a buffer, or the files' pages (:class:`Window`)."""

    @property
    def page_locked(self) -> bool:
        """Whether the bytes are in memory registered with CUDA, with CUDA parameters."""
        ...

    def view(self, slot: Slot) -> torch.Tensor: ...

    def read_into(self, target: torch.Tensor, piece: torch.Tensor) -> bool:
        """``target[...] = piece`` (a piece of :meth:`view`) without a copy out of memory, where
        the source can; ``False``: the caller copies it."""
        ...


@dataclass(frozen=True, slots=True)
class Payload:
    """A bucket's bytes in a buffer (a buffer of shared memory, a received broadcast)."""

    data: torch.Tensor
    page_locked: ClassVar[bool] = True
    """With CUDA parameters, every buffer of the loader is page-locked (:meth:`Stream.buffers`)."""

    def read_into(self, target: torch.Tensor, piece: torch.Tensor) -> bool:
        return False

    def view(self, slot: Slot) -> torch.Tensor:
        return slot_view(self.data, slot)


@dataclass(slots=True)
class InUse:
    """A bucket some rank still reads: its broadcasts to other nodes, the node's report, its buffer."""

    sends: list[Any] = field(default_factory=list)
    done: Any = None
    release: Callable[[], None] | None = None
