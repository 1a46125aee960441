"""The plan: every rank's demands, shared and packed into buckets.

The reader computes the plan from the broadcast checkpoint metadata and the
all-gathered demands of every rank (:mod:`megastart.loader.mapping.needs`), before any bulk
transfer; on several nodes the other ranks take their node's view of it
(:func:`megastart.loader.plan.planning.handed_out`).
Nothing here touches torch.distributed: it is plain data in, plain data out,
testable on names and shapes alone.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from megastart.loader.checkpoint import ITEMSIZE, CheckpointMeta, TensorEntry
from megastart.loader.mapping.mappings import MappingTable
from megastart.loader.mapping.needs import AS_STORED, Demand
from megastart.loader.mapping.transforms import Rows

_ALIGN = 64
"""Byte alignment of each tensor in a bucket, so every dtype view of it is aligned."""


@dataclass(frozen=True, slots=True)
class Slot:
    """The place in a bucket of one HF tensor's rows, in the dtype it travels in."""

    name: str
    offset: int
    shape: tuple[int, ...]
    """The shape of the rows held (the tensor's own when it travels whole)."""
    dtype: str
    nbytes: int
    rows: Rows
    """Which rows of the tensor (dim 0) the slot holds."""

    def __reduce__(self) -> tuple[type[Slot], tuple[Any, ...]]:
        # by its fields: a reader pickles every slot for the nodes' views (90,000 of
        # DeepSeek-V3's), and dataclasses' own state looks up the fields per object (3x slower)
        return Slot, (self.name, self.offset, self.shape, self.dtype, self.nbytes, self.rows)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Slots, back to back (64-byte aligned); ``nbytes`` is at most the plan's bucket size."""

    slots: tuple[Slot, ...]
    nbytes: int
    positions: tuple[int, ...] = (0,)
    """The positions in the reader group of the ranks it is broadcast to: the reader (0)
    and every rank that needs one of its slots (with striped readers, those alone)."""
    reader: int = 0
    """The position in the reader group of the rank that reads it (:mod:`.stripes`)."""

    def __reduce__(self) -> tuple[type[Bucket], tuple[Any, ...]]:
        return Bucket, (self.slots, self.nbytes, self.positions, self.reader)  # as Slot's


@dataclass(frozen=True, slots=True)
class Shipped:
    """A bucket as a node's view of the plan pickles it: its receivers as runs of consecutive
    positions (:func:`runs`: a pipeline stage's thousands of ranks are one run), so that the
    view does not grow with the data-parallel size; it unpickles as the :class:`Bucket`."""

    bucket: Bucket
    runs: tuple[int, ...] | None
    """``runs(bucket.positions)``, or ``None`` where that is no shorter than the positions."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.runs is None:
            return self.bucket.__reduce__()
        b = self.bucket
        return _bucket_of_runs, (b.slots, b.nbytes, self.runs, b.reader)


def runs(positions: tuple[int, ...]) -> tuple[int, ...]:
    """``positions`` as runs of consecutive ones, in order: each run's first and one past its
    last, flat."""
    found: list[int] = []
    for position in positions:
        if found and found[-1] == position:
            found[-1] += 1
        else:
            found += (position, position + 1)
    return tuple(found)


def _bucket_of_runs(
    slots: tuple[Slot, ...], nbytes: int, runs: tuple[int, ...], reader: int
) -> Bucket:
    """The :class:`Bucket` that :class:`Shipped` pickled with its receivers' runs."""
    ranges = (range(start, stop) for start, stop in zip(runs[::2], runs[1::2], strict=True))
    return Bucket(slots, nbytes, tuple(p for run in ranges for p in run), reader)


@dataclass(frozen=True, slots=True)
class Plan:
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def receiver_sets(self) -> list[tuple[int, ...]]:
        """The distinct :attr:`Bucket.positions`, sorted."""
        return sorted({bucket.positions for bucket in self.buckets})


def unused_tensors(
    demands_by_rank: Sequence[Sequence[Demand]],
    meta: CheckpointMeta,
    table: MappingTable,
    *,
    value_model: bool = False,
) -> list[str]:
    """Checkpoint tensors no rank uses (the table's ``ignored`` ones excepted, and for a
    value model the heads it did not take: the LM head of the causal LM it starts from)."""
    consumed = {
        name for demands in distinct(demands_by_rank) for names, _ in demands for name in names
    }
    if value_model:
        consumed.update(table.value_head_sources)
    return sorted(
        n for n in meta.tensors if n not in consumed and not table.is_ignored(n, meta.config)
    )


def build_plan(
    demands_by_rank: Sequence[Sequence[Demand]],
    meta: CheckpointMeta,
    *,
    bucket_bytes: int,
    to_reader: bool = True,
) -> Plan:
    """Buckets of at most ``bucket_bytes`` for the given ranks' demands (index 0: the reader;
    with ``to_reader=False``, buckets reach only the ranks that need them, and
    :func:`~megastart.loader.plan.stripes.stripe` chooses their readers).

    Each bucket holds tensors the same ranks need (:attr:`Plan.receiver_sets`), so it
    is broadcast to those ranks only: a pipeline stage's tensors do not cross
    the links of the other stages' ranks. Tensors travel in their consumers'
    dtype (in the checkpoint's where consumers disagree), ordered by file and
    offset, and packed greedily: one receiver set's buckets read their files
    front to back; where sets interleave (expert-parallel ranks' experts), each
    bucket skips the others' tensors.
    A tensor larger than a bucket travels as row blocks (dim-0 ranges) in
    consecutive buckets, so transient memory is set by ``bucket_bytes``, not by
    the largest tensor (an embedding); only a single row larger than a bucket
    gets a bucket of its own size. The transforms take one input's row range
    at a time, so fused inputs (q, k, v) may travel apart.
    """
    bucket_bytes = max(_ALIGN, bucket_bytes // _ALIGN * _ALIGN)  # aligned slots fill it exactly
    dtypes, members = _consumers(demands_by_rank, to_reader)
    buckets: list[Bucket] = []
    # by the id of the receivers' tuple (one object per distinct set: a stage's thousands of
    # ranks are not hashed per tensor)
    open_buckets: dict[int, tuple[tuple[int, ...], list[Slot], int]] = {}
    travelling: dict[tuple[frozenset[str], str], str] = {}
    whole: dict[int, Rows] = {}  # by row count: one object for the tensors that travel whole
    order = partial(_stream_order, meta)
    for entry in sorted((meta.tensors[name] for name in dtypes), key=order):
        key = (dtypes[entry.name], entry.dtype)
        dtype = travelling.get(key) or travelling.setdefault(key, _travels_as(*key))
        ranks = members[entry.name]
        itemsize, numel = ITEMSIZE[dtype], entry.numel
        if numel * itemsize <= bucket_bytes:  # most tensors: one block, the tensor's shape
            total = entry.shape[0] if entry.shape else 1
            rows = whole.get(total) or whole.setdefault(total, Rows(0, total, total))
            blocks = [(rows, numel * itemsize, entry.shape)]
        else:
            blocks = [
                (
                    rows,
                    numel // max(rows.total, 1) * (rows.stop - rows.start) * itemsize,
                    (rows.stop - rows.start, *entry.shape[1:]),
                )
                for rows in _row_blocks(entry, itemsize, bucket_bytes)
            ]
        for rows, nbytes, shape in blocks:
            _, slots, offset = open_buckets.pop(id(ranks), (ranks, [], 0))
            if slots and offset + nbytes > bucket_bytes:
                buckets.append(Bucket(tuple(slots), offset, ranks))
                slots, offset = [], 0
            slots.append(Slot(entry.name, offset, shape, dtype, nbytes, rows))
            open_buckets[id(ranks)] = ranks, slots, offset + _aligned(nbytes)
    buckets.extend(
        Bucket(tuple(slots), offset, ranks) for ranks, slots, offset in open_buckets.values()
    )
    return Plan(tuple(buckets))


def _travels_as(wanted: frozenset[str], stored: str) -> str:
    """The dtype a tensor stored as ``stored`` travels in, for consumers that want ``wanted``:
    theirs where they agree, else the checkpoint's."""
    dtypes = {stored if d == AS_STORED else d for d in wanted}
    return next(iter(dtypes)) if len(dtypes) == 1 else stored


def _consumers(
    demands_by_rank: Sequence[Sequence[Demand]], to_reader: bool
) -> tuple[dict[str, frozenset[str]], dict[str, tuple[int, ...]]]:
    """Per HF tensor: the dtypes its consumers want, and the ranks that need it (with the
    reader, 0, if ``to_reader``).

    The work goes by distinct demands object (replicas share one), and each distinct set of
    ranks and of dtypes is made once and shared by the tensors that have it: at 8,192 ranks a
    few hundred distinct objects and sets, not a set per tensor.
    """
    holders: dict[int, tuple[Sequence[Demand], list[int]]] = {}  # each distinct object's ranks
    for rank, demands in enumerate(demands_by_rank):
        holders.setdefault(id(demands), (demands, []))[1].append(rank)
    held = list(holders.values())
    users: dict[str, list[int]] = {}  # indices into held
    dtypes: dict[str, frozenset[str]] = {}
    unions: dict[tuple[frozenset[str], str], frozenset[str]] = {}
    none: frozenset[str] = frozenset()
    for index, (demands, _) in enumerate(held):
        for names, dtype in demands:
            for name in names:  # run once per name and distinct object: allocate nothing here
                its = users.get(name)
                if its is None:
                    users[name] = [index]
                elif its[-1] != index:
                    its.append(index)
                wanted = dtypes.get(name, none)
                if dtype not in wanted:
                    key = (wanted, dtype)
                    dtypes[name] = unions.get(key) or unions.setdefault(key, wanted | {dtype})
    first = (0,) if to_reader else ()
    ranks_of: dict[tuple[int, ...], tuple[int, ...]] = {}
    ranks: dict[str, tuple[int, ...]] = {}
    for name, its in users.items():
        sharing = tuple(its)
        if sharing not in ranks_of:
            ranks_of[sharing] = tuple(sorted({*first, *(r for i in sharing for r in held[i][1])}))
        ranks[name] = ranks_of[sharing]
    return dtypes, ranks


def packed(demands: Sequence[Demand], meta: CheckpointMeta) -> bytes:
    """A rank's demands as it shares them: each tensor as its position in the checkpoint's
    metadata (the same on every rank), not its name; a tenth of the bytes of names."""
    ids = {name: i for i, name in enumerate(meta.tensors)}
    return pickle.dumps([(tuple(ids[n] for n in names), dtype) for names, dtype in demands])


def demands_once(shared: Sequence[bytes], meta: CheckpointMeta) -> list[list[Demand]]:
    """Every rank's demands from what it shared (:func:`packed`; ``b""``: none), one object for
    the ranks that shared the same bytes: in a world of thousands of ranks, the tensor- and
    data-parallel replicas of a few hundred distinct ones."""
    names = list(meta.tensors)
    unpacked: dict[bytes, list[Demand]] = {}
    out = []
    for data in shared:
        if data not in unpacked:
            ids = pickle.loads(data) if data else []
            unpacked[data] = [(tuple(names[i] for i in tensors), dtype) for tensors, dtype in ids]
        out.append(unpacked[data])
    return out


def distinct(demands_by_rank: Sequence[Sequence[Demand]]) -> list[Sequence[Demand]]:
    """The distinct demands objects, in rank order (replicas share one: see
    ``megastart.loader.api``): each rank's work once per distinct object, not per rank."""
    return list({id(demands): demands for demands in demands_by_rank}.values())


def _row_blocks(entry: TensorEntry, itemsize: int, bucket_bytes: int) -> list[Rows]:
    """``entry``'s dim-0 ranges, each at most ``bucket_bytes`` (at least one row)."""
    if not entry.shape or entry.shape[0] == 0:
        return [Rows(0, 1, 1) if not entry.shape else Rows(0, 0, 0)]
    total = entry.shape[0]
    if entry.numel * itemsize <= bucket_bytes:  # most tensors: one block
        return [Rows(0, total, total)]
    per_block = max(1, bucket_bytes // (entry.numel // total * itemsize or 1))
    return [Rows(i, min(i + per_block, total), total) for i in range(0, total, per_block)]


def _stream_order(meta: CheckpointMeta, entry: TensorEntry) -> tuple[str, int, int, str]:
    """By file and offset; a quantised weight's scales just before it (its receivers
    dequantise each of its rows as they arrive)."""
    name = meta.quantisation.weight_of(entry.name) if meta.quantisation else None
    weight = meta.tensors.get(name) if name is not None else None
    if weight is not None:
        return weight.file, weight.start, 0, entry.name
    return entry.file, entry.start, 1, entry.name


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
