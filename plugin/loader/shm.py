"""Node-shared bucket memory: one POSIX shared-memory segment per node and load.

The node leader creates the segment (``/dev/shm/megastart-loader-<pid>-<token>``),
every other rank of the node maps it by name, and once all have mapped it the
leader unlinks the name: from then on the memory lives only as long as some
process maps it, so a killed process leaks nothing. A leader killed between
creating and unlinking leaves a name behind; the next load on the node removes
every ``megastart-loader-`` segment whose creator process is gone
(:func:`sweep_stale`).

The segment holds a few bucket-sized buffers that are reused for the whole load:
first touch of fresh shared memory costs about as much as a copy of it, so one
segment per bucket would cost more than the copies it saves. Space is
reserved with ``posix_fallocate`` when the segment is made, so a ``/dev/shm``
too small for it is an error naming the size, not a ``SIGBUS`` mid-load.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from megastart.loader.copier import page_lock, page_unlock

if TYPE_CHECKING:
    import torch

    from megastart.distributed import Board

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
            self._map = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            if create:
                self._path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self._registered = False

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A new segment named for this load (the node leader); sweeps stale ones first."""
        sweep_stale()
        return cls(f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}", nbytes, create=True)

    @classmethod
    def open(cls, name: str) -> Segment:
        """Map the segment the node leader made, at the size it made it."""
        return cls(name, create=False)

    def unlink(self) -> None:
        """Remove the name (every local rank has mapped it); the memory stays mapped."""
        self._path.unlink(missing_ok=True)

    def pin(self) -> None:
        """Page-lock the mapping for CUDA (``cudaHostRegister``): copies to the GPU then run at
        the link's rate with no staging copy, from every process of the node at once."""
        assert self.tensor is not None
        page_lock(self.tensor, "the shared-memory segment")
        self._registered = True

    def close(self) -> None:
        """Unregister and drop this object's view: the memory is unmapped when the last
        tensor viewing it goes (a read thread left stalled keeps it mapped until it ends)."""
        if self._registered and self.tensor is not None:
            page_unlock(self.tensor)
            self._registered = False
        self.tensor = None


def sweep_stale() -> list[str]:
    """Remove this node's loader segments whose creator process has exited; their names."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


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


@contextmanager
def node_segment(
    board: Board,
    *,
    members: Sequence[int],
    leads: bool,
    nbytes: int,
    fill: Callable[[Segment], None] | None = None,
) -> Iterator[Segment]:
    """The node's shared segment for one use in a load: made by the leader (``members[0]``,
    who ``fill`` s it and posts its name on the load's ``board`` before the others look),
    mapped whole by the node's other ranks, its name removed once all have mapped it (a
    killed process leaks nothing), unmapped when the block ends. A leader that fails is
    announced on the board, and the others stop."""
    leader = members[0]
    segment = _made_or_mapped(board, f"segment/{leader}", leads, nbytes, fill)
    try:
        if leads:
            what = f"node ranks {list(members)} to map the shared segment"
            board.arrivals(f"mapped/{leader}", len(members) - 1, what)
            segment.unlink()
        else:
            board.arrive(f"mapped/{leader}")
        yield segment
    finally:
        if leads:
            segment.unlink()
        segment.close()


def _made_or_mapped(
    board: Board, key: str, leads: bool, nbytes: int, fill: Callable[[Segment], None] | None
) -> Segment:
    if not leads:
        return Segment.open(board.read(key, "the name of the node's shared segment"))
    segment = Segment.create(nbytes)
    try:
        if fill is not None:
            fill(segment)
        board.post(key, segment.name)
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    return segment
