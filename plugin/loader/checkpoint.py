"""Reading an HF checkpoint directory: ``config.json``, safetensors headers, tensor bytes.

Only the reader rank touches the files. :func:`read_metadata` reads the config
and the headers (a few KiB per shard) and checks everything that can be checked
without reading the tensors: the index names existing shards inside the
checkpoint directory, each header passes ``safetensors``' own validation
(offsets start at 0, contiguous, non-overlapping, each tensor's byte size is
its shape times its dtype's, the data covers the file), dtypes are known. The
offsets themselves the library does not expose, so they are parsed here.
:class:`TensorReader` then reads one tensor's bytes straight into a caller's
buffer (a slice of a bucket), from the file the index names, relative to the
checkpoint directory: the file that was validated.

``.bin`` (pickle) checkpoints are refused unless ``allow_pickle`` is set; then
they are read with ``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

import json
import os
import posixpath
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded as it is (message says why and what to do)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes are: file, dtype (a ``torch`` dtype name), shape, byte range."""

    name: str
    file: str
    """Path relative to the checkpoint directory, as the index names it (``sub/x.safetensors``)."""
    dtype: str
    shape: tuple[int, ...]
    start: int = -1
    """Absolute byte offset in ``file`` (``-1`` for ``.bin`` files)."""
    end: int = -1

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def row_range(self, first: int, stop: int) -> TensorEntry:
        """Rows ``[first, stop)`` of this tensor (dim 0), as an entry of their own bytes."""
        if (first, stop) == (0, self.shape[0] if self.shape else 1):
            return self
        row_bytes = self.numel // self.shape[0] * ITEMSIZE[self.dtype]
        start = self.start + first * row_bytes if self.start >= 0 else -1
        end = self.start + stop * row_bytes if self.start >= 0 else -1
        return replace(self, shape=(stop - first, *self.shape[1:]), start=start, end=end)


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    """Everything the plan needs from the checkpoint; small, broadcast once to every rank."""

    directory: str
    config: dict[str, Any]
    tensors: dict[str, TensorEntry]
    format: str
    """``"safetensors"`` or ``"bin"``."""
    architectures: tuple[str, ...] = ()
    """``config.json``'s ``architectures``, or where it has none, the class
    ``transformers``' Auto classes pick for its ``model_type``."""


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of an HF checkpoint directory, with errors that say what is missing."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} does not exist or is not a directory; "
            "pass the directory that holds config.json and the *.safetensors files"
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{str(config_path)!r} is missing: the loader needs the model's config.json "
            "to check that the checkpoint matches the model that was built"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(config_path)!r} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{str(config_path)!r} holds a JSON {type(config).__name__}, not an object: write "
            "the model's config with transformers' save_pretrained (a JSON object with "
            "model_type, hidden_size, ...)"
        )
    return config


def read_metadata(directory: str | os.PathLike[str], *, allow_pickle: bool) -> CheckpointMeta:
    """The config and the header of every shard, checked; reads no tensor data."""
    path = Path(directory)
    config = read_config(path)
    architectures = resolve_architectures(config, path / "config.json")
    safetensors_files = _shard_files(path, SAFETENSORS_INDEX, "*.safetensors")
    if safetensors_files:
        tensors = _safetensors_entries(path, safetensors_files)
        return CheckpointMeta(str(path), config, tensors, "safetensors", architectures)
    bin_files = _shard_files(path, BIN_INDEX, "*.bin")
    if not bin_files:
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} holds no *.safetensors (or *.bin) weight files"
        )
    if not allow_pickle:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has only pickle (.bin) weight files {bin_files[:3]}; "
            "pickle can run arbitrary code, so megastart refuses it by default. Convert the "
            "checkpoint to safetensors, or set rank0_loader.allow_pickle=true "
            "(MEGASTART_RANK0_LOADER_ALLOW_PICKLE=1) to read it with torch.load(weights_only=True)"
        )
    return CheckpointMeta(str(path), config, _bin_entries(path, bin_files), "bin", architectures)


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
        from megastart.loader.mappings import architecture_for_model_type

        return architecture_for_model_type(model_type)
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def _shard_files(path: Path, index_name: str, pattern: str) -> list[str]:
    """The shard files, relative to ``path``: those the index names (each must exist
    inside ``path``), else every file matching ``pattern`` at its top level."""
    index_path = path / index_name
    if not index_path.is_file():
        return sorted(p.name for p in path.glob(pattern))
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted({_inside(path, index_path, f) for f in weight_map.values()})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{str(index_path)!r} is not a valid index (expected a JSON object with a "
            f"'weight_map' of tensor name -> shard file): {e!r}"
        ) from e
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        names = [n for n, f in weight_map.items() if f == missing[0]][:3]
        raise CheckpointError(
            f"{str(index_path)!r} names shard(s) {missing} that do not exist in {str(path)!r} "
            f"(e.g. {missing[0]!r} should hold {names}); the download is incomplete: "
            "fetch the missing shards again"
        )
    return files


def _inside(path: Path, index_path: Path, file: str) -> str:
    """``file`` as the index names it, normalised; refused if it leaves ``path``.

    The check is on the name, not on where symlinks point: a Hugging Face cache
    snapshot's files are links into ``../../blobs``, and load like any file.
    """
    if not isinstance(file, str):
        raise TypeError(f"shard names must be strings, got {file!r}")
    normal = posixpath.normpath(file)
    if posixpath.isabs(normal) or normal == ".." or normal.startswith("../"):
        raise CheckpointError(
            f"{str(index_path)!r} names shard {file!r}, which lies outside the checkpoint "
            f"directory {str(path)!r}; shard names must be relative paths inside it "
            '("model-00001-of-00002.safetensors", "sub/model.safetensors"): fix the index'
        )
    return normal


def _safetensors_entries(path: Path, files: list[str]) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for entry in _read_header(path, file):
            _add(entries, entry, path)
    return entries


def _add(entries: dict[str, TensorEntry], entry: TensorEntry, path: Path) -> None:
    if entry.name in entries:
        raise CheckpointError(
            f"tensor {entry.name!r} is stored twice: in {entries[entry.name].file!r} "
            f"and in {entry.file!r} (directory {str(path)!r}); a checkpoint holds each tensor "
            "once: remove the stale shard, or fix the index"
        )
    entries[entry.name] = entry


def _read_header(path: Path, name: str) -> list[TensorEntry]:
    """One shard's tensors: validated by ``safetensors`` itself, offsets parsed here."""
    file = path / name
    _validate(file)
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    entries = []
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{str(file)!r}: tensor {tensor!r} has dtype {info['dtype']}, which the loader "
                f"cannot read (known: {sorted(_SAFETENSORS_DTYPES)}); convert the checkpoint"
            )
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        entries.append(TensorEntry(tensor, name, dtype, shape, base + begin, base + end))
    return entries


def _validate(file: Path) -> None:
    """Raise unless ``safetensors`` accepts the file (it maps the file and reads only the header)."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt"):
            pass
    except Exception as e:  # SafetensorError, or an OSError from mapping the file
        raise CheckpointError(
            f"{str(file)!r} ({file.stat().st_size} bytes) is not a valid safetensors file ({e}); "
            "the file is corrupt or truncated: download it again"
        ) from e


def _bin_entries(path: Path, files: list[str]) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, tensor in _load_bin(path / file).items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            _add(entries, TensorEntry(name, file, dtype, tuple(tensor.shape)), path)
    return entries


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    import torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(
            f"{str(file)!r} could not be read with torch.load(weights_only=True): {e}"
        ) from e
    fix = "save the model's state dict (tensor name -> tensor) with torch.save, or convert to safetensors"
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{str(file)!r} holds a {type(state).__name__}, not a state dict; {fix}"
        )
    if not state:
        raise CheckpointError(f"{str(file)!r} holds an empty state dict (no tensors); {fix}")
    odd = next(
        (k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)),
        None,
    )
    if odd is not None:
        raise CheckpointError(
            f"{str(file)!r} holds {odd!r} -> {type(state[odd]).__name__}, not tensor name -> tensor; {fix}"
        )
    return state


ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""Bytes per element of each dtype a checkpoint may hold (``torch`` names)."""


class TensorReader:
    """Reads tensors of one checkpoint into caller-provided buffers; counts the bytes read.

    Used by the reader rank's prefetch threads only; safetensors reads may run
    in several threads at once. Files are opened once and kept open until
    :meth:`close`.
    """

    def __init__(self, meta: CheckpointMeta) -> None:
        self.meta = meta
        self.bytes_read = 0
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._reads: dict[int, TensorEntry] = {}
        """The tensor each thread is reading now, by thread, oldest read first."""

    @property
    def reading(self) -> TensorEntry | None:
        """The tensor of the oldest read in progress (``None`` between reads), to name a stalled read."""
        with self._lock:
            return next(iter(self._reads.values()), None)

    def read_into(self, entry: TensorEntry, out: torch.Tensor, first_row: int = 0) -> None:
        """Fill ``out`` (contiguous, any dtype) with the tensor's rows from ``first_row`` on, converting.

        ``out`` has the shape of the rows read: the whole tensor's, or a dim-0 range of it.
        """
        stop = first_row + (out.shape[0] if out.dim() else 1)
        with self.tracking(entry):
            self._read_rows(entry, out, first_row, stop)

    @contextmanager
    def tracking(self, entry: TensorEntry) -> Iterator[None]:
        """Record that this thread reads ``entry`` (see :attr:`reading`) while the block runs."""
        thread = threading.get_ident()
        with self._lock:
            self._reads[thread] = entry
        try:
            yield
        finally:
            with self._lock:
                del self._reads[thread]

    def count(self, nbytes: int) -> None:
        """Add bytes read some other way than :meth:`read_into` (into the page cache)."""
        with self._lock:
            self.bytes_read += nbytes

    def _read_rows(self, whole: TensorEntry, out: torch.Tensor, first_row: int, stop: int) -> None:
        import torch

        entry = whole.row_range(first_row, stop)
        dtype = getattr(torch, entry.dtype)
        if self.meta.format == "bin":
            tensor = self._bin_file(entry.file)[entry.name]
            out.copy_(tensor if entry is whole else tensor[first_row:stop])
        elif out.dtype == dtype and out.device.type == "cpu":
            read_exact(self._file(entry.file), entry, out.view(torch.uint8).reshape(-1).numpy())
        else:
            staging = torch.empty(entry.shape, dtype=dtype)
            read_exact(self._file(entry.file), entry, staging.view(torch.uint8).reshape(-1).numpy())
            out.copy_(staging)
        with self._lock:
            self.bytes_read += (
                entry.end - entry.start if entry.start >= 0 else out.numel() * ITEMSIZE[entry.dtype]
            )

    def close(self) -> None:
        for f in self._files.values():
            if hasattr(f, "close"):
                f.close()
        self._files.clear()

    def _file(self, name: str) -> Any:
        with self._lock:
            if name not in self._files:
                self._files[name] = open(Path(self.meta.directory) / name, "rb", buffering=0)
            return self._files[name]

    def _bin_file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._files:
            self._files.clear()  # one pickle file mapped at a time
            self._files[name] = _load_bin(Path(self.meta.directory) / name)
        return self._files[name]


def read_exact(f: Any, entry: TensorEntry, out: Any) -> None:
    """Read ``entry``'s bytes from open file ``f`` into the writable buffer ``out``."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(f.fileno(), [view[done:]], entry.start + done)
        if n == 0:
            raise CheckpointError(
                f"{f.name!r} ended while reading tensor "
                f"{entry.name!r} (byte {entry.start + done} of {entry.end}): the file was truncated "
                "while loading"
            )
        done += n
