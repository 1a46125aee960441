"""Parameters that gather, per head group, row ranges of several HF tensors: gated attention's
QKV, the gated delta net's input projection and convolution (Qwen3-Next, Qwen3.5), Mamba's
convolution; and zero-centred norms.

Megatron-Bridge builds such a parameter by merging whole HF tensors on TP rank 0 and
scattering the result (``merge_gdn_linear_weights``, ``merge_qkv_weights`` with an output
gate, ``ChunkedMapping``). Every one of those merges takes, for head group ``h``, a row range
``[offset + h * stride, + length)`` of one input per component, and lays the components out
per group (``[q, gate, k, v]`` of each group in turn) or per component (``[q; k; v; z; b; a]``
over the rank's groups). :class:`Interleave` says exactly that, as data, so a rank places
only its own groups' rows, from whichever row blocks hold them. Its name in
:data:`~megastart.loader.mapping.transforms.TRANSFORMS` carries the layout (:func:`spec`), the same on
every rank and for every TP size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megastart.loader.mapping.transform_base import (
    Named,
    Piece,
    RowBlocks,
    Rows,
    Shape,
    Shard,
    Transform,
    place,
)

if TYPE_CHECKING:
    import torch


ZERO = -1
"""A :class:`Component`'s ``input`` for rows of zeros (Gemma 4's K and V on layers that share
another's: its bridge's hook makes them zero), written with input 0's last block."""


@dataclass(frozen=True, slots=True)
class Component:
    """Group ``h``'s rows ``[offset + h * stride, + length)`` of HF input ``input``; with
    ``repeat``, its ``length / repeat`` rows each repeated ``repeat`` times (a per-head scalar
    gate expanded over the head's dims)."""

    input: int
    stride: int
    offset: int
    length: int
    repeat: int = 1

    @property
    def rows(self) -> int:
        """The HF rows one group takes."""
        return self.length // self.repeat


class Interleave(RowBlocks):
    """``groups`` head groups split over TP; each group's ``components`` laid out group by
    group (``group_major``) or component by component over the rank's groups."""

    def __init__(self, groups: int, group_major: bool, components: Sequence[Component]) -> None:
        self.groups = groups
        self.group_major = group_major
        self.components = tuple(components)

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        if self.groups % shard.tp_size:
            return [
                f"tensor-parallel size {shard.tp_size} must divide the {self.groups} head groups "
                "this parameter is split by"
            ]
        rows = self.groups // shard.tp_size * sum(c.length for c in self.components)
        if local[0] != rows:
            return [
                f"the parameter needs {rows} rows for its {self.groups} head groups, has {local[0]}"
            ]
        problems = []
        for index, (name, got) in enumerate(hf):
            mine = [c for c in self.components if c.input == index]
            if not mine:
                continue
            need = max(c.offset + (self.groups - 1) * c.stride + c.rows for c in mine)
            if not got or got[0] != need or tuple(got[1:]) != tuple(local[1:]):
                want = [need, *local[1:]]
                problems.append(f"HF tensor {name!r} has shape {list(got)}, expected {want}")
        return problems

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        mine = self.groups // shard.tp_size
        first = shard.tp_rank * mine
        before = 0  # rows of the components ahead of this one, per group
        for c in self.components:
            if c.input == ZERO and index == 0 and rows.stop == rows.total:
                yield from _zeros(
                    source, c, mine, self._group_rows if self.group_major else 0, before
                )
            elif c.input == index:
                for j in range(mine):
                    start = c.offset + (first + j) * c.stride
                    if self.group_major:
                        dest = j * self._group_rows + before
                    else:
                        dest = mine * before + j * c.length
                    if c.repeat == 1:
                        yield from place(source, rows, start, start + c.length, dest)
                    else:
                        yield from _repeated(source, rows, start, c, dest)
            before += c.length

    @property
    def _group_rows(self) -> int:
        return sum(c.length for c in self.components)


def _zeros(
    source: torch.Tensor, c: Component, mine: int, group_rows: int, before: int
) -> Iterator[Piece]:
    """``c.length`` rows of zeros per local group, laid out group by group (``group_rows``
    apart) or component by component (``group_rows`` 0: the groups' rows in a run)."""
    import torch

    zeros = torch.zeros((c.length, *source.shape[1:]), dtype=source.dtype, device=source.device)
    for j in range(mine):
        dest = j * group_rows + before if group_rows else mine * before + j * c.length
        yield dest, dest + c.length, zeros


def _repeated(
    source: torch.Tensor, rows: Rows, start: int, c: Component, dest: int
) -> Iterator[Piece]:
    """Rows ``[start, start + c.rows)`` each repeated ``c.repeat`` times, from ``dest`` on."""
    for row in range(max(start, rows.start), min(start + c.rows, rows.stop)):
        first = dest + (row - start) * c.repeat
        one = source[row - rows.start]
        yield first, first + c.repeat, one.unsqueeze(0).expand(c.repeat, *one.shape)


def spec(groups: int, group_major: bool, components: Sequence[Component]) -> str:
    """The transform name of an :class:`Interleave` (see :func:`parse`)."""
    parts = ",".join(f"{c.input}.{c.stride}.{c.offset}.{c.length}.{c.repeat}" for c in components)
    return f"interleave:{groups}:{'g' if group_major else 'c'}:{parts}"


def parse(args: str) -> Interleave:
    """The :class:`Interleave` of a name made by :func:`spec` (without ``interleave:``)."""
    groups, major, parts = args.split(":")
    components = [Component(*map(int, part.split("."))) for part in parts.split(",")]
    return Interleave(int(groups), major == "g", components)


def gated_qkv(heads: int, groups: int, head_dim: int) -> str:
    """``linear_qkv`` with an output gate (Qwen3-Next, Qwen3.5): ``q_proj``'s rows are
    ``[q, gate]`` per head; a group becomes ``[its q heads, their gates, k, v]``."""
    per = heads // groups
    d = head_dim
    queries = [Component(0, per * 2 * d, i * 2 * d, d) for i in range(per)]
    gates = [Component(0, per * 2 * d, i * 2 * d + d, d) for i in range(per)]
    return spec(groups, True, [*queries, *gates, Component(1, d, 0, d), Component(2, d, 0, d)])


def gated_qkv_scalar(heads: int, groups: int, head_dim: int) -> str:
    """``linear_qkv`` with a per-head scalar gate ``g_proj`` (Step-3.5's ``QKVGMapping`` in
    Megatron-Core's gated layout): a group is ``[its q heads, their gate rows each repeated
    over the head dim, k, v]``."""
    per, d = heads // groups, head_dim
    gates = [Component(3, per, i, d, d) for i in range(per)]
    return spec(
        groups,
        True,
        [Component(0, per * d, 0, per * d), *gates, Component(1, d, 0, d), Component(2, d, 0, d)],
    )


def gdn_in_proj(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> str:
    """The gated delta net's ``in_proj`` from Qwen3-Next's head-grouped ``in_proj_qkvz``
    (per key head ``[q, k, v, z]``) and ``in_proj_ba`` (``[b, a]``): ``[q; k; v; z; b; a]``."""
    v = value_heads // key_heads * value_dim
    ab = value_heads // key_heads
    qkvz = 2 * key_dim + 2 * v
    return spec(
        key_heads,
        False,
        [
            Component(0, qkvz, 0, key_dim),
            Component(0, qkvz, key_dim, key_dim),
            Component(0, qkvz, 2 * key_dim, v),
            Component(0, qkvz, 2 * key_dim + v, v),
            Component(1, 2 * ab, 0, ab),
            Component(1, 2 * ab, ab, ab),
        ],
    )


def gdn_in_proj_separate(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> str:
    """The same ``in_proj`` from Qwen3.5's flat ``in_proj_qkv`` (``[Q; K; V]``), ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a``."""
    v = value_heads // key_heads * value_dim
    ab = value_heads // key_heads
    return spec(
        key_heads,
        False,
        [*_qkv_flat(key_heads, key_dim, v), Component(1, v, 0, v), *_ba(ab, 2, 3)],
    )


def gdn_conv1d(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> str:
    """The gated delta net's ``conv1d`` (weight ``[C, 1, K]`` or bias): ``[Q; K; V]`` channels,
    each split over TP (``GDNConv1dMapping``)."""
    v = value_heads // key_heads * value_dim
    return spec(key_heads, False, _qkv_flat(key_heads, key_dim, v))


def _qkv_flat(key_heads: int, key_dim: int, v: int) -> list[Component]:
    qk = key_heads * key_dim
    return [
        Component(0, key_dim, 0, key_dim),
        Component(0, key_dim, qk, key_dim),
        Component(0, v, 2 * qk, v),
    ]


def _ba(ab: int, b: int, a: int) -> list[Component]:
    return [Component(b, ab, 0, ab), Component(a, ab, 0, ab)]


class ZeroCentred(RowBlocks):
    """A zero-centred norm's weight (stored as ``1 + w``) as Megatron's ``w``: ``inner``'s
    pieces minus one, computed in the checkpoint's ``dtype`` and then cast to the parameter's,
    as Megatron-Bridge's ``RMSNorm2ZeroCenteredRMSNormMapping`` computes it."""

    as_stored = True
    """Its inputs travel in the checkpoint's dtype: cast to a narrower parameter's before the
    subtraction, ``1 + w`` would lose the digits of ``w`` that the bridge keeps."""

    def __init__(self, inner: Transform, dtype: str) -> None:
        self.inner = inner
        self.dtype = dtype

    def check(self, hf: Sequence[Named], local: Shape, shard: Shard) -> list[str]:
        return self.inner.check(hf, local, shard)

    def blocks(
        self, index: int, source: torch.Tensor, rows: Rows, local: Shape, shard: Shard
    ) -> Iterator[Piece]:
        import torch

        stored = getattr(torch, self.dtype)
        for first, stop, piece in self.inner.blocks(index, source, rows, local, shard):
            yield first, stop, piece.to(stored) - 1
