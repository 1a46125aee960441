"""The reader's reads: one tensor's bytes (or rows) straight into a caller's buffer."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megastart.loader.checkpoint.entries import ITEMSIZE, CheckpointMeta, TensorEntry
from megastart.loader.checkpoint.errors import CheckpointError
from megastart.loader.checkpoint.files import OpenShards, check_unchanged
from megastart.loader.checkpoint.pickles import load_bin

if TYPE_CHECKING:
    import torch


class TensorReader:
    """Reads tensors of one checkpoint into caller-provided buffers; counts the bytes read.

    Used by the reader rank's prefetch threads only; safetensors reads may run
    in several threads at once. At most :data:`~.files.MAX_OPEN_SHARDS` files are
    open at once, each checked to be the version the metadata was read from, until
    :meth:`close`.
    """

    def __init__(self, meta: CheckpointMeta) -> None:
        self.meta = meta
        self.bytes_read = 0
        self._shards = OpenShards(meta.directory, meta.shards)
        self._bin: tuple[str, dict[str, torch.Tensor]] | None = None
        """The one pickle file mapped at a time, and its state dict."""
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

    def check_unchanged(self) -> None:
        """Raise unless every shard still is the version read (after the last byte)."""
        check_unchanged(self.meta.directory, self.meta.shards)

    def close(self) -> None:
        self._shards.close()
        self._bin = None

    def _read_rows(self, whole: TensorEntry, out: torch.Tensor, first_row: int, stop: int) -> None:
        import torch

        entry = whole.row_range(first_row, stop)
        dtype = getattr(torch, entry.dtype)
        if self.meta.format == "bin":
            tensor = self._bin_file(entry.file)[entry.name]
            out.copy_(tensor if entry is whole else tensor[first_row:stop])
        else:
            direct = out.dtype == dtype and out.device.type == "cpu"
            target = out if direct else torch.empty(entry.shape, dtype=dtype)
            with self._shards.fd(entry.file) as fd:
                read_exact(
                    fd, entry, target.view(torch.uint8).reshape(-1).numpy(), self.meta.directory
                )
            if not direct:
                out.copy_(target)
        with self._lock:
            self.bytes_read += (
                entry.end - entry.start if entry.start >= 0 else out.numel() * ITEMSIZE[entry.dtype]
            )

    def _bin_file(self, name: str) -> dict[str, torch.Tensor]:
        if self._bin is None or self._bin[0] != name:
            self._bin = None  # one pickle file mapped at a time
            self._bin = name, load_bin(Path(self.meta.directory) / name, self.meta.shards[name])
        return self._bin[1]


def read_exact(fd: int, entry: TensorEntry, out: Any, directory: str) -> None:
    """Read ``entry``'s bytes from ``fd`` (its file, in checkpoint ``directory``) into the
    writable buffer ``out``."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], entry.start + done)
        if n == 0:
            raise CheckpointError(
                f"{str(Path(directory) / entry.file)!r} ended while reading tensor "
                f"{entry.name!r} (byte {entry.start + done} of {entry.end}): the file was truncated "
                "while loading"
            )
        done += n
