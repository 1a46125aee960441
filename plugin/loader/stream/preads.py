"""Copies out of the page cache by ``pread``: none of the files' pages enter a rank's page tables.

A copy out of the load's mapping of a file (:class:`~megastart.loader.stream.pagecache.Window`)
faults the pages it reads into the rank's page tables, a fault per few pages, and
the rank drops them again after the bucket (``MADV_DONTNEED``); four ranks touching
the same folios also share their map counts. ``pread`` into a contiguous CPU
destination of the piece's dtype copies the same bytes out of the page cache inside
the kernel: on the 2-core machine a warm 1 GB load at TP2 x PP2 took about 30 ms
less of the node's CPU (docs/performance.md). A strided piece (a row-parallel slice's
columns), a converted one or one into CUDA is still copied out of the mapping: read
whole rows instead, it would read the other ranks' columns too.

The same descriptors tell whether a range is resident (``cachestat``, where the kernel has it:
a third of ``mincore``'s CPU, which the reader spent on every bucket of a warm load).

A ``pread`` of a page that is not resident reads it from storage, as a fault would;
the ranks read only what the reader has said is resident, or what ``cachestat`` found
there, and their descriptors read nothing ahead (``POSIX_FADV_RANDOM``), so the reader
remains the one that reads the storage. A read error is an
exception in the rank, naming the file (a fault would be a ``SIGBUS``).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from megastart.loader.checkpoint import CheckpointMeta, open_shard

if TYPE_CHECKING:
    import torch

CACHESTAT = 451
"""``cachestat``'s system call number (the same on every architecture; Linux 6.5 and later)."""

OPEN_AT_ONCE = 4
"""Descriptors a rank keeps open for its reads: a bucket's slots lie in a file or two, and the
load's mappings hold none, so ``ulimit -n`` still bounds nothing here."""


def source_of(
    maps: dict[str, torch.Tensor], target: torch.Tensor, piece: torch.Tensor
) -> tuple[str, int] | None:
    """Where ``piece`` lies in one of the files mapped as ``maps`` (file -> its mapping): the file
    and the byte offset, if it can be read into ``target`` by ``pread`` (a contiguous view of
    the mapping in ``target``'s dtype, into a contiguous CPU ``target``); else ``None``."""
    if (
        target.device.type != "cpu"
        or piece.dtype != target.dtype
        or not piece.is_contiguous()
        or not target.is_contiguous()
        or piece.shape != target.shape
    ):
        return None
    nbytes = piece.numel() * piece.element_size()
    address = piece.data_ptr()
    for file, data in maps.items():
        offset = address - data.data_ptr()
        if 0 <= offset and offset + nbytes <= data.numel():
            return file, offset
    return None


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recent")
    ]


_no_cachestat = threading.Event()
"""Set once the kernel refused ``cachestat`` (older than 6.5, or a seccomp filter)."""


class Descriptors:
    """Read-only descriptors of the checkpoint's files, each checked to be the version the
    metadata was read from, at most :data:`OPEN_AT_ONCE` open (the least recently used is
    closed first); :meth:`close` closes them all."""

    def __init__(self, meta: CheckpointMeta) -> None:
        self.meta = meta
        self._open: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        """No descriptor opens after :meth:`close` (the reader's thread may outlive a failed load)."""

    def read(self, file: str, offset: int, target: torch.Tensor) -> None:
        """``target``'s bytes (contiguous, on the CPU) from ``file`` at ``offset``; a read error,
        or a file that ends first, raises, naming the file."""
        nbytes = target.numel() * target.element_size()
        if nbytes == 0:
            return
        view = memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")
        with self._lock:  # a duplicate: the reader's thread may close the original meanwhile
            fd = os.dup(self._descriptor(file))
        done = 0
        try:
            while done < nbytes:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got == 0:
                    raise OSError(f"the file ended at byte {offset + done} (truncated?)")
                done += got
        except OSError as e:
            path = os.path.join(self.meta.directory, file)
            raise OSError(
                f"reading {nbytes} bytes of {path!r} at offset {offset} failed: {e}"
            ) from e
        finally:
            os.close(fd)

    def in_page_cache(self, file: str, first: int, end: int) -> bool | None:
        """Whether bytes ``[first, end)`` of ``file`` are all in the page cache, by ``cachestat``:
        it counts the file's cached pages where ``mincore`` reports on each page of a mapping,
        a third of the CPU over 250 MB here (a page still being read counts as cached: a copy
        of it waits for that read). ``None`` where the kernel has no ``cachestat``."""
        if end <= first:
            return True
        if _no_cachestat.is_set():
            return None
        page = mmap.PAGESIZE
        span, stat = _Range(first, end - first), _Stat()
        with self._lock:
            if self._closed:
                return None
            fd = self._descriptor(file)
            if _libc().syscall(CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
                _no_cachestat.set()
                return None
        return int(stat.cache) == (end - 1) // page - first // page + 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._open:
                os.close(self._open.popitem()[1])

    def _descriptor(self, file: str) -> int:
        if self._closed:
            raise RuntimeError(f"read {file!r} after the load's descriptors were closed")
        fd = self._open.get(file)
        if fd is not None:
            self._open.move_to_end(file)
            return fd
        if len(self._open) >= OPEN_AT_ONCE:
            os.close(self._open.popitem(last=False)[1])
        fd = self._open[file] = open_shard(self.meta.directory, file, self.meta.shards[file])
        # no read-ahead from a rank's reads: the reader alone asks the storage for pages
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc
