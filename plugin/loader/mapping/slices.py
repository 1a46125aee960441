"""The transforms of one HF tensor (or a few) into a rank's slice of a Megatron parameter:
replicated, row- and column-parallel, the vocabulary, fused gate/up and QKV, and the same
for routed experts over expert tensor parallelism. :mod:`megastart.loader.mapping.transforms` names
them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from megastart.loader.mapping.transform_base import (
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


class Replicated(RowBlocks):
    """Every rank holds the whole tensor (norms)."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        return expect(hf, [local])

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        return place(source, rows, 0, rows.total, 0)


class RowParallel(RowBlocks):
    """Megatron's row-parallel layers (``linear_proj``, ``linear_fc2``) split the input dim (1);
    their bias is whole on every rank."""

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        if len(local) == 1:
            return expect(hf, [local])
        return expect(hf, [(local[0], local[1] * shard.tp_size, *local[2:])])

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        if len(local) == 1:
            return place(source, rows, 0, rows.total, 0)
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
        expert = expert_shard(shard)
        where = f"expert-tensor-parallel rank {expert.tp_rank} of {expert.tp_size}"
        return [f"{problem} ({where})" for problem in self.inner.check(hf, local, expert)]

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        return self.inner.blocks(index, source, rows, local, expert_shard(shard))


def expert_shard(shard: Shard) -> Shard:
    if shard.expert_tp_size is None or shard.expert_tp_rank is None:
        return shard
    return replace(shard, tp_rank=shard.expert_tp_rank, tp_size=shard.expert_tp_size)


class RowRange(RowBlocks):
    """Rows ``[start, stop)`` of the HF tensor as the whole parameter (DeepSeek-V4's
    hyper-connection alphas, each one element of a stacked ``[3]`` scale)."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        ((name, got),) = hf
        if not got or got[0] < self.stop or (self.stop - self.start, *got[1:]) != tuple(local):
            return [
                f"HF tensor {name!r} has shape {list(got)}, expected rows [{self.start}, "
                f"{self.stop}) of it to make {list(local)}"
            ]
        return []

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        return place(source, rows, self.start, self.stop, 0)
