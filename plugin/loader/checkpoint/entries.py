"""What the metadata holds: where each tensor's bytes are, and the record every rank plans from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megastart.loader.checkpoint.errors import CheckpointError
from megastart.loader.checkpoint.files import ShardIdentity
from megastart.loader.checkpoint.quantised import Quantisation

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
    shards: dict[str, ShardIdentity] = field(default_factory=dict)
    """The version of each shard file the headers were read from (every open is checked
    against it)."""
    quantisation: Quantisation | None = None
    """How the checkpoint is quantised (``None``: plain floating-point weights)."""


def add_entry(entries: dict[str, TensorEntry], entry: TensorEntry, path: Path) -> None:
    """Add ``entry``, refusing a tensor stored twice."""
    if entry.name in entries:
        raise CheckpointError(
            f"tensor {entry.name!r} is stored twice: in {entries[entry.name].file!r} "
            f"and in {entry.file!r} (directory {str(path)!r}); a checkpoint holds each tensor "
            "once: remove the stale shard, or fix the index"
        )
    entries[entry.name] = entry
