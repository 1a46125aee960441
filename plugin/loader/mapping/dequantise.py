"""FP8 block-scaled weights, dequantised on the rank that receives them.

DeepSeek-V3, DeepSeek-R1 and Kimi-K2 ship each projection as ``float8_e4m3fn``
with a float32 ``weight_scale_inv`` per block of 128x128 elements. The weight
travels as stored (one byte an element, half of bf16), its scales travel just
before it (:func:`megastart.loader.plan.buckets.build_plan`), and each receiving rank
turns only the rows and columns its slices take into the parameter's dtype: the
float32 element times its block's scale, rounded once, which is what
Megatron-Bridge's ``dequantize_fp8_blockwise`` and DeepSeek's own ``weight_dequant``
compute.

A transform places a piece of its input by indexing it (``source[rows]``,
``source[:, cols]``); :class:`BlockScaled` is such an input that remembers where
each index falls in the whole tensor and dequantises only when the piece is
copied (:meth:`BlockScaled.dequantised`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class BlockScaled:
    """Rows ``[row, row + len(weight))`` and columns ``[col, ...)`` of an FP8 weight, with the
    scales of the whole weight; indexing narrows it, nothing is computed until :meth:`dequantised`."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    dtype: torch.dtype
    """The parameter's dtype, the one the piece becomes."""
    row: int = 0
    col: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __getitem__(self, key: Any) -> BlockScaled:
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        first_row = _start(rows, self.weight.shape[0])
        first_col = _start(cols, self.weight.shape[1])
        return BlockScaled(
            self.weight[rows, cols],
            self.scale,
            self.block,
            self.dtype,
            self.row + first_row,
            self.col + first_col,
        )

    def dequantised(self) -> torch.Tensor:
        """The piece in :attr:`dtype`: each element times its block's scale, in float32."""
        rows, cols = self.weight.shape
        if rows == 0 or cols == 0:
            return self.weight.to(self.dtype)
        block_rows, block_cols = self.block
        r0, c0 = self.row // block_rows, self.col // block_cols
        r1, c1 = (self.row + rows - 1) // block_rows, (self.col + cols - 1) // block_cols
        scale = self.scale[r0 : r1 + 1, c0 : c1 + 1]
        scale = scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
        top, left = self.row - r0 * block_rows, self.col - c0 * block_cols
        scale = scale[top : top + rows, left : left + cols]
        return (self.weight.float() * scale).to(self.dtype)


def _start(index: Any, length: int) -> int:
    if not isinstance(index, slice) or index.step not in (None, 1):
        raise TypeError(f"BlockScaled takes contiguous slices, got {index!r}")
    return index.indices(length)[0]
