"""Shard files: only regular files are opened, each checked against the identity its header
was read with, and at most :data:`MAX_OPEN_SHARDS` kept open at once.

A checkpoint replaced while it loads (a sync job, a re-download, a second job saving
to the same path) must fail the load, not load as a mix of two versions: every open
compares the file's identity (device, inode, size, modification time) with the one
taken with its header, and the reader looks at every shard once more after the last
byte (:func:`check_unchanged`). A FIFO or a device named ``*.safetensors`` would
block ``open()`` forever; it is refused before anything reads it.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from megastart.loader.checkpoint.errors import CheckpointError

MAX_OPEN_SHARDS = 16
"""Shard files one process keeps open at once (checkpoints of 100B+ models ship 160-1,000
shards; containers often allow 1,024 open files)."""

STABLE = "load again once it is stable"


class ShardIdentity(NamedTuple):
    """Which version of a file was read: equal identities, same bytes (short of a rewrite in
    place that keeps the size and the modification time)."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> ShardIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def regular_file(path: Path, what: str) -> os.stat_result | None:
    """``path``'s status if it is a regular file (symlinks followed), ``None`` if it does not
    exist; a FIFO, device, socket or directory is refused, since opening one may block."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(
            f"{str(path)!r} ({what}) is a {_kind(st.st_mode)}, not a regular file; the loader "
            "opens only regular files (a FIFO or device would block the load): replace it with "
            "the file itself"
        )
    return st


def open_regular(path: Path, what: str) -> int:
    """A read-only descriptor of regular file ``path``, opened without blocking (a FIFO put in
    its place after the check is refused too, not waited on)."""
    if regular_file(path, what) is None:
        raise CheckpointError(f"{str(path)!r} ({what}) does not exist; {STABLE}")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(
                f"{str(path)!r} ({what}) became a {_kind(mode)} while loading; {STABLE}"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, what: str) -> bytes:
    """The bytes of regular file ``path`` (a config, an index)."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def open_shard(directory: str, file: str, expected: ShardIdentity) -> int:
    """A read-only descriptor of shard ``file``, checked to be the version ``expected``."""
    path = Path(directory) / file
    fd = open_regular(path, "a shard")
    try:
        found = ShardIdentity.of(os.fstat(fd))
        if found != expected:
            raise changed(path, expected, found)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_unchanged(directory: str, shards: Mapping[str, ShardIdentity]) -> None:
    """Raise unless every shard still is the version its header was read from."""
    for file, expected in shards.items():
        path = Path(directory) / file
        try:
            found = ShardIdentity.of(os.stat(path))
        except FileNotFoundError:
            raise CheckpointError(f"{str(path)!r} was removed while loading; {STABLE}") from None
        if found != expected:
            raise changed(path, expected, found)


def as_seen_here(directory: str, shards: Mapping[str, ShardIdentity]) -> dict[str, ShardIdentity]:
    """Each shard's identity as this node sees it, checked to be the version another node read.

    Another node's mount of a shared file system numbers its device (and a FUSE mount its
    inodes) its own way: across nodes only the size and the modification time tell the
    version, and the rest of a load on this node checks against this node's identity.
    """
    here = {}
    for file, expected in shards.items():
        path = Path(directory) / file
        st = regular_file(path, "a shard")
        if st is None:
            raise CheckpointError(
                f"{str(path)!r} does not exist on this node ({socket.gethostname()}): every node "
                "that reads must see the checkpoint at the same path (a shared file system), or "
                "use rank0_loader.reader=global"
            )
        found = ShardIdentity.of(st)
        if (found.size, found.mtime_ns) != (expected.size, expected.mtime_ns):
            raise changed(path, expected, found)
        here[file] = found
    return here


def changed(path: Path, expected: ShardIdentity, found: ShardIdentity) -> CheckpointError:
    return CheckpointError(
        f"{str(path)!r} changed while loading (read as {_describe(expected)}, now "
        f"{_describe(found)}): it was replaced or rewritten during the load, which would mix "
        f"two versions of the checkpoint; {STABLE}"
    )


class OpenShards:
    """At most ``limit`` shard descriptors open at once, least recently used closed first;
    each (re)opened with the identity check. Safe to share between reading threads."""

    def __init__(
        self, directory: str, shards: Mapping[str, ShardIdentity], limit: int = MAX_OPEN_SHARDS
    ) -> None:
        self.directory = directory
        self.shards = shards
        self.limit = limit
        self._open: OrderedDict[str, int] = OrderedDict()
        self._users: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def fd(self, file: str) -> Iterator[int]:
        """The descriptor of ``file`` while the block runs (not closed under a reader)."""
        with self._lock:
            fd = self._open.get(file)
            if fd is None:
                fd = open_shard(self.directory, file, self.shards[file])
                self._open[file] = fd
            self._open.move_to_end(file)
            self._users[file] = self._users.get(file, 0) + 1
            self._close_idle()
        try:
            yield fd
        finally:
            with self._lock:
                self._users[file] -= 1

    def close(self) -> None:
        with self._lock:
            for fd in self._open.values():
                os.close(fd)
            self._open.clear()

    def _close_idle(self) -> None:
        """Close the least recently used idle files beyond the limit (a file in use stays)."""
        for file in list(self._open):
            if len(self._open) <= self.limit:
                return
            if not self._users.get(file):
                os.close(self._open.pop(file))


def _describe(identity: ShardIdentity) -> str:
    return f"inode {identity.inode}, {identity.size} bytes, mtime_ns {identity.mtime_ns}"


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "directory"),
    )
    return next((name for test, name in kinds if test(mode)), "special file")
