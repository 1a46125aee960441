"""The checkpoint's metadata: ``config.json`` and the index, read and checked into a
:class:`~.entries.CheckpointMeta`."""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path
from typing import Any

from megastart.loader.checkpoint import headers, pickles
from megastart.loader.checkpoint.entries import CheckpointMeta, TensorEntry
from megastart.loader.checkpoint.errors import CheckpointError
from megastart.loader.checkpoint.files import read_regular, regular_file
from megastart.loader.checkpoint.quantised import find_quantisation

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of an HF checkpoint directory, with errors that say what is missing."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} does not exist or is not a directory; "
            "pass the directory that holds config.json and the *.safetensors files"
        )
    config_path = path / "config.json"
    if regular_file(config_path, "the model's config") is None:
        raise CheckpointError(
            f"{str(config_path)!r} is missing: the loader needs the model's config.json "
            "to check that the checkpoint matches the model that was built"
        )
    fix = "write the model's config with transformers' save_pretrained"
    config = _load_json(config_path, "the model's config", fix)
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{str(config_path)!r} holds a JSON {type(config).__name__}, not an object: {fix} "
            "(a JSON object with model_type, hidden_size, ...)"
        )
    return config


def read_metadata(directory: str | os.PathLike[str], *, allow_pickle: bool) -> CheckpointMeta:
    """The config and the header of every shard, checked; reads no tensor data."""
    path = Path(directory)
    config = read_config(path)
    architectures = resolve_architectures(config, path / "config.json")
    files, weight_map = _shard_files(path, SAFETENSORS_INDEX, "*.safetensors")
    if files:
        tensors, shards = headers.read_headers(path, files)
        if weight_map is not None:
            _check_index(path / SAFETENSORS_INDEX, weight_map, tensors)
        form = "safetensors"
    else:
        files, _ = _shard_files(path, BIN_INDEX, "*.bin")
        if not files:
            raise CheckpointError(
                f"checkpoint directory {str(path)!r} holds no *.safetensors (or *.bin) weight files"
            )
        if not allow_pickle:
            raise CheckpointError(
                f"checkpoint {str(path)!r} has only pickle (.bin) weight files {files[:3]}; "
                "pickle can run arbitrary code, so megastart refuses it by default. Convert the "
                "checkpoint to safetensors, or set rank0_loader.allow_pickle=true "
                "(MEGASTART_RANK0_LOADER_ALLOW_PICKLE=1) to read it with torch.load(weights_only=True)"
            )
        tensors, shards = pickles.read_entries(path, files)
        form = "bin"
    quantisation = find_quantisation(config, {n: (e.dtype, e.shape) for n, e in tensors.items()})
    return CheckpointMeta(str(path), config, tensors, form, architectures, shards, quantisation)


def resolve_architectures(config: dict[str, Any], config_path: Path) -> tuple[str, ...]:
    """``architectures`` of ``config.json``; where missing or empty, the one ``model_type`` maps to.

    A config written from a config object, or by a conversion, may carry only
    ``model_type``; ``transformers``' ``AutoModelForCausalLM`` then picks the
    class from its own table, and so does this (imported only here, on the
    reader, and only then), else from the mapping tables' ``model_types``.
    """
    architectures = config.get("architectures")
    if architectures and (
        not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures)
    ):
        raise CheckpointError(
            f"{str(config_path)!r}: 'architectures' must be a list of class names, e.g. "
            f'["LlamaForCausalLM"], got {architectures!r}; fix the file (transformers\' '
            "save_pretrained writes a list)"
        )
    if architectures:
        return tuple(architectures)
    model_type = config.get("model_type")
    found = causal_lm_for_model_type(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise CheckpointError(
            f"{str(config_path)!r} names no 'architectures', and its model_type {model_type!r} "
            'maps to no causal-LM class; add e.g. "architectures": ["LlamaForCausalLM"] '
            "to the file"
        )
    return (found,)


def causal_lm_for_model_type(model_type: str) -> str | None:
    """The ``AutoModelForCausalLM`` class name for ``model_type`` (``None``: none known)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        from megastart.loader.mapping.mappings import architecture_for_model_type

        return architecture_for_model_type(model_type)
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def _load_json(path: Path, what: str, fix: str) -> Any:
    """``path``'s JSON, with errors naming the file, the byte offset and ``fix``."""
    data = read_regular(path, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{str(path)!r} ({what}) is not UTF-8 text: byte {e.start} is {data[e.start]:#04x} "
            f"({e.reason}); the file is damaged or not JSON: {fix}"
        ) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        offset = len(text[: e.pos].encode())
        raise CheckpointError(
            f"{str(path)!r} ({what}) is not valid JSON: {e.msg} at byte {offset} (line "
            f"{e.lineno}, column {e.colno}); {fix}"
        ) from e


def _shard_files(
    path: Path, index_name: str, pattern: str
) -> tuple[list[str], dict[str, str] | None]:
    """The shard files, relative to ``path``, and the index's weight map: the files the index
    names (each must exist inside ``path``), else every file matching ``pattern`` at its top
    level (and no map)."""
    index_path = path / index_name
    if regular_file(index_path, "the checkpoint's index") is None:
        return sorted(p.name for p in path.glob(pattern)), None
    fix = f"write it again with transformers' save_pretrained, or remove it to load every {pattern}"
    weight_map = _weight_map(index_path, _load_json(index_path, "the checkpoint's index", fix), fix)
    files = sorted({_inside(path, index_path, f) for f in weight_map.values()})
    missing = [f for f in files if regular_file(path / f, "a shard named by the index") is None]
    if missing:
        names = [n for n, f in weight_map.items() if f == missing[0]][:3]
        raise CheckpointError(
            f"{str(index_path)!r} names shard(s) {missing} that do not exist in {str(path)!r} "
            f"(e.g. {missing[0]!r} should hold {names}); the download is incomplete: "
            "fetch the missing shards again"
        )
    return files, weight_map


def _weight_map(index_path: Path, index: Any, fix: str) -> dict[str, str]:
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(n, str) and isinstance(f, str) for n, f in weight_map.items()
    ):
        raise CheckpointError(
            f"{str(index_path)!r} is not a valid index: expected a JSON object with a "
            f"'weight_map' of tensor name -> shard file, got {_shown(index)}; {fix}"
        )
    if not weight_map:
        raise CheckpointError(
            f"{str(index_path)!r} is an index with an empty 'weight_map': it names no tensor "
            f"and no shard; {fix}"
        )
    return weight_map


def _check_index(
    index_path: Path, weight_map: dict[str, str], tensors: dict[str, TensorEntry]
) -> None:
    """Every tensor the index names is in the shard it names (a shard may hold more, as
    ``transformers`` allows)."""
    for name, file in weight_map.items():
        entry = tensors.get(name)
        if entry is None or entry.file != posixpath.normpath(file):
            where = "no shard" if entry is None else f"{entry.file!r}"
            raise CheckpointError(
                f"{str(index_path)!r} is inconsistent with the shards: it puts tensor {name!r} "
                f"in {file!r}, but {where} holds it; the index and the shards come from "
                "different saves: download the checkpoint again"
            )


def _inside(path: Path, index_path: Path, file: str) -> str:
    """``file`` as the index names it, normalised; refused if it leaves ``path``.

    The check is on the name, not on where symlinks point: a Hugging Face cache
    snapshot's files are links into ``../../blobs``, and load like any file.
    """
    normal = posixpath.normpath(file)
    if posixpath.isabs(normal) or normal == ".." or normal.startswith("../"):
        raise CheckpointError(
            f"{str(index_path)!r} names shard {file!r}, which lies outside the checkpoint "
            f"directory {str(path)!r}; shard names must be relative paths inside it "
            '("model-00001-of-00002.safetensors", "sub/model.safetensors"): fix the index'
        )
    return normal


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
