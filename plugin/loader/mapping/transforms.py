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

from megastart.loader.mapping import interleave
from megastart.loader.mapping.fused import (
    EvenOddGateUp,
    FusedExpert,
    FusedGatedExpert,
    OrientedRowParallel,
)
from megastart.loader.mapping.permuted import Permuted
from megastart.loader.mapping.slices import (
    ColumnParallel,
    ColumnShards,
    ExpertTensorParallel,
    GateUp,
    Qkv,
    Replicated,
    RowParallel,
    RowRange,
    Squeezed,
    SwappedHalves,
    Vocab,
)
from megastart.loader.mapping.transform_base import Named, Piece, Rows, Shape, Shard, Transform

__all__ = [
    "TRANSFORMS",
    "Named",
    "Piece",
    "Rows",
    "Shape",
    "Shard",
    "Transform",
    "travels_as_stored",
]


class _Transforms(dict[str, Transform]):
    """The transforms by name; a parameterised name makes its transform on first use:
    ``fused_expert:{e}:{inner}``, ``fused_gated_expert:{e}``, ``zero_centred:{dtype}:{inner}``,
    ``swapped_halves:{inner}``, ``permuted:{dims}:{inner}``, ``rows:{start}:{stop}``
    and ``interleave:...`` (:mod:`megastart.loader.mapping.interleave`)."""

    def __missing__(self, name: str) -> Transform:
        kind, _, args = name.partition(":")
        expert, _, inner = args.partition(":")
        if kind == "interleave":
            made: Transform = interleave.parse(args)
        elif kind == "swapped_halves" and args in self:
            made = SwappedHalves(self[args])
        elif kind == "rows" and expert.isdigit() and inner.isdigit():
            made = RowRange(int(expert), int(inner))
        elif kind == "permuted" and inner in self:
            made = Permuted(tuple(map(int, expert.split("."))), self[inner])
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


def travels_as_stored(transform: str) -> bool:
    """Whether ``transform`` computes on the checkpoint's values, so its inputs travel in the
    checkpoint's dtype rather than the parameter's (a zero-centred norm's minus one)."""
    return bool(getattr(TRANSFORMS[transform], "as_stored", False))


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
        "even_odd_gate_up": EvenOddGateUp(),
        "expert_oriented_row_parallel": ExpertTensorParallel(OrientedRowParallel()),
        "expert_gate_up": ExpertTensorParallel(GateUp()),
        "expert_row_parallel": ExpertTensorParallel(RowParallel()),
    }
)
"""Transform name (as used in mapping rules) -> transform; see :class:`_Transforms` for the
parameterised names of fused experts."""
