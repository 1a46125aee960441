"""The load's mappings of the checkpoint's files, and what the kernel says of their pages.

Each rank maps each file once for the whole load (:class:`FileMappings`: a mapping holds no
file descriptor, so ``ulimit -n`` bounds nothing here), read-only, and asks the kernel which
ranges are in the page cache (``cachestat`` through the rank's descriptors, else ``mincore``)
before it copies; the reader's window over them is :mod:`megastart.loader.stream.pagecache`.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from megastart.loader.checkpoint import CheckpointMeta, open_shard
from megastart.loader.stream.preads import Descriptors

if TYPE_CHECKING:
    import torch

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
"""``madvise`` advice that faults a range in for reading and waits (Linux 5.14 and later)."""
FAULT_AROUND = 2 << 20
"""How far beyond a range its faults may have mapped pages: fault-around, a large folio (2 MiB)."""


@functools.cache
def supported() -> bool:
    """Whether this kernel populates mappings on request (the route needs it)."""
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(MADV_POPULATE_READ, 0, mmap.PAGESIZE)
    except (OSError, ValueError):
        return False
    finally:
        probe.close()
    return True


class FileMappings:
    """Each of the checkpoint's files mapped whole and read-only, once per rank for the load
    (on first use, from any thread), unmapped when the last view of it goes; with a few
    descriptors of them for the copies read rather than mapped (:mod:`megastart.loader.stream.preads`),
    closed by :meth:`close`."""

    def __init__(self, meta: CheckpointMeta) -> None:
        self.meta = meta
        self._maps: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.files = Descriptors(meta)

    def close(self) -> None:
        """Close the descriptors (the mappings go with their last view)."""
        self.files.close()

    def __getitem__(self, file: str) -> torch.Tensor:
        """The file's mapping, as bytes."""
        with self._lock:
            data = self._maps.get(file)
            if data is None:
                meta = self.meta
                fd = open_shard(meta.directory, file, meta.shards[file])
                try:
                    data = self._maps[file] = map_file(fd, 0, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
            return data

    def in_page_cache(self, file: str, first: int, end: int) -> bool:
        """Whether bytes ``[first, end)`` of ``file`` are all in the page cache: ``cachestat``
        (:meth:`Descriptors.in_page_cache`), else one ``mincore`` over that range alone."""
        found = self.files.in_page_cache(file, first, end)
        if found is not None:
            return found
        low = first // mmap.PAGESIZE * mmap.PAGESIZE
        return resident(self[file], low, end - low)


def map_file(fd: int, offset: int, length: int) -> torch.Tensor:
    """``length`` bytes of the file open as ``fd`` from ``offset`` (a multiple of the page size)
    on, mapped as a ``uint8`` tensor that holds no file descriptor (``mmap.mmap`` keeps a
    duplicate per mapping: a load's mappings would count against ``ulimit -n``); unmapped
    when the tensor's memory is freed. Read-only: a write would fault rather than copy a
    page out of the page cache, and CUDA may register it read-only
    (:mod:`megastart.loader.stream.registration`)."""
    import torch

    lib = libc()
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    address = lib.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if address == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mapping {length} bytes of a shard failed: {os.strerror(errno)}")
    mapping: Any = type("Mapping", (ctypes.c_ubyte * length,), {})  # weak-referenceable
    pages = mapping.from_address(address)
    weakref.finalize(pages, lib.munmap, address, length)  # torch keeps ``pages`` alive
    return torch.frombuffer(pages, dtype=torch.uint8)


_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def resident(data: torch.Tensor, offset: int, length: int) -> bool:
    """Whether ``length`` bytes of the mapping ``data`` from ``offset`` (page-aligned) are all in
    the page cache (``mincore``: asks the kernel, reads nothing)."""
    return 0 not in residency(data, offset, length)


def drop_pages(data: torch.Tensor, offset: int, length: int) -> None:
    """Drop ``length`` bytes of the mapping ``data`` from ``offset`` (page-aligned) from this
    process's page tables (``MADV_DONTNEED``): the mapping and the page cache stay, and a
    page pinned for CUDA stays pinned. Best effort (see :meth:`Window.release`)."""
    length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    address, dontneed = ctypes.c_void_p(data.data_ptr() + offset), mmap.MADV_DONTNEED
    libc().madvise(address, ctypes.c_size_t(length), dontneed)


def residency(data: torch.Tensor, offset: int, length: int) -> bytes:
    """Per page of ``length`` bytes of the mapping ``data`` from ``offset`` (page-aligned): 1 if
    it is in the page cache, else 0 (all 0 where the kernel cannot tell)."""
    address = ctypes.c_void_p(data.data_ptr() + offset)
    pages = (ctypes.c_ubyte * ((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    if libc().mincore(address, ctypes.c_size_t(length), pages) != 0:
        return bytes(len(pages))
    return bytes(pages)
