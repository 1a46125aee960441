"""Reading an HF checkpoint directory: ``config.json``, safetensors headers, tensor bytes.

Only the reader rank touches the files. :func:`read_metadata` reads the config
and the headers (a few KiB per shard) and checks everything that can be checked
without reading the tensors: the index names existing shards, every tensor's
bytes lie inside its file, dtypes are known. :class:`TensorReader` then reads
one tensor's bytes straight into a caller's buffer (a slice of a bucket).

``.bin`` (pickle) checkpoints are refused unless ``allow_pickle`` is set; then
they are read with ``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_MAX_HEADER_BYTES = 100 * 2**20

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

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])


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
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(config_path)!r} is not valid JSON: {e}") from e


def read_metadata(directory: str | os.PathLike[str], *, allow_pickle: bool) -> CheckpointMeta:
    """The config and the header of every shard, checked; reads no tensor data."""
    path = Path(directory)
    config = read_config(path)
    safetensors_files = _shard_files(path, SAFETENSORS_INDEX, "*.safetensors")
    if safetensors_files:
        tensors = _safetensors_entries(path, safetensors_files)
        return CheckpointMeta(str(path), config, tensors, "safetensors")
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
    return CheckpointMeta(str(path), config, _bin_entries(path, bin_files), "bin")


def _shard_files(path: Path, index_name: str, pattern: str) -> list[str]:
    """The shard files: those the index names (each must exist), else every file matching."""
    index_path = path / index_name
    if not index_path.is_file():
        return sorted(p.name for p in path.glob(pattern))
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{str(index_path)!r} is not a valid index (expected a JSON object with a "
            f"'weight_map'): {e}"
        ) from e
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        names = [n for n, f in weight_map.items() if f == missing[0]][:3]
        raise CheckpointError(
            f"{str(index_path)!r} names shard(s) {missing} that do not exist in {str(path)!r} "
            f"(e.g. {missing[0]!r} should hold {names}); the download is incomplete: "
            "fetch the missing shards again"
        )
    return files


def _safetensors_entries(path: Path, files: list[str]) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for entry in _read_header(path / file):
            if entry.name in entries:
                raise CheckpointError(
                    f"tensor {entry.name!r} is stored twice: in {entries[entry.name].file!r} "
                    f"and in {file!r} (directory {str(path)!r})"
                )
            entries[entry.name] = entry
    return entries


def _read_header(file: Path) -> list[TensorEntry]:
    """Parse one safetensors header and check every tensor's bytes lie inside the file."""
    size = file.stat().st_size
    remedy = "the file is corrupt or truncated: download it again"
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(
                f"{str(file)!r} has {size} bytes, too few for a safetensors header; {remedy}"
            )
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                f"{str(file)!r}: its header claims {header_len} bytes but the file has {size}; {remedy}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{str(file)!r}: the safetensors header is not valid JSON ({e}); {remedy}"
            ) from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{str(file)!r}: the safetensors header is not a JSON object; {remedy}"
        )
    base = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{str(file)!r}: bad header entry for tensor {name!r}: {info!r} ({e}); {remedy}"
            ) from e
        entry = TensorEntry(name, file.name, dtype, shape, base + begin, base + end)
        if base + end > size:
            raise CheckpointError(
                f"{str(file)!r} is truncated: tensor {name!r} {list(shape)} needs bytes "
                f"{base + begin}..{base + end} but the file has {size} bytes; {remedy}"
            )
        if end - begin != entry.numel * ITEMSIZE[dtype]:
            raise CheckpointError(
                f"{str(file)!r}: tensor {name!r} of shape {list(shape)} and dtype {dtype} "
                f"should take {entry.numel * ITEMSIZE[dtype]} bytes, the header says {end - begin}; {remedy}"
            )
        entries.append(entry)
    return entries


def _bin_entries(path: Path, files: list[str]) -> dict[str, TensorEntry]:

    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, tensor in _load_bin(path / file).items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            entries[name] = TensorEntry(name, file, dtype, tuple(tensor.shape))
        del tensor
    return entries


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    import torch

    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(
            f"{str(file)!r} could not be read with torch.load(weights_only=True): {e}"
        ) from e


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

    def read_into(self, entry: TensorEntry, out: torch.Tensor, first_row: int = 0) -> None:
        """Fill ``out`` (contiguous, any dtype) with the tensor's rows from ``first_row`` on, converting.

        ``out`` has the shape of the rows read: the whole tensor's, or a dim-0 range of it.
        """
        import torch

        stop = first_row + (out.shape[0] if out.dim() else 1)
        whole = entry
        entry = entry.row_range(first_row, stop)
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
