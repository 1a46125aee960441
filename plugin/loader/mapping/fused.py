"""Routed experts stored fused: every expert of a layer in one HF tensor along dim 0
(Megatron-Bridge's ``FusedExpertMapping`` and ``FusedGatedExpertMapping``, Step-3.5's stacked
experts, gpt-oss's ``gate_up_proj`` / ``down_proj``). A row block of such a tensor holds whole
experts, so a rank takes its experts' slices from the blocks that hold them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from megastart.loader.mapping.slices import ExpertTensorParallel, GateUp, expert_shard
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


class FusedExpert(RowBlocks):
    """Expert ``expert`` of HF tensors holding every expert along dim 0 (``[E, ...]``:
    Megatron-Bridge's ``FusedExpertMapping``, Step-3.5's stacked experts), made by ``inner``
    from that expert's slice of each.

    The HF tensors' rows are experts, so a row block holds whole experts and this one's
    slice is taken from the block that holds it, never from the whole tensor.
    """

    def __init__(self, expert: int, inner: Transform) -> None:
        self.expert = expert
        self.inner = inner

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        for name, got in hf:
            if len(got) < 2 or self.expert >= got[0]:
                return [
                    f"HF tensor {name!r} of shape {list(got)} has no expert {self.expert} in dim 0"
                ]
        return self.inner.check([(name, tuple(got[1:])) for name, got in hf], local, shard)

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        if not rows.start <= self.expert < rows.stop:
            return iter(())
        return self._expert_pieces(index, source[self.expert - rows.start], local, shard)

    def _expert_pieces(
        self, index: int, one: torch.Tensor, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        """The pieces of this expert's slice ``one`` of the HF tensor ``index``."""
        return self.inner.blocks(index, one, Rows(0, one.shape[0], one.shape[0]), local, shard)


class FusedGatedExpert(FusedExpert):
    """Expert ``expert``'s ``linear_fc1`` from a fused gate/up HF tensor
    (``FusedGatedExpertMapping``): ``[E, 2I, H]`` (gate rows, then up rows), ``[E, H, 2I]``
    (the same, stored transposed: read strided) or ``[E, 2, I, H]``; then split over expert
    tensor parallelism as :class:`GateUp`. Orientation is told apart by shape, as
    Megatron-Bridge's ``_align_expert_weight_to_shape`` tells it (a square one is as stored)."""

    def __init__(self, expert: int) -> None:
        super().__init__(expert, ExpertTensorParallel(GateUp()))

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        if local[0] % 2:
            return [f"the fused gate/up parameter has an odd number of rows {local[0]}"]
        half = self._half(local, shard)
        fused = (2 * half[0], *half[1:])
        accepted = [(2, *half), (2, *half[::-1]), fused]
        if len(fused) == 2 and fused[0] != fused[1]:
            accepted.append(fused[::-1])
        if len(got) < 2 or self.expert >= got[0] or tuple(got[1:]) not in accepted:
            shapes = " or ".join(str(["E", *a]) for a in accepted)
            return [
                f"HF tensor {name!r} has shape {list(got)}, expected {shapes} with expert "
                f"{self.expert} < E"
            ]
        return []

    def _expert_pieces(
        self, index: int, one: torch.Tensor, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        half = self._half(local, shard)
        if one.ndim == len(half) + 1 and one.shape[0] == 2:
            gate, up = (_oriented(one[i], half) for i in (0, 1))
        else:
            both = _oriented(one, (2 * half[0], *half[1:]))
            gate, up = both[: half[0]], both[half[0] :]
        return self.inner.pieces([gate, up], local, shard)

    @staticmethod
    def _half(local: Shape, shard: Shard) -> Shape:
        """The full (unsplit) shape of one of gate and up."""
        return (local[0] // 2 * expert_shard(shard).tp_size, *local[1:])


class EvenOddGateUp(RowBlocks):
    """gpt-oss's expert ``linear_fc1`` (weight or bias) from its slice of ``gate_up_proj``:
    gate is the even rows, up the odd ones (``[H, 2I]`` stored transposed, read strided);
    whole on each rank, as its bridge loads it only with expert tensor parallelism 1."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        tp = expert_shard(shard).tp_size
        if tp != 1:
            return [f"gpt-oss's experts load with expert tensor parallelism 1 only (it is {tp})"]
        return _expect_oriented(name, got, local)

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        whole = _oriented(source, local)
        half = local[0] // 2
        return iter([(0, half, whole[0::2]), (half, local[0], whole[1::2])])


class OrientedRowParallel(RowBlocks):
    """gpt-oss's expert ``linear_fc2`` from its slice of ``down_proj``: ``[I, H]`` (how
    transformers writes it; also a square one) transposed to Megatron's ``[H, I]`` as its
    bridge's hook does, then split over the input dim as :class:`RowParallel`."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        return _expect_oriented(name, got, (local[0], local[1] * shard.tp_size))

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        full = (local[0], local[1] * shard.tp_size)
        whole = source.t() if tuple(source.shape) == full[::-1] else source
        n = local[1]
        return iter([(0, local[0], whole[:, shard.tp_rank * n : (shard.tp_rank + 1) * n])])


def _oriented(tensor: torch.Tensor, shape: Shape) -> torch.Tensor:
    """``tensor`` as ``shape``: itself, or (a 2-D one stored transposed) a transposed view."""
    return tensor if tuple(tensor.shape) == tuple(shape) else tensor.t()


def _expect_oriented(name: str, got: Shape, shape: Shape) -> list[str]:
    """The problem with HF tensor ``name`` of shape ``got``, unless it is ``shape`` or (2-D)
    its transpose: what :func:`_oriented` reads."""
    if tuple(got) in (tuple(shape), tuple(shape[::-1])):
        return []
    return [f"HF tensor {name!r} has shape {list(got)}, expected {list(shape)} or its transpose"]
