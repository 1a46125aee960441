"""Run a function on every rank of a local torch.distributed world (gloo, CPU).

The tests, the CPU demo and the benchmarks need many short distributed runs.
Starting a fresh world for each costs seconds (every process imports torch and
Megatron), so :class:`RankPool` keeps ``world_size`` worker processes alive,
each with ``torch.distributed`` initialised over gloo, and runs one function
after another on all of them::

    with RankPool(4) as pool:
        logits = pool.run(my_rank_function, "llama", tp=2)  # one result per rank

A suite that starts many worlds (a rank killed on purpose takes its world with it) calls
:func:`preload_ranks` first: its ranks then fork from a server that imported torch and
Megatron once.

Nothing here may hang: every wait is bounded by ``timeout_s``. When a rank
raises, every rank's traceback is reported; when a rank dies, hangs, or keeps
running after another rank failed, the whole pool is killed and the next
:meth:`RankPool.run` starts fresh processes. No worker outlives the pool: they
are killed by :meth:`RankPool.close`, at interpreter exit, and (on Linux) when
the parent process dies (a preloading server's ranks: when the server dies, which it does
when this process dies).
"""

from __future__ import annotations

import pickle
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from megastart.harness.worker import worker_main

SIGNAL_LOOK_S = 0.5
"""How often :meth:`RankPool.run` lets the main thread see a signal (Ctrl-C) while it waits."""

EnvSpec = Mapping[str, str] | Callable[[int], Mapping[str, str]] | None
"""Environment variables for the workers: one mapping for all, or one per rank."""


_preloaded: tuple[str, ...] = ()
"""What :func:`preload_ranks` had the fork server import (empty: ranks start by ``spawn``)."""


def preload_ranks(*modules: str) -> None:
    """Start the ranks of this process's later pools by forking a server that imported
    ``modules`` once (``multiprocessing``'s fork server), not as fresh interpreters that each
    import them: a world of four that imports torch and Megatron then starts in about a second
    on two cores, not in twenty.

    The server imports ``modules`` with this process's environment and ``sys.path`` as they are
    at its start, before any pool's ``env``: preload only modules that read nothing a pool sets
    per rank at import. Once per process, before its first pool.
    """
    global _preloaded
    import multiprocessing

    if _preloaded and modules != _preloaded:
        raise RuntimeError(f"preload_ranks{modules}: this process preloads {_preloaded} already")
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(modules))
    _preloaded = modules


class RankFailure(RuntimeError):
    """A task failed on at least one rank: raised, or the rank died or did not answer."""


class RankPool:
    """``world_size`` persistent processes forming one gloo world on 127.0.0.1.

    Each worker sets the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, then ``env``),
    copies the parent's ``sys.path`` (so functions defined in test modules can
    be pickled by reference), calls ``init_process_group("gloo")`` with
    ``timeout_s`` as the collective timeout and ``torch.set_num_threads(1)``.

    :param world_size: number of ranks.
    :param timeout_s: bound on starting the world and on each :meth:`run`.
    :param env: extra environment variables, a mapping for every rank or a
        function ``rank -> mapping`` (e.g. to simulate several nodes through
        ``LOCAL_RANK``). Applied before the worker imports torch (after the modules
        :func:`preload_ranks` named, where it was called).
    :param grace_s: once one rank has failed, how long the others may still
        take to report (their tracebacks usually say the peer went away) before
        the pool is killed.
    :param backend: ``"gloo"``, or ``"nccl"`` (each rank on GPU ``rank % device_count``,
        as the GPU tests run one process per GPU role).
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout_s: float = 120.0,
        env: EnvSpec = None,
        grace_s: float = 10.0,
        backend: str = "gloo",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"RankPool: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._env = env
        self._backend = backend
        self._workers: list[_Worker] = []
        self._store: Any = None
        self._finalizer: weakref.finalize | None = None
        self._start()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether the worker processes are running (False after a teardown)."""
        return bool(self._workers)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be a module-level function (pickled by reference); the
        arguments and results must pickle. If the pool was torn down by an
        earlier failure, fresh processes are started first.

        :raises RankFailure: if any rank raised (the message holds every failing
            rank's traceback; the pool stays usable when all ranks answered),
            died, or did not answer within ``timeout_s`` (the pool is killed).
        """
        if not self._workers:
            self._start()
        task = pickle.dumps((fn, args, kwargs))
        what = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)!s}"
        try:
            for worker in self._workers:
                try:
                    worker.conn.send_bytes(task)
                except OSError:  # the worker died while idle: collected below as dead
                    pass
            results = self._collect(what, time.monotonic() + self.timeout_s)
        except RankFailure:
            raise
        except BaseException:  # e.g. KeyboardInterrupt: the ranks are mid-task, unusable
            self.close()
            raise
        return [value for _, value in results]

    def close(self) -> None:
        """Kill every worker process and release the rendezvous store. Idempotent."""
        workers, self._workers = self._workers, []
        _kill(workers)
        self._store = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def _start(self) -> None:
        import multiprocessing

        from torch.distributed import TCPStore

        # The parent hosts the rendezvous store on a port the OS picks, so two
        # pools (or two test sessions) never race for a "free" port.
        self._store = TCPStore(
            "127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False
        )
        # typeshed types a context by its name's literal alone: either has Pipe and Process
        context: Any = multiprocessing.get_context("forkserver" if _preloaded else "spawn")
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe(duplex=True)
            env = self._env(rank) if callable(self._env) else self._env
            process = context.Process(
                target=worker_main,
                name=f"RankPool-rank{rank}",
                args=(
                    child_end,
                    rank,
                    self.world_size,
                    self._store.port,
                    self.timeout_s,
                    dict(env or {}),
                    list(sys.path),
                    self._backend,
                ),
                daemon=True,
            )
            process.start()
            child_end.close()
            self._workers.append(_Worker(rank, process, parent_end))
        self._finalizer = weakref.finalize(self, _kill, list(self._workers))
        try:
            self._collect(
                "starting the world (init_process_group)", time.monotonic() + self.timeout_s
            )
        except BaseException:
            self.close()
            raise

    def _collect(self, what: str, deadline: float) -> list[tuple[bool, Any]]:
        """Wait for one answer per rank; on any failure raise, tearing down if needed."""
        answers: dict[int, tuple[bool, Any]] = {}
        dead: list[int] = []
        pending = {w.rank: w for w in self._workers}
        while pending and (remaining := deadline - time.monotonic()) > 0:
            handles = {h: w for w in pending.values() for h in (w.conn, w.process.sentinel)}
            # In slices: a Ctrl-C the kernel hands to another of this process's threads
            # reaches the main thread only when it next runs Python code.
            for handle in wait(list(handles), timeout=min(remaining, SIGNAL_LOOK_S)):
                worker = handles[handle]
                if worker.rank not in pending:
                    continue
                del pending[worker.rank]
                answer = _receive(worker)
                if answer is None:
                    worker.process.join(timeout=1)  # for its exit code
                    dead.append(worker.rank)
                    continue
                answers[worker.rank] = answer
            if dead or not all(ok for ok, _ in answers.values()):
                # The others may be stuck in a collective with the failed rank.
                deadline = min(deadline, time.monotonic() + self.grace_s)
        if not dead and not pending and all(ok for ok, _ in answers.values()):
            return [answers[rank] for rank in range(self.world_size)]
        teardown = bool(dead or pending)
        message = _failure_message(what, answers, sorted(dead), sorted(pending), self, teardown)
        if teardown:
            self.close()
        raise RankFailure(message)


class _Worker:
    __slots__ = ("conn", "process", "rank")

    def __init__(self, rank: int, process: Any, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 120.0,
    env: EnvSpec = None,
    **kwargs: Any,
) -> list[Any]:
    """Start a :class:`RankPool`, run ``fn`` once on every rank, and close it."""
    with RankPool(world_size, timeout_s=timeout_s, env=env) as pool:
        return pool.run(fn, *args, **kwargs)


def _receive(worker: _Worker) -> tuple[bool, Any] | None:
    """The worker's answer, or None if its pipe is closed (it died)."""
    try:
        if not worker.conn.poll():
            return None
        return pickle.loads(worker.conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _failure_message(
    what: str,
    answers: dict[int, tuple[bool, Any]],
    dead: list[int],
    silent: list[int],
    pool: RankPool,
    teardown: bool,
) -> str:
    lines = [f"RankPool(world_size={pool.world_size}): {what} failed"]
    if dead:
        codes = {w.rank: w.process.exitcode for w in pool._workers}
        lines.append(
            "ranks that died: " + ", ".join(f"{r} (exit code {codes.get(r)})" for r in dead)
        )
    if silent:
        lines.append(
            f"ranks that did not answer (timeout_s={pool.timeout_s:g}, "
            f"grace_s={pool.grace_s:g} after a failure): {silent}"
        )
    for rank in sorted(answers):
        ok, value = answers[rank]
        if not ok:
            lines.append(f"--- rank {rank} raised:\n{value.rstrip()}")
    if teardown:
        lines.append("the pool was killed; the next run() starts fresh processes")
    return "\n".join(lines)


def _kill(workers: list[_Worker]) -> None:
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
    for worker in workers:
        worker.process.join(timeout=10)
        worker.conn.close()
