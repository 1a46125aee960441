"""Which slots a rank copies from the page cache into CUDA straight: worked out once per load,
on meta tensors, from the transforms' blocks (nothing is read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megastart.loader.checkpoint import ITEMSIZE, CheckpointMeta
from megastart.loader.mapping.needs import Need
from megastart.loader.mapping.transforms import TRANSFORMS, Shard
from megastart.loader.plan.buckets import Slot

if TYPE_CHECKING:
    import torch


def consumers_of(needs: list[Need]) -> dict[str, list[tuple[Need, int]]]:
    """HF tensor name -> the needs that take it, and as which input."""
    consumers: dict[str, list[tuple[Need, int]]] = {}
    for need in needs:
        for index, name in enumerate(need.inputs):
            consumers.setdefault(name, []).append((need, index))
    return consumers


def goes_straight(
    slot: Slot,
    meta: CheckpointMeta,
    consumers: list[tuple[Need, int]],
    tensors: dict[tuple[int, str], torch.Tensor],
    shard: Shard,
) -> bool:
    """Whether :meth:`Stream.apply` copies a piece of ``slot`` from the page cache into CUDA
    straight (:meth:`~megastart.loader.stream.copier.Copier.copy`): a contiguous view of the file's
    bytes, in its parameter's dtype, into a contiguous slice of it. Not a strided piece (a
    row-parallel slice's columns), a converted or computed one, a quantised weight or its
    scales, or a tensor the file does not align. Worked out on meta tensors: nothing is read."""
    import torch

    entry = meta.tensors[slot.name]
    if entry.row_range(slot.rows.start, slot.rows.stop).start % ITEMSIZE[entry.dtype]:
        return False  # copied out of the mapping first (:meth:`Window.view`)
    held = torch.empty(slot.shape, dtype=getattr(torch, entry.dtype), device="meta")
    for need, index in consumers:
        if index >= len(need.hf) or (need.scales and need.scales[index]):
            continue
        param = tensors[(need.param.chunk, need.param.local_name)]
        for first, stop, piece in TRANSFORMS[need.transform].blocks(
            index, held, slot.rows, need.param.shape, shard
        ):
            if (
                (piece is held or piece._base is held)
                and piece.dtype == param.dtype
                and piece.is_contiguous()
                and param.data[first:stop].is_contiguous()
            ):
                return True
    return False
