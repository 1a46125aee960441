"""Transforms: how full HF tensors become this rank's shard of one Megatron parameter.

Each transform does two things, both on the receiving rank:

* ``check(hf, local_shape, shard)``: the problems (empty if none) with the HF
  tensors (``(name, shape)`` pairs) for a parameter of ``local_shape`` on this
  shard; run in the plan phase, before any byte moves.
* ``blocks(index, source, rows, local_shape, shard)``: the ``(first_row,
  stop_row, tensor)`` pieces of the local parameter that rows ``rows`` of HF
  input ``index`` (held in ``source``) make; the receiver copies each into
  those rows of the parameter and records them for the coverage check. Writing
  blocks in place avoids materialising a fused full-size tensor, and taking a
  row range of one input lets a tensor larger than a bucket travel in several
  buckets (and fused inputs travel apart).
* ``pieces(inputs, local_shape, shard)``: the same for whole input tensors.

Rows are along dim 0, the dim Megatron's column-parallel layers split.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from megastart.loader import interleave
from megastart.loader.transform_base import (
    Named,
    Piece,
    RowBlocks,
    Rows,
    Shape,
    Shard,
    Transform,
    expect,
    place,
)

if TYPE_CHECKING:
    import torch

__all__ = ["TRANSFORMS", "Named", "Piece", "Rows", "Shape", "Shard", "Transform"]


class Replicated(RowBlocks):
    """Every rank holds the whole tensor (norms)."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        return expect(hf, [local])

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        return place(source, rows, 0, rows.total, 0)


class RowParallel(RowBlocks):
    """Megatron's row-parallel layers (``linear_proj``, ``linear_fc2``) split the input dim (1)."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        return expect(hf, [(local[0], local[1] * shard.tp_size, *local[2:])])

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        n = local[1]
        cols = slice(shard.tp_rank * n, (shard.tp_rank + 1) * n)
        return place(source, rows, 0, rows.total, 0, cols)


class ColumnParallel(RowBlocks):
    """Megatron's column-parallel layers split the output dim (0) into TP row blocks; a layer
    held whole on every rank (Transformer Engine's duplicated MLA down projections) takes it all."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((_, got),) = hf
        if tuple(got) == tuple(local):
            return []
        return expect(hf, [(local[0] * shard.tp_size, *local[1:])])

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        n = local[0]
        first = 0 if n == rows.total else shard.tp_rank * n
        return place(source, rows, first, first + n, 0)


class ColumnShards(RowBlocks):
    """Column-parallel rows where a rank may hold a replica of a smaller set of shards: the HF
    tensor's rows in ``S`` shards of the local size, rank ``r`` taking shard
    ``r // (TP / S)`` (MiniMax-M2's full-dimension K norm when key heads < TP, as its
    ``_FullDimRMSNorm.sharded_state_dict`` declares and its bridge mapping loads)."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        shards, rest = divmod(got[0], local[0]) if got else (0, 1)
        if rest or not shards or shard.tp_size % shards or tuple(got[1:]) != tuple(local[1:]):
            return [
                f"HF tensor {name!r} has shape {list(got)}, expected [S * {local[0]}, "
                f"{', '.join(map(str, local[1:]))}] with S dividing the TP size {shard.tp_size}"
            ]
        return []

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        n = local[0]
        replicas = shard.tp_size // (rows.total // n)
        first = shard.tp_rank // replicas * n
        return place(source, rows, first, first + n, 0)


class Squeezed(RowBlocks):
    """A replicated tensor stored with a leading dim of one (Ernie-4.5's ``[1, E]`` expert
    bias for an ``[E]`` parameter), or as the parameter."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        if tuple(got) in (tuple(local), (1, *local)):
            return []
        return [f"HF tensor {name!r} has shape {list(got)}, expected {list(local)} or [1, ...]"]

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        if source.ndim == len(local) + 1:
            return iter([(0, local[0], source[0])])
        return place(source, rows, 0, rows.total, 0)


class SwappedHalves(RowBlocks):
    """``inner`` on the HF tensor with the two halves of its columns swapped (MiMo's MTP
    ``input_proj``: its bridge's hook stores ``[hidden, embedding]`` as Megatron's
    ``[embedding, hidden]`` order), one row block at a time."""

    def __init__(self, inner: Transform) -> None:
        self.inner = inner

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        if len(got) < 2 or got[1] % 2:
            return [f"HF tensor {name!r} has shape {list(got)}: no even dim 1 to swap halves of"]
        return self.inner.check(hf, local, shard)

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        import torch

        half = source.shape[1] // 2
        swapped = torch.cat((source[:, half:], source[:, :half]), dim=1)
        return self.inner.blocks(index, swapped, rows, local, shard)


class Vocab(RowBlocks):
    """Embedding / output rows: the padded vocabulary split along dim 0; padded rows are zero.

    The zero rows are written with the block that holds the HF tensor's last row.
    """

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        padded = local[0] * shard.tp_size
        if tuple(got[1:]) != tuple(local[1:]) or got[0] > padded:
            return [
                f"HF tensor {name!r} has shape {list(got)}, expected [V, {', '.join(map(str, local[1:]))}] "
                f"with V <= {padded} (Megatron's padded vocabulary)"
            ]
        return []

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        import torch

        n = local[0]
        start = shard.tp_rank * n
        have = max(0, min(n, rows.total - start))
        yield from place(source, rows, start, start + have, 0)
        if have < n and rows.stop == rows.total:
            zeros = torch.zeros((n - have, *local[1:]), dtype=source.dtype, device=source.device)
            yield have, n, zeros


class GateUp(RowBlocks):
    """SwiGLU ``linear_fc1`` = [gate shard; up shard] on each TP rank."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        if local[0] % 2:
            return [f"the fused gate/up parameter has an odd number of rows {local[0]}"]
        full = (local[0] // 2 * shard.tp_size, *local[1:])
        return expect(hf, [full, full])

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        n = local[0] // 2
        return place(source, rows, shard.tp_rank * n, (shard.tp_rank + 1) * n, index * n)


class Qkv(RowBlocks):
    """Fused QKV (weight or bias): per query group ``[its q heads; k; v]``; TP splits by group."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        heads, groups, d, tp = (
            shard.num_heads,
            shard.num_query_groups,
            shard.head_dim,
            shard.tp_size,
        )
        if heads % groups or groups % tp:
            return [
                f"tensor-parallel size {tp} must divide the {groups} query groups (KV heads), "
                f"which must divide the {heads} attention heads; choose a TP size that divides {groups}"
            ]
        rest = tuple(local[1:])
        if local[0] != (heads + 2 * groups) * d // tp:
            return [
                f"the fused QKV parameter needs (heads + 2 * query groups) * head_dim / TP = "
                f"({heads} + 2 * {groups}) * {d} / {tp} rows, it has {local[0]}"
            ]
        return expect(hf, [(heads * d, *rest), (groups * d, *rest), (groups * d, *rest)])

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        d = shard.head_dim
        q_rows = shard.num_heads // shard.num_query_groups * d
        size, within = ((q_rows, 0), (d, q_rows), (d, q_rows + d))[index]  # q, k, v
        local_groups = shard.num_query_groups // shard.tp_size
        for j in range(local_groups):
            g = shard.tp_rank * local_groups + j
            yield from place(source, rows, g * size, (g + 1) * size, j * (q_rows + 2 * d) + within)


class ExpertTensorParallel(RowBlocks):
    """A routed expert's weight: ``inner``, split over the expert-tensor-parallel group, not TP."""

    def __init__(self, inner: Transform) -> None:
        self.inner = inner

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        expert = _expert_shard(shard)
        where = f"expert-tensor-parallel rank {expert.tp_rank} of {expert.tp_size}"
        return [f"{problem} ({where})" for problem in self.inner.check(hf, local, expert)]

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        return self.inner.blocks(index, source, rows, local, _expert_shard(shard))


def _expert_shard(shard: Shard) -> Shard:
    if shard.expert_tp_size is None or shard.expert_tp_rank is None:
        return shard
    return replace(shard, tp_rank=shard.expert_tp_rank, tp_size=shard.expert_tp_size)


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
        one = source[self.expert - rows.start]
        return self.inner.blocks(index, one, Rows(0, one.shape[0], one.shape[0]), local, shard)


class FusedGatedExpert(RowBlocks):
    """Expert ``expert``'s ``linear_fc1`` from a fused gate/up HF tensor
    (``FusedGatedExpertMapping``): ``[E, 2I, H]`` (gate rows, then up rows), ``[E, H, 2I]``
    (the same, stored transposed: read strided) or ``[E, 2, I, H]``; then split over expert
    tensor parallelism as :class:`GateUp`. Orientation is told apart by shape, as
    Megatron-Bridge's ``_align_expert_weight_to_shape`` tells it (a square one is as stored)."""

    def __init__(self, expert: int) -> None:
        self.expert = expert
        self.inner = ExpertTensorParallel(GateUp())

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

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        if not rows.start <= self.expert < rows.stop:
            return iter(())
        one = source[self.expert - rows.start]
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
        return (local[0] // 2 * _expert_shard(shard).tp_size, *local[1:])


def _oriented(tensor: torch.Tensor, shape: Shape) -> torch.Tensor:
    """``tensor`` as ``shape``: itself, or (a 2-D one stored transposed) a transposed view."""
    return tensor if tuple(tensor.shape) == tuple(shape) else tensor.t()


class _Transforms(dict[str, Transform]):
    """The transforms by name; a parameterised name makes its transform on first use:
    ``fused_expert:{e}:{inner}``, ``fused_gated_expert:{e}``, ``zero_centred:{dtype}:{inner}``,
    ``swapped_halves:{inner}``
    and ``interleave:...`` (:mod:`megastart.loader.interleave`)."""

    def __missing__(self, name: str) -> Transform:
        kind, _, args = name.partition(":")
        expert, _, inner = args.partition(":")
        if kind == "interleave":
            made: Transform = interleave.parse(args)
        elif kind == "swapped_halves" and args in self:
            made = SwappedHalves(self[args])
        elif kind == "zero_centred" and inner in self:
            made = interleave.ZeroCentred(self[inner], expert)
        elif kind == "fused_expert" and inner in self:
            made = FusedExpert(int(expert), self[inner])
        elif kind == "fused_gated_expert" and expert.isdigit() and not inner:
            made = FusedGatedExpert(int(expert))
        else:
            raise KeyError(name)
        self[name] = made
        return made


TRANSFORMS: dict[str, Transform] = _Transforms(
    {
        "replicated": Replicated(),
        "row_parallel": RowParallel(),
        "column_parallel": ColumnParallel(),
        "vocab": Vocab(),
        "gate_up": GateUp(),
        "qkv": Qkv(),
        "column_shards": ColumnShards(),
        "squeezed": Squeezed(),
        "expert_gate_up": ExpertTensorParallel(GateUp()),
        "expert_row_parallel": ExpertTensorParallel(RowParallel()),
    }
)
"""Transform name (as used in mapping rules) -> transform; see :class:`_Transforms` for the
parameterised names of fused experts."""
