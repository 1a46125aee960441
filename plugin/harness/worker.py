"""A :class:`~megastart.harness.launch.RankPool` worker's life: set the rank's environment, join
the gloo world, then run the pool's tasks one after another until the pipe closes, answering
each with its result or its traceback. Dies with its parent."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any


def worker_main(
    conn: Connection,
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    env: dict[str, str],
    sys_path: list[str],
    backend: str,
) -> None:
    """A worker's life: set up, join the world, then run tasks until the pipe closes."""
    _die_with_parent()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.update(env)
    sys.path[:] = sys_path + [p for p in sys.path if p not in sys_path]
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        answer: tuple[bool, Any] = (True, None)
    except BaseException:
        answer = (False, traceback.format_exc())
    _send(conn, answer)
    if not answer[0]:
        return
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):  # the parent closed the pool
            return
        try:
            fn, args, kwargs = pickle.loads(task)
            answer = (True, fn(*args, **kwargs))
        except BaseException:
            answer = (False, traceback.format_exc())
        _send(conn, answer)


def _send(conn: Connection, answer: tuple[bool, Any]) -> None:
    try:
        payload = pickle.dumps(answer)
    except Exception:
        payload = pickle.dumps(
            (False, f"the result could not be pickled:\n{traceback.format_exc()}")
        )
    conn.send_bytes(payload)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent dies, so none is orphaned."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
