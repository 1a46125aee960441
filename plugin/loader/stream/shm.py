"""Node-shared bucket memory: one POSIX shared-memory segment per node and load.

The node leader creates the segment (``/dev/shm/megastart-loader-<ns>-<pid>-<token>``,
the node's page of the board, :mod:`megastart.loader.stream.node`; its later segments
add ``-<n>``), filled under a ``.part`` name until it is whole, every other
rank of the node maps it by name, and once all have mapped it the leader
unlinks the name: from then on the memory lives only as long as some
process maps it, so a killed process leaks nothing. A leader killed between
creating and unlinking leaves a name behind; the next load on the node removes
every ``megastart-loader-`` segment whose creator process is gone
(:func:`sweep_stale`). ``<ns>`` is the creator's PID namespace: containers that share
``/dev/shm`` (``--ipc=host``) each have their own, where another's pids mean nothing, so
a sweep removes only the names of its own namespace.

The segment holds a few bucket-sized buffers that are reused for the whole load:
first touch of fresh shared memory costs about as much as a copy of it, so one
segment per bucket would cost more than the copies it saves. Space is
reserved with ``posix_fallocate`` when the segment is made, so a ``/dev/shm``
too small for it is an error naming the size, not a ``SIGBUS`` mid-load.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from megastart.loader.stream.registration import on_own_thread

if TYPE_CHECKING:
    import torch

    from megastart.loader.stream.registration import Driver

SHM_DIR = Path("/dev/shm")
PREFIX = "megastart-loader-"


class Segment:
    """One shared-memory segment mapped in this process, as a ``uint8`` tensor."""

    def __init__(self, name: str, nbytes: int = 0, *, create: bool) -> None:
        """Make (``create``) a segment of ``nbytes``, or map an existing one whole."""
        import torch

        self.name = name
        self._path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self._path, flags, 0o600)
        try:
            if create:
                _reserve(fd, nbytes, self._path)
            else:
                nbytes = os.fstat(fd).st_size
            self.nbytes = nbytes
            # torch maps it and keeps no descriptor (``mmap.mmap`` would keep one per segment,
            # against the open-files limit the reader's shards share)
            self.tensor: torch.Tensor | None = torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=max(nbytes, 1), dtype=torch.uint8
            )
        except BaseException:
            if create:
                self._path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._registered: Driver | None = None
        """The driver that page-locked the mapping, if it is."""

    @classmethod
    def create(
        cls, nbytes: int, *, name: str | None = None, fill: Callable[[Segment], None] | None = None
    ) -> Segment:
        """A new segment (the node leader's), sweeping stale ones first: named ``name`` (one
        that starts as this process's new ones do, for :func:`sweep_stale`), or anew.

        ``fill`` writes it before it takes its name: a rank that finds the name finds it whole.
        """
        sweep_stale()
        name = name or f"{PREFIX}{_namespace()}-{os.getpid()}-{secrets.token_hex(6)}"
        segment = cls(f"{name}.part", nbytes, create=True)
        try:
            if fill is not None:
                fill(segment)
            segment._rename(segment.name.removesuffix(".part"))
        except BaseException:
            segment.unlink()
            segment.close()
            raise
        return segment

    @staticmethod
    def exists(name: str) -> bool:
        """Whether a segment of ``name`` has been made whole (and not yet unlinked)."""
        return (SHM_DIR / name).exists()

    def _rename(self, name: str) -> None:
        os.rename(self._path, SHM_DIR / name)
        self.name, self._path = name, SHM_DIR / name

    @classmethod
    def open(cls, name: str) -> Segment:
        """Map the segment the node leader made, at the size it made it."""
        return cls(name, create=False)

    def unlink(self) -> None:
        """Remove the name (every local rank has mapped it); the memory stays mapped."""
        self._path.unlink(missing_ok=True)

    def pin(self, driver: Driver) -> None:
        """Page-lock the mapping for CUDA (``cudaHostRegister``, through the rank's ``driver``):
        copies to the GPU then run at the link's rate with no staging copy, from every process
        of the node at once."""
        assert self.tensor is not None
        page_lock(driver, self.tensor, "the shared-memory segment")
        self._registered = driver

    def close(self) -> None:
        """Unregister and drop this object's view: the memory is unmapped when the last
        tensor viewing it goes (a read thread left stalled keeps it mapped until it ends)."""
        if self._registered is not None and self.tensor is not None:
            page_unlock(self._registered, self.tensor)
            self._registered = None
        self.tensor = None


def sweep_stale() -> list[str]:
    """Remove the loader segments of this PID namespace whose creator process has exited;
    their names. Another namespace's are left to a sweep there (:func:`creator`)."""
    removed = []
    here = _namespace()
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        made_by = creator(path.name)
        if made_by is not None and made_by[0] == here and not _alive(made_by[1]):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def creator(name: str) -> tuple[int, int] | None:
    """The PID namespace and pid of the process that made the segment ``name``; ``None`` for
    a name of another form (an older megastart's, with no namespace: its pid means nothing
    here)."""
    parts = name.removeprefix(PREFIX).split("-", 2)
    if len(parts) < 3 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def _namespace() -> int:
    """This process's PID namespace (its inode; 0 where ``/proc`` does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _reserve(fd: int, nbytes: int, path: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as e:
        free = os.statvfs(SHM_DIR)
        raise OSError(
            e.errno,
            f"cannot reserve {nbytes / 2**20:.0f} MiB of shared memory for {path} "
            f"({free.f_bavail * free.f_frsize / 2**20:.0f} MiB free in {SHM_DIR}): give the "
            "container more (docker --shm-size, or --ipc=host) or lower rank0_loader.bucket_mb",
        ) from e


def page_lock(driver: Driver, tensor: torch.Tensor, what: str) -> None:
    """Register ``tensor``'s host memory with CUDA (``cudaHostRegister``, through ``driver`` on a
    thread of its own: :func:`~megastart.loader.stream.registration.on_own_thread`), so copies to the
    GPU read it at the link's rate with no staging copy of the driver's."""
    nbytes = tensor.numel() * tensor.element_size()
    error = on_own_thread(lambda: driver.register(tensor.data_ptr(), nbytes, 0))
    if error:
        raise RuntimeError(
            f"cudaHostRegister of {what} ({nbytes} bytes) failed ({error}): raise the "
            "locked-memory limit (ulimit -l) or lower rank0_loader.bucket_mb"
        )


def page_unlock(driver: Driver, tensor: torch.Tensor) -> None:
    """Undo :func:`page_lock` (the memory stays mapped)."""
    on_own_thread(lambda: driver.unregister(tensor.data_ptr()))
