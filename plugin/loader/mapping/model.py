"""Reading this rank's Megatron model: its parameters, layout and shard, matched to a checkpoint.

The loader's phases need, from the model built by the host, only plain data:
each parameter's canonical name (global layer and expert numbers), shape and
dtype; the ``TransformerConfig`` values the checkpoint's ``config.json`` is
checked against; and this rank's tensor-parallel shard. Everything that looks
inside Megatron-core objects is here, so the phases (``api``) and the stream
(``stream``) handle names, shapes and tensors only.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megastart.errors import PlanError
from megastart.loader.checkpoint import CheckpointMeta
from megastart.loader.mapping.experts import (
    check_expert_parallel,
    first_local_expert,
    global_expert_name,
)
from megastart.loader.mapping.mappings import MappingTable, known_architectures, mapping_for
from megastart.loader.mapping.needs import Need, ParamInfo, check_config, resolve_needs
from megastart.loader.mapping.transforms import Shard

if TYPE_CHECKING:
    import torch


class UnsupportedArchitecture(PlanError):
    """No mapping table serves the checkpoint's architecture (the host's loader should run)."""


def mapping_table(meta: CheckpointMeta) -> MappingTable:
    """The first mapping table that serves one of ``config.json``'s architectures."""
    for arch in meta.architectures:
        table = mapping_for(arch)
        if table is not None:
            return table
    raise UnsupportedArchitecture(
        f"config.json of {meta.directory!r} names architectures {list(meta.architectures)}, which no "
        f"mapping table serves (known: {known_architectures()}); register one through the "
        "entry-point group 'megastart.mappings'"
    )


def local_needs(
    chunks: list[Any],
    meta: CheckpointMeta,
    table: MappingTable | None = None,
    *,
    value_model: bool = False,
    bridge: Any = None,
) -> tuple[list[ParamInfo], dict[tuple[int, str], torch.Tensor], Shard, list[Need]]:
    """What this rank needs from the checkpoint, checked against it: no collective.

    Returns this rank's parameters (canonical names), the tensors by ``(chunk,
    local name)``, its tensor-parallel shard, and one :class:`Need` per
    parameter it fills: the HF tensors, the transform and the slice (a value
    model's head may have none, nor a parameter the bridge leaves alone:
    :func:`~megastart.loader.mapping.needs.left_to_host`). Raises :class:`PlanError` (this
    rank only) when the checkpoint's config or shapes do not fit the model built.
    The benchmark's baselines use it too, so every strategy writes exactly what the
    loader writes.

    :param table: the mapping (default: the built-in table of the checkpoint's architecture).
    :param bridge: the host's Megatron-Bridge bridge whose load this one replaces: its
        registry decides the mapping (:mod:`megastart.loader.mapping.bridge`), not ``table``.
    """
    candidates = list(_candidates(chunks))
    if bridge is not None:
        from megastart.loader.mapping.bridge import bridge_table

        table = bridge_table(
            bridge,
            [(c.name, c.module, c.buffer) for c in candidates],
            meta.architectures,
            tied=bool(_tied(chunks[0])),
            stored=lambda name: meta.tensors[name].dtype if name in meta.tensors else None,
        )
    table = table or mapping_table(meta)
    loaded = [
        c for c in candidates if not c.buffer or table.resolve(c.name, meta.config) is not None
    ]
    params = [c.info for c in loaded]
    tensors = {(c.info.chunk, c.local_name): c.tensor for c in loaded}
    megatron = _megatron_config(chunks[0])
    check_expert_parallel(meta.config, megatron, checkpoint=meta.directory)
    check_config(table, meta.config, megatron, checkpoint=meta.directory, value_model=value_model)
    shard = _shard(megatron)
    needs = resolve_needs(params, table, meta, shard, value_model=value_model)
    return params, tensors, shard, needs


_LAYER = re.compile(r"^((?:[\w]+\.)*?)decoder\.layers\.(\d+)\.")
"""A layer of a decoder: the language model's (``decoder.``, or ``language_model.decoder.`` in a
multimodal model) or a tower's (``vision_model.decoder.``)."""


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A parameter, or a persistent buffer a mapping may name (the router's expert bias:
    DeepSeek-V3's ``e_score_correction_bias``, a buffer the optimiser does not update)."""

    info: ParamInfo
    tensor: torch.Tensor
    module: Any
    buffer: bool

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def local_name(self) -> str:
        return self.info.local_name


def _candidates(chunks: list[Any]) -> Iterator[_Candidate]:
    """This rank's parameters and persistent buffers, with canonical names (global layer and
    expert numbers) and the modules that hold them."""
    for index, chunk in enumerate(chunks):
        global_layer = {  # per decoder (by prefix), its layers' global numbers
            prefix.removesuffix("decoder"): {
                str(i): str(layer.layer_number - 1) for i, layer in enumerate(module.layers)
            }
            for prefix, module in chunk.named_modules()
            if prefix.split(".")[-1] == "decoder" and hasattr(module, "layers")
        }
        first_expert = first_local_expert(_megatron_config(chunk))
        seen: set[int] = set()  # a tensor two modules share is one parameter
        for prefix, module in chunk.named_modules():
            persistent = [
                (n, b)
                for n, b in module.named_buffers(recurse=False)
                if n not in module._non_persistent_buffers_set
            ]
            own = [(n, p, False) for n, p in module.named_parameters(recurse=False)]
            for local, tensor, buffer in own + [(n, b, True) for n, b in persistent]:
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                name = f"{prefix}.{local}" if prefix else local
                canonical = global_expert_name(_canonical(name, global_layer), first_expert)
                dtype = str(tensor.dtype).removeprefix("torch.")
                info = ParamInfo(index, name, canonical, tuple(tensor.shape), dtype)
                yield _Candidate(info, tensor, module, buffer)


def _canonical(name: str, global_layer: dict[str, dict[str, str]]) -> str:
    found = _LAYER.match(name)
    if found is None or found[1] not in global_layer:
        return name
    prefix, layer = found[1], global_layer[found[1]][found[2]]
    return f"{prefix}decoder.layers.{layer}.{name[found.end() :]}"


def _tied(chunk: Any) -> Any:
    """Whether the chunk's language model ties its output layer to the embedding (a
    multimodal model holds it as ``language_model``)."""
    tied = getattr(chunk, "share_embeddings_and_output_weights", None)
    if tied is None:
        tied = getattr(
            getattr(chunk, "language_model", None), "share_embeddings_and_output_weights", None
        )
    return tied


def _megatron_config(chunk: Any) -> dict[str, Any]:
    config = chunk.config
    values = {f.name: getattr(config, f.name, None) for f in dataclasses.fields(config)}
    values["share_embeddings_and_output_weights"] = _tied(chunk)
    return values


def _shard(megatron: dict[str, Any]) -> Shard:
    from megatron.core import parallel_state

    heads = megatron["num_attention_heads"]
    return Shard(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        num_heads=heads,
        num_query_groups=megatron.get("num_query_groups") or heads,
        head_dim=megatron.get("kv_channels") or megatron["hidden_size"] // heads,
        expert_tp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        expert_tp_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )
