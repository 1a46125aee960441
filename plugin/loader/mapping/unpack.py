"""Packed 4-bit weights, dequantised on the rank that receives them, as Megatron-Bridge's hooks
dequantise the whole tensor.

gpt-oss ships its experts in MXFP4: ``X_blocks`` (``[..., G, 16]`` bytes, two E2M1 values
each, low nibble first) with ``X_scales`` (``[..., G]``, an E8M0 exponent per group of 32);
``GPTOSSBridge``'s hook dequantises them with ``dequantize_mxfp4``. Kimi-K2.5 ships its
routed experts in compressed-tensors' INT4 ``pack-quantized``: ``X_packed`` (``[out, in / 8]``
int32, eight offset-binary nibbles each, lowest first) with ``X_scale`` (``[out, G]``);
``KimiK25VLBridge``'s hook dequantises them with ``dequantize_int4``. Both compute each
element from its own nibble and its group's scale, in float32 (MXFP4: its table's bf16 value
times a power of two), rounded once to bf16, whatever the parameter's dtype; so the rows and
columns a rank takes, dequantised alone, are bit for bit the bridge's.

The values travel as stored (half a byte an element), the scales just before them; a
transform narrows :class:`Packed` by indexing it as it would the dequantised tensor, and the
piece is dequantised only when it is copied (:meth:`Packed.dequantised`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megastart.loader.checkpoint.quantised import MXFP4

if TYPE_CHECKING:
    import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""MXFP4's sixteen values by nibble (Megatron-Bridge's and transformers' table)."""
MXFP4_GROUP = 32


@dataclass(frozen=True, slots=True)
class Packed:
    """Values of a packed weight (any leading index already taken) and the scales of the same
    rows, with the dequantised columns ``[first, stop)`` of its last dim kept; indexing narrows
    it as it would the dequantised tensor, nothing is computed until :meth:`dequantised`."""

    values: torch.Tensor
    scales: torch.Tensor
    packing: str
    first: int
    stop: int

    @classmethod
    def whole(cls, values: torch.Tensor, scales: torch.Tensor, packing: str) -> Packed:
        return cls(values, scales, packing, 0, _columns(values, packing))

    @property
    def ndim(self) -> int:
        return self.scales.ndim

    @property
    def shape(self) -> torch.Size:
        import torch

        return torch.Size((*self.scales.shape[:-1], self.stop - self.first))

    @property
    def device(self) -> torch.device:
        return self.values.device

    def __getitem__(self, key: Any) -> Packed:
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > self.ndim or any(k is Ellipsis or k is None for k in key):
            raise TypeError(f"Packed takes an index per dim, got {key!r}")
        first, stop = self.first, self.stop
        if len(key) == self.ndim:  # the last (packed) dim: a contiguous range of it
            last, key = key[-1], key[:-1]
            if not isinstance(last, slice) or last.step not in (None, 1):
                raise TypeError(f"Packed takes contiguous columns, got {last!r}")
            start, end, _ = last.indices(stop - first)
            first, stop = first + start, first + max(start, end)
        # the leading dims of the values are the scales' (the groups and their bytes follow)
        return Packed(self.values[key], self.scales[key], self.packing, first, stop)

    def dequantised(self) -> torch.Tensor:
        """The piece in bf16, as the bridge's hook computes each of its elements."""
        if self.stop <= self.first:
            return self.scales.new_empty((*self.scales.shape[:-1], 0)).bfloat16()
        group = _columns(self.values, self.packing) // self.scales.shape[-1]
        g0, g1 = self.first // group, -(-self.stop // group)
        scales = self.scales[..., g0:g1]
        if self.packing == MXFP4:
            out = _mxfp4(self.values[..., g0:g1, :], scales)
        else:
            per = group // 8
            out = _int4(self.values[..., g0 * per : g1 * per], scales, group)
        return out[..., self.first - g0 * group : self.stop - g0 * group]


def _columns(values: torch.Tensor, packing: str) -> int:
    """The dequantised length of the last dim of ``values``."""
    return values.shape[-2] * MXFP4_GROUP if packing == MXFP4 else values.shape[-1] * 8


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Megatron-Bridge's ``dequantize_mxfp4`` (bf16), on any rows of the blocks."""
    import torch

    *prefix, groups, size = blocks.shape
    rows = blocks.reshape(-1, size)
    exponents = (scales.to(torch.int32) - 127).reshape(-1, 1)
    table = torch.tensor(E2M1, dtype=torch.bfloat16, device=blocks.device)
    out = torch.empty(rows.shape[0], size * 2, dtype=torch.bfloat16, device=blocks.device)
    out[:, 0::2] = table[(rows & 0x0F).long()]
    out[:, 1::2] = table[(rows >> 4).long()]
    torch.ldexp(out, exponents, out=out)
    return out.reshape(*prefix, groups * size * 2)


def _int4(packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """Megatron-Bridge's ``dequantize_int4`` (bf16), on any rows and whole groups (of a
    multiple of 8 elements: whole words)."""
    import torch

    *prefix, words = packed.shape
    shifts = torch.arange(8, device=packed.device) * 4
    values = ((packed.unsqueeze(-1) >> shifts) & 0xF).float().reshape(*prefix, words * 8) - 8
    return (values * scales.float().repeat_interleave(group, dim=-1)).to(torch.bfloat16)
