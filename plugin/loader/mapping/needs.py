"""Which HF tensors each of a rank's parameters needs, and in what dtype, validated.

Plain data in, plain data out: the parameter list and the checkpoint's metadata
give each parameter's :class:`Need`, or every problem at once as one
:class:`~megastart.errors.PlanError`, before any transfer. What the ranks then do
with the demands (buckets, who receives what) is :mod:`megastart.loader.plan.buckets`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megastart.errors import PlanError
from megastart.loader.checkpoint import CheckpointMeta, logical_shape
from megastart.loader.mapping.mappings import VALUE_HEAD, VALUE_MODEL_UNCHECKED, MappingTable
from megastart.loader.mapping.transforms import TRANSFORMS, Shard, travels_as_stored


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
    """Per input of ``hf``, its scales (``""``: none); empty where no input has any
    (:mod:`megastart.loader.mapping.dequantise`, :mod:`megastart.loader.mapping.unpack`)."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every checkpoint tensor the need takes: its inputs, then their scales."""
        return self.hf + tuple(s for s in self.scales if s)

    def demands(self) -> list[Demand]:
        """What it asks the stream for: scaled inputs and their scales travel as stored, and so
        do the inputs of a transform that computes on the checkpoint's values."""
        if not self.scales:
            as_stored = travels_as_stored(self.transform)
            return [(self.hf, AS_STORED if as_stored else self.param.dtype)]
        plain = tuple(n for n, s in zip(self.hf, self.scales, strict=True) if not s)
        stored = tuple(n for n in self.inputs if n not in plain)
        return [
            (names, dtype)
            for names, dtype in ((plain, self.param.dtype), (stored, AS_STORED))
            if names
        ]


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
        stored = tuple(stored_name(n, meta) for n in hf)
        missing = [n for n, s in zip(hf, stored, strict=True) if s not in meta.tensors]
        if missing:
            reward = [n for n in table.value_head_sources if n in meta.tensors and n not in hf]
            hint = f" (it holds a reward head {reward}: load a value model)" if reward else ""
            problems.append(
                f"tensor(s) {missing} missing from checkpoint {meta.directory!r}{hint}, "
                f"needed by {param.describe()}"
            )
            continue
        named = [(n, _shape(s, meta)) for n, s in zip(hf, stored, strict=True)]
        for problem in TRANSFORMS[rule.transform].check(named, param.shape, shard):
            problems.append(
                f"shape mismatch: {problem} for {param.describe()} "
                f"(tensor-parallel rank {shard.tp_rank} of {shard.tp_size})"
            )
        needs.append(Need(param, stored, rule.transform, _scales(stored, meta)))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise PlanError("; ".join(problems[:5]) + more)
    return needs


def stored_name(name: str, meta: CheckpointMeta) -> str:
    """The checkpoint tensor that holds HF tensor ``name``: itself, or in a packed checkpoint
    (:data:`~megastart.loader.checkpoint.quantised.MXFP4`, ``INT4``) its packed values where
    the name is not stored as it is."""
    quantisation = meta.quantisation
    if quantisation is None or not quantisation.packing or name in meta.tensors:
        return name
    return name + quantisation.suffixes[0]


def _shape(stored: str, meta: CheckpointMeta) -> tuple[int, ...]:
    """The shape of a stored tensor as its mapping sees it: a packed one's once unpacked."""
    quantisation, shape = meta.quantisation, tuple(meta.tensors[stored].shape)
    if quantisation is not None and quantisation.packing and quantisation.scale_of(stored, ""):
        return logical_shape(quantisation.packing, shape)
    return shape


def _scales(hf: tuple[str, ...], meta: CheckpointMeta) -> tuple[str, ...]:
    """The scales of each of ``hf`` in a checkpoint the loader dequantises (``""``: a
    tensor without), or ``()`` where none has any."""
    quantisation = meta.quantisation
    if quantisation is None or (quantisation.weight_block is None and not quantisation.packing):
        return ()
    scales = tuple(quantisation.scale_of(n, meta.tensors[n].dtype) for n in hf)
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
    """The parameters no need fills: a value head the checkpoint has no source for, or what
    the host's bridge maps to no checkpoint tensor (named in the report, not refused)."""
    filled = {(need.param.chunk, need.param.local_name) for need in needs}
    return [p for p in params if (p.chunk, p.local_name) not in filled]


Demand = tuple[tuple[str, ...], str]
"""What one need asks the stream for: the HF tensors and the dtype they travel in
(the parameter's, or :data:`AS_STORED`)."""

AS_STORED = "stored"
"""A demand's dtype for tensors that travel as the checkpoint stores them (quantised weights
and their scales, which the receiving rank dequantises)."""
