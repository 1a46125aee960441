"""What every transform shares: the shard a rank holds, the row range of an HF tensor a
block holds, the :class:`Transform` protocol and the helper that places a row range.

See :mod:`megastart.loader.mapping.transforms` for the transforms themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]
Piece = tuple[int, int, "torch.Tensor"]
Named = tuple[str, Shape]
"""An HF tensor's name and shape."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Where this rank's parameter sits in the tensor-parallel split, and the attention dims."""

    tp_rank: int
    tp_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    expert_tp_rank: int | None = None
    """Rank in Megatron's expert-tensor-parallel group (None: experts split like ``tp_rank``)."""
    expert_tp_size: int | None = None
    """Size of that group, which may differ from ``tp_size`` (``expert_tensor_parallel_size``)."""


@dataclass(frozen=True, slots=True)
class Rows:
    """The dim-0 range ``[start, stop)`` of an HF tensor of ``total`` rows that a block holds."""

    start: int
    stop: int
    total: int

    def __reduce__(self) -> tuple[type[Rows], tuple[int, int, int]]:
        return Rows, (self.start, self.stop, self.total)  # as a plan's slots (plan.Slot)


class Transform(Protocol):
    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]: ...

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]: ...

    def pieces(
        self, inputs: Sequence[torch.Tensor], local: Shape, shard: Shard
    ) -> Iterator[Piece]: ...


def expect(hf: Sequence[Named], wanted: Sequence[Shape]) -> list[str]:
    return [
        f"HF tensor {name!r} has shape {list(got)}, expected {list(want)}"
        for (name, got), want in zip(hf, wanted, strict=True)
        if tuple(got) != tuple(want)
    ]


def place(
    source: torch.Tensor, rows: Rows, lo: int, hi: int, dest: int, cols: slice | None = None
) -> Iterator[Piece]:
    """The rows ``[lo, hi)`` of the HF tensor that ``source`` holds, written from parameter row ``dest``."""
    first, stop = max(lo, rows.start), min(hi, rows.stop)
    if first >= stop:
        return
    if first == rows.start and stop == rows.stop:  # the whole block: index only the columns
        block = source if cols is None else source[:, cols]
    else:
        below = slice(first - rows.start, stop - rows.start)
        block = source[below] if cols is None else source[below, cols]
    yield dest + first - lo, dest + stop - lo, block


class RowBlocks:
    """``pieces`` of whole tensors, in terms of ``blocks`` of row ranges (one HF tensor each)."""

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        raise NotImplementedError

    def pieces(self, inputs: Sequence[torch.Tensor], local: Shape, shard: Shard) -> Iterator[Piece]:
        for index, source in enumerate(inputs):
            whole = Rows(0, source.shape[0], source.shape[0])
            yield from self.blocks(index, source, whole, local, shard)
