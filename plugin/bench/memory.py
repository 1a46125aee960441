"""Node memory of a set of rank processes: the sum of their PSS, sampled in a thread.

PSS (proportional set size) charges each process its private pages plus its
share of the pages it maps together with others (shared libraries, a
checkpoint file several ranks ``mmap``), so the sum over the ranks of one node
counts every resident page once: what the node's RAM holds for them.

A process's PSS is its private anonymous memory (``RssAnon`` in
``/proc/<pid>/status``: the ranks are spawned, not forked, so none of their
anonymous pages is shared) plus its share of file-backed and shared-memory
pages (``Pss_File + Pss_Shmem`` in ``/proc/<pid>/smaps_rollup``). Reading
``status`` costs microseconds; reading ``smaps_rollup`` makes the kernel walk
the page tables, 5-20 ms per rank on a busy 2-core machine. So the sampler
reads the anonymous part every ``period_s`` (20 ms) and the file part every
``file_every`` samples, and adds the latest of each.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Sequence


def anon_bytes(pid: int) -> int:
    """The process's resident anonymous memory (``RssAnon``), in bytes."""
    return _field(f"/proc/{pid}/status", "RssAnon:")


def shared_pss_bytes(pid: int) -> int:
    """The process's share of file-backed and shared-memory pages, in bytes."""
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        fields = dict(line.split()[:2] for line in f if line.endswith("kB\n"))
    return (int(fields["Pss_File:"]) + int(fields["Pss_Shmem:"])) * 1024


def node_pss_bytes(pids: Sequence[int]) -> int:
    """The sum of the processes' PSS now: the memory the node holds for them."""
    return sum(anon_bytes(pid) + shared_pss_bytes(pid) for pid in pids)


def reset_peak_rss(pid: int) -> None:
    """Reset the kernel's high-water mark of the process's RSS to its current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def peak_rss_bytes(pid: int) -> int:
    """The process's highest RSS since start or :func:`reset_peak_rss` (``VmHWM``).

    Kept by the kernel, so no sampler can miss it; but it counts shared pages in
    full in every process that maps them, and the ranks' peaks need not coincide.
    """
    return _field(f"/proc/{pid}/status", "VmHWM:")


def rss_bytes(pid: int) -> int:
    return _field(f"/proc/{pid}/status", "VmRSS:")


def _field(path: str, key: str) -> int:
    with open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{path} has no {key} line (kernel too old?)")


class PssSampler:
    """Samples the summed PSS of ``pids`` in a thread; keeps the peak.

    Use as a context manager around the phase to measure::

        with PssSampler(pids) as sampler:
            pool.run(load)
        sampler.peak_bytes
    """

    def __init__(
        self, pids: Sequence[int], *, period_s: float = 0.02, file_every: int = 10
    ) -> None:
        self.pids = list(pids)
        self.period_s = period_s
        self.file_every = file_every
        self.peak_bytes = 0
        self.samples = 0
        self.timeline: list[tuple[float, int]] = []
        """``(time.monotonic(), bytes)`` of every sample, for plots of memory over time."""
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="PssSampler", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the PSS sampler failed") from self._error

    @property
    def mean_period_s(self) -> float:
        return self.wall_s / max(self.samples - 1, 1)

    @property
    def cpu_share(self) -> float:
        """The sampler's CPU time as a fraction of one core over its run."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def _sample(self) -> None:
        start, cpu_start = time.monotonic(), time.thread_time()
        try:
            shared = 0
            next_at = start
            while not self._stop.is_set():
                if self.samples % self.file_every == 0:
                    shared = sum(shared_pss_bytes(pid) for pid in self.pids)
                anon = sum(anon_bytes(pid) for pid in self.pids)
                self.peak_bytes = max(self.peak_bytes, anon + shared)
                self.timeline.append((time.monotonic(), anon + shared))
                self.samples += 1
                next_at = max(next_at + self.period_s, time.monotonic())
                self._stop.wait(next_at - time.monotonic())
        except BaseException as e:  # re-raised in __exit__, on the caller's thread
            self._error = e
        finally:
            self.wall_s = time.monotonic() - start
            self.cpu_s = time.thread_time() - cpu_start


def release_free_memory() -> None:
    """Return freed heap to the OS, so PSS shows what is still in use.

    glibc keeps freed chunks below its (adaptive, up to 32 MiB) mmap threshold
    in the heap; without ``malloc_trim`` a loader that freed everything would
    still look as if it held its buffers.
    """
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return
    libc.malloc_trim(0)
