"""An ``AutoMapping`` with ``permute_dims``: the HF tensor stored transposed (Ernie-4.5-VL's
routers, ``[hidden, experts]`` on disk; Gemma 3 VL's ``mm_input_projection_weight``), turned
to Megatron's orientation before its module's own transform cuts the rank's slice.

A row block of the stored tensor is a column block of the parameter, which a piece (whole
rows of the parameter) cannot hold: such a tensor travels whole (every one a bridge
permutes is a router or a projector, far under a bucket), and a block that is not the whole
tensor is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from megastart.loader.mapping.transform_base import (
    Named,
    Piece,
    RowBlocks,
    Rows,
    Shape,
    Shard,
    Transform,
)

if TYPE_CHECKING:
    import torch


def permuted_name(dims: Sequence[int], inner: str) -> str:
    """The transform name of :class:`Permuted` (``permuted:1.0:replicated``)."""
    return f"permuted:{'.'.join(map(str, dims))}:{inner}"


class Permuted(RowBlocks):
    """``inner`` on the HF tensor with its dims permuted by ``dims`` (``torch.permute``, as
    the bridge's ``AutoMapping.hf_to_megatron`` permutes it first)."""

    def __init__(self, dims: Sequence[int], inner: Transform) -> None:
        self.dims = tuple(dims)
        self.inner = inner

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        if sorted(self.dims) != list(range(len(got))):
            return [f"HF tensor {name!r} has shape {list(got)}, which {self.dims} does not permute"]
        turned = tuple(got[d] for d in self.dims)
        return self.inner.check([(name, turned)], local, shard)

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        if rows.start != 0 or rows.stop != rows.total:
            raise ValueError(
                f"a tensor stored with its dims permuted {self.dims} arrived in rows "
                f"[{rows.start}, {rows.stop}) of {rows.total}: it must travel whole; raise "
                "bucket_mb above its size"
            )
        turned = source.permute(self.dims)
        whole = Rows(0, turned.shape[0], turned.shape[0])
        return self.inner.blocks(index, turned, whole, local, shard)
