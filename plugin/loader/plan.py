"""The plan: which HF tensors each rank needs, validated, packed into buckets.

Every rank computes the plan from the same inputs (the broadcast checkpoint
metadata and the all-gathered demands of every rank), so every rank gets the
same buckets in the same order and raises the same errors, before any bulk
transfer. Nothing here touches torch.distributed: it is plain data in, plain
data out, testable on names and shapes alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megastart.loader.checkpoint import ITEMSIZE, CheckpointMeta, TensorEntry
from megastart.loader.mappings import MappingTable
from megastart.loader.transforms import TRANSFORMS, Shard

_ALIGN = 64
"""Byte alignment of each tensor in a bucket, so every dtype view of it is aligned."""


class PlanError(ValueError):
    """The checkpoint does not fit the model that was built (message names tensors and shapes)."""


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


@dataclass(frozen=True, slots=True)
class Slot:
    """One HF tensor's place in a bucket, in the dtype it travels in."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Plan:
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)


def check_config(
    table: MappingTable,
    hf_config: Mapping[str, Any],
    megatron: Mapping[str, Any],
    *,
    checkpoint: str,
) -> None:
    """Raise if ``config.json`` describes a different model than the Megatron one built.

    :param megatron: Megatron ``TransformerConfig`` attributes by name.
    """
    problems = []
    for hf_key, megatron_key in table.config_checks:
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
    params: Sequence[ParamInfo], table: MappingTable, meta: CheckpointMeta, shard: Shard
) -> list[Need]:
    """Map each local parameter to its HF tensors and check every shape; raise all problems at once."""
    tied = bool(meta.config.get("tie_word_embeddings", False))
    arch = ", ".join(table.architectures)
    problems: list[str] = []
    needs: list[Need] = []
    for param in params:
        matched = table.match(param.name)
        if matched is None:
            problems.append(f"{param.describe()} has no rule in the {arch} mapping table")
            continue
        rule, fields = matched
        hf = table.hf_names(rule, fields, tied=tied)
        missing = [n for n in hf if n not in meta.tensors]
        if missing:
            problems.append(
                f"tensor(s) {missing} missing from checkpoint {meta.directory!r}, needed by {param.describe()}"
            )
            continue
        named = [(n, meta.tensors[n].shape) for n in hf]
        for problem in TRANSFORMS[rule.transform].check(named, param.shape, shard):
            problems.append(
                f"shape mismatch: {problem} for {param.describe()} "
                f"(tensor-parallel rank {shard.tp_rank} of {shard.tp_size})"
            )
        needs.append(Need(param, hf, rule.transform))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise PlanError("; ".join(problems[:5]) + more)
    return needs


Demand = tuple[tuple[str, ...], str]
"""What one need asks the stream for: the HF tensors (read together) and the parameter dtype."""


def unused_tensors(
    demands_by_rank: Sequence[Sequence[Demand]], meta: CheckpointMeta, table: MappingTable
) -> list[str]:
    """Checkpoint tensors no rank uses (the table's ``ignored`` ones excepted)."""
    used = {name for demands in demands_by_rank for names, _ in demands for name in names}
    return sorted(n for n in meta.tensors if n not in used and not table.is_ignored(n))


def build_plan(
    demands_by_rank: Sequence[Sequence[Demand]], meta: CheckpointMeta, *, bucket_bytes: int
) -> Plan:
    """Buckets for the given ranks' demands: tensors read together stay in one bucket.

    Tensors travel in their consumers' dtype (in the checkpoint's where consumers
    disagree); units are ordered by file and offset, so the reader reads each
    file front to back, and packed greedily up to ``bucket_bytes`` (a unit larger
    than that gets a bucket of its own).
    """
    dtypes: dict[str, set[str]] = {}
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for demands in demands_by_rank:
        for names, dtype in demands:
            for name in names:
                parent.setdefault(name, name)
                dtypes.setdefault(name, set()).add(dtype)
            for name in names[1:]:
                parent[root(name)] = root(names[0])
    units: dict[str, list[TensorEntry]] = {}
    for name in parent:
        units.setdefault(root(name), []).append(meta.tensors[name])
    ordered = sorted(
        (sorted(unit, key=_file_order) for unit in units.values()), key=lambda u: _file_order(u[0])
    )

    buckets: list[Bucket] = []
    slots: list[Slot] = []
    offset = 0
    for unit in ordered:
        unit_slots = []
        unit_bytes = 0
        for entry in unit:
            wanted = dtypes[entry.name]
            dtype = next(iter(wanted)) if len(wanted) == 1 else entry.dtype
            nbytes = entry.numel * ITEMSIZE[dtype]
            unit_slots.append((entry, dtype, nbytes, unit_bytes))
            unit_bytes += _aligned(nbytes)
        if slots and offset + unit_bytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), offset))
            slots, offset = [], 0
        slots.extend(Slot(e.name, offset + at, e.shape, dtype, n) for e, dtype, n, at in unit_slots)
        offset += unit_bytes
    if slots:
        buckets.append(Bucket(tuple(slots), offset))
    return Plan(tuple(buckets))


def _file_order(entry: TensorEntry) -> tuple[str, int, str]:
    return entry.file, entry.start, entry.name


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
