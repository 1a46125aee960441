"""The plan: which HF tensors each rank needs, validated, packed into buckets.

Every rank computes the plan from the same inputs (the broadcast checkpoint
metadata and the all-gathered demands of every rank), so every rank gets the
same buckets in the same order and raises the same errors, before any bulk
transfer. Nothing here touches torch.distributed: it is plain data in, plain
data out, testable on names and shapes alone.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from megastart.errors import PlanError
from megastart.loader.checkpoint import ITEMSIZE, SCALE_SUFFIX, CheckpointMeta, TensorEntry
from megastart.loader.mappings import VALUE_HEAD, VALUE_MODEL_UNCHECKED, MappingTable
from megastart.loader.transforms import TRANSFORMS, Rows, Shard

_ALIGN = 64
"""Byte alignment of each tensor in a bucket, so every dtype view of it is aligned."""


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One Megatron parameter of this rank."""

    chunk: int
    """Index of the model chunk (virtual pipeline stage) that holds it."""
    local_name: str
    """Its name in ``chunk.named_parameters()``."""
    name: str
    """Canonical name: global layer index (and global expert index)."""
    shape: tuple[int, ...]
    dtype: str
    """``torch`` dtype name (``"bfloat16"``)."""

    def describe(self) -> str:
        where = f"chunk {self.chunk}, " if self.chunk else ""
        canonical = "" if self.name == self.local_name else f"global name {self.name!r}, "
        return (
            f"Megatron parameter {self.local_name!r} ({canonical}{where}shape {list(self.shape)})"
        )


@dataclass(frozen=True, slots=True)
class Need:
    """One local parameter and the HF tensors that make it."""

    param: ParamInfo
    hf: tuple[str, ...]
    transform: str
    scales: tuple[str, ...] = ()
    """Per input of ``hf``, its FP8 block scales (``""``: none); empty where no input has any
    (:mod:`megastart.loader.dequantise`)."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every checkpoint tensor the need takes: its inputs, then their scales."""
        return self.hf + tuple(s for s in self.scales if s)

    def demands(self) -> list[Demand]:
        """What it asks the stream for: scaled inputs and their scales travel as stored."""
        if not self.scales:
            return [(self.hf, self.param.dtype)]
        plain = tuple(n for n, s in zip(self.hf, self.scales, strict=True) if not s)
        stored = tuple(n for n in self.inputs if n not in plain)
        return [
            (names, dtype)
            for names, dtype in ((plain, self.param.dtype), (stored, AS_STORED))
            if names
        ]


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
        """The distinct :attr:`Bucket.positions`, sorted: :func:`receiver_sets` of the demands
        it was built from, without going through them again."""
        return sorted({bucket.positions for bucket in self.buckets})


def check_config(
    table: MappingTable,
    hf_config: Mapping[str, Any],
    megatron: Mapping[str, Any],
    *,
    checkpoint: str,
    value_model: bool = False,
) -> None:
    """Raise if ``config.json`` describes a different model than the Megatron one built.

    :param megatron: Megatron ``TransformerConfig`` attributes by name.
    :param value_model: the model is a value model, whose head is never tied to the embedding.
    """
    problems = []
    for hf_key, megatron_key in table.config_checks:
        if value_model and hf_key in VALUE_MODEL_UNCHECKED:
            continue
        hf_value, megatron_value = _hf_config_value(hf_config, hf_key), megatron.get(megatron_key)
        if hf_value is not None and megatron_value is not None and hf_value != megatron_value:
            problems.append(
                f"{hf_key}={hf_value} in config.json but {megatron_key}={megatron_value} in Megatron"
            )
    if problems:
        raise PlanError(
            f"checkpoint {checkpoint!r} is for a different model than the one built: "
            + "; ".join(problems)
            + ". Build the Megatron model from this checkpoint's config, or load the checkpoint it was built for"
        )


def _hf_config_value(config: Mapping[str, Any], key: str) -> Any:
    """A config value, with the defaults ``transformers`` applies when a key is absent."""
    if config.get(key) is not None:
        return config[key]
    if key == "num_key_value_heads":
        return config.get("num_attention_heads")
    if key == "head_dim" and config.get("hidden_size") and config.get("num_attention_heads"):
        return config["hidden_size"] // config["num_attention_heads"]
    return None


def resolve_needs(
    params: Sequence[ParamInfo],
    table: MappingTable,
    meta: CheckpointMeta,
    shard: Shard,
    *,
    value_model: bool = False,
) -> list[Need]:
    """Map each local parameter to its HF tensors and check every shape; raise all problems at once.

    For a value model the head (``output_layer``) is not the table's LM head: its
    weight comes from the checkpoint's reward head when one has its shape
    (:func:`value_head_source`); otherwise the head gets no :class:`Need` and keeps
    the host's initialisation (:func:`left_to_host`).
    """
    tied = bool(meta.config.get("tie_word_embeddings", False))
    arch = ", ".join(table.architectures)
    problems: list[str] = []
    needs: list[Need] = []
    for param in params:
        if value_model and param.name.startswith(VALUE_HEAD):
            if param.shape[:1] != (1,):
                problems.append(
                    f"{param.describe()} is not a value head (one output): a value model's "
                    "output_layer must be replaced by a one-output head before it is loaded, "
                    "or load it with value_model=False"
                )
                continue
            source = value_head_source(param, table, meta)
            if source is not None:
                needs.append(Need(param, (source,), "replicated"))
            continue
        if table.leaves(param.name):
            continue
        matched = table.resolve(param.name, meta.config)
        if matched is None:
            problems.append(f"{param.describe()} has no rule in the {arch} mapping table")
            continue
        rule, fields = matched
        hf = table.hf_names(rule, fields, tied=tied)
        missing = [n for n in hf if n not in meta.tensors]
        if missing:
            reward = [n for n in table.value_head_sources if n in meta.tensors and n not in hf]
            hint = f" (it holds a reward head {reward}: load a value model)" if reward else ""
            problems.append(
                f"tensor(s) {missing} missing from checkpoint {meta.directory!r}{hint}, "
                f"needed by {param.describe()}"
            )
            continue
        named = [(n, meta.tensors[n].shape) for n in hf]
        for problem in TRANSFORMS[rule.transform].check(named, param.shape, shard):
            problems.append(
                f"shape mismatch: {problem} for {param.describe()} "
                f"(tensor-parallel rank {shard.tp_rank} of {shard.tp_size})"
            )
        needs.append(Need(param, hf, rule.transform, _scales(hf, meta)))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise PlanError("; ".join(problems[:5]) + more)
    return needs


def _scales(hf: tuple[str, ...], meta: CheckpointMeta) -> tuple[str, ...]:
    """The block scales of each of ``hf`` in a checkpoint the loader dequantises (``""``: a
    tensor without), or ``()`` where none has any."""
    if meta.quantisation is None or meta.quantisation.weight_block is None:
        return ()
    scales = tuple(
        n + SCALE_SUFFIX if meta.tensors[n].dtype.startswith("float8") else "" for n in hf
    )
    return scales if any(scales) else ()


def value_head_source(param: ParamInfo, table: MappingTable, meta: CheckpointMeta) -> str | None:
    """The checkpoint tensor a value head's weight is read from: the first of the table's
    ``value_head_sources`` with the head's shape, or ``None`` (its bias never has one)."""
    if param.name != VALUE_HEAD + "weight":
        return None
    return next(
        (
            name
            for name in table.value_head_sources
            if name in meta.tensors and tuple(meta.tensors[name].shape) == param.shape
        ),
        None,
    )


def left_to_host(params: Sequence[ParamInfo], needs: Sequence[Need]) -> list[ParamInfo]:
    """The parameters no need fills: a value head the checkpoint has no source for."""
    filled = {(need.param.chunk, need.param.local_name) for need in needs}
    return [p for p in params if (p.chunk, p.local_name) not in filled]


Demand = tuple[tuple[str, ...], str]
"""What one need asks the stream for: the HF tensors and the dtype they travel in
(the parameter's, or :data:`AS_STORED`)."""

AS_STORED = "stored"
"""A demand's dtype for tensors that travel as the checkpoint stores them (FP8 weights and
their scales, which the receiving rank dequantises)."""


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
    :func:`~megastart.loader.stripes.stripe` chooses their readers).

    Each bucket holds tensors the same ranks need (:func:`receiver_sets`), so it
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
    order = partial(_stream_order, meta)
    for entry in sorted((meta.tensors[name] for name in dtypes), key=order):
        key = (dtypes[entry.name], entry.dtype)
        dtype = travelling.get(key) or travelling.setdefault(key, _travels_as(*key))
        ranks = members[entry.name]
        for rows in _row_blocks(entry, ITEMSIZE[dtype], bucket_bytes):
            nbytes = entry.numel // max(rows.total, 1) * (rows.stop - rows.start) * ITEMSIZE[dtype]
            _, slots, offset = open_buckets.pop(id(ranks), (ranks, [], 0))
            if slots and offset + nbytes > bucket_bytes:
                buckets.append(Bucket(tuple(slots), offset, ranks))
                slots, offset = [], 0
            shape = (rows.stop - rows.start, *entry.shape[1:]) if entry.shape else ()
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


def receiver_sets(
    demands_by_rank: Sequence[Sequence[Demand]], *, to_reader: bool = True
) -> list[tuple[int, ...]]:
    """The distinct :attr:`Bucket.positions` of the plan for these demands, sorted."""
    return sorted(set(_consumers(demands_by_rank, to_reader)[1].values()))


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
    for index, (demands, _) in enumerate(held):
        for names, dtype in demands:
            for name in names:
                its = users.setdefault(name, [])
                if not its or its[-1] != index:
                    its.append(index)
                key = (dtypes.get(name, frozenset()), dtype)
                dtypes[name] = unions.get(key) or unions.setdefault(key, key[0] | {dtype})
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
    """By file and offset; an FP8 weight's scales just before it (its receivers
    dequantise each of its rows as they arrive)."""
    weight = meta.tensors.get(entry.name.removesuffix(SCALE_SUFFIX))
    if entry.name.endswith(SCALE_SUFFIX) and weight is not None:
        return weight.file, weight.start, 0, entry.name
    return entry.file, entry.start, 1, entry.name


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
