"""RankPool: results in rank order, failures reported with tracebacks, no hangs, no orphans."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from support.pyrun import run_python

from megastart.harness.launch import RankFailure, RankPool, run_ranks


def rank_and_sum(offset: int, *, scale: int = 1) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, dist.get_world_size(), scale * (offset + total.item())


def fail_on_rank_one() -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    return "fine"


def exit_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(60)  # as if waiting for rank 1 in a collective


def hang() -> None:
    time.sleep(600)


def worker_pid() -> int:
    return os.getpid()


def read_env(name: str) -> str | None:
    return os.environ.get(name)


def test_results_come_back_in_rank_order() -> None:
    results = run_ranks(3, rank_and_sum, 10, scale=2, timeout_s=180)
    assert results == [(0, 3, 26.0), (1, 3, 26.0), (2, 3, 26.0)]


def test_exception_on_one_rank_is_reported_with_its_traceback_and_pool_survives() -> None:
    with RankPool(2, timeout_s=180) as pool:
        with pytest.raises(RankFailure) as failure:
            pool.run(fail_on_rank_one)
        message = str(failure.value)
        assert "rank 1 raised" in message
        assert "ValueError: rank one refuses" in message
        assert "in fail_on_rank_one" in message
        assert "rank 0 raised" not in message
        pids = pool.run(worker_pid)
        assert pool.run(worker_pid) == pids  # same processes: the pool was reused


def test_dead_rank_is_reported_and_pool_restarts() -> None:
    with RankPool(2, timeout_s=180, grace_s=1) as pool:
        pids = pool.run(worker_pid)
        start = time.monotonic()
        with pytest.raises(RankFailure, match=r"ranks that died: 1 \(exit code 3\)") as failure:
            pool.run(exit_on_rank_one)
        assert time.monotonic() - start < 15
        assert "did not answer" in str(failure.value)  # rank 0 was still sleeping
        assert not any(psutil.pid_exists(pid) for pid in pids)
        fresh = pool.run(worker_pid)
        assert set(fresh).isdisjoint(pids)


def test_hanging_task_is_reported_after_timeout() -> None:
    with RankPool(2, timeout_s=180) as pool:
        pids = pool.run(worker_pid)
        pool.timeout_s = 2
        start = time.monotonic()
        with pytest.raises(RankFailure, match=r"did not answer.*\[0, 1\]"):
            pool.run(hang)
        assert 2 <= time.monotonic() - start < 10
        assert not any(psutil.pid_exists(pid) for pid in pids)


def test_close_leaves_no_process_behind() -> None:
    pool = RankPool(2, timeout_s=180)
    pids = pool.run(worker_pid)
    pool.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)
    workers = [
        child
        for child in psutil.Process().children(recursive=True)
        if "spawn_main" in " ".join(child.cmdline())
    ]
    assert not workers


def imported(module: str) -> bool:
    return module in sys.modules


def test_ranks_of_a_preloading_server_hold_its_modules_before_their_first_task() -> None:
    """preload_ranks: the ranks fork from a server that imported the modules (``tabnanny``
    here, which nothing else imports), the pool's ``env`` still reaches each rank, and a call
    naming other modules is refused."""
    assert run_ranks(1, imported, "tabnanny") == [False]  # not what a rank imports by itself
    here = Path(__file__).parent
    out = run_python(
        f"""
        import sys
        sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]
        from megastart.harness.launch import RankPool, preload_ranks
        from test_launch import imported, read_env

        preload_ranks("tabnanny")
        try:
            preload_ranks("json")
        except RuntimeError as e:
            print("refused:", e)
        with RankPool(2, env={{"MEGASTART_TEST_VALUE": "set"}}) as pool:
            print(pool.run(imported, "tabnanny"), pool.run(read_env, "MEGASTART_TEST_VALUE"))
        """
    ).stdout.splitlines()
    assert out == [
        "refused: preload_ranks('json',): this process preloads ('tabnanny',) already",
        "[True, True] ['set', 'set']",
    ]


def test_env_reaches_each_rank() -> None:
    values = run_ranks(
        2, read_env, "MEGASTART_TEST_VALUE", env=lambda r: {"MEGASTART_TEST_VALUE": f"r{r}"}
    )
    assert values == ["r0", "r1"]


def interrupt_this_thread() -> None:
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


def test_interrupt_during_run_kills_the_workers() -> None:
    """Ctrl-C stops a run within a second, even when the kernel hands the signal to another
    thread of the process than the one waiting (here: the timer's own)."""
    # A shell starts a background job with SIGINT ignored, and Python keeps that: a pytest run
    # in the background could not be interrupted at all, with or without this pool.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt_a_run()
    finally:
        signal.signal(signal.SIGINT, handler)


def interrupt_a_run() -> None:
    with RankPool(2, timeout_s=60) as pool:
        pids = pool.run(worker_pid)
        started = time.monotonic()
        timer = threading.Timer(1.0, interrupt_this_thread)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.run(hang)
        finally:
            timer.cancel()
        assert time.monotonic() - started < 5
        assert not pool.alive
        assert not any(psutil.pid_exists(pid) for pid in pids)
