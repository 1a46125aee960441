"""A load in the host's process lifecycle: a new default group on the same port after the
host destroyed its first (NeMo-RL's conversion world, then its training world), and the
process's exit after a failed load (real processes, rank 0 serving the store)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from support.control_ranks import reinit_on_the_same_port

from megastart.harness.launch import RankPool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_new_world_on_the_same_port_after_destroy_loads_and_warms_up(llama: Path) -> None:
    """After ``destroy_process_group()`` megastart holds no socket of the old world, the
    host's next ``init_process_group`` on its port starts at once, and a load and a warmup
    run there. (The world before the last is megastart's alone: megatron-core 0.16 keeps
    the store of a world its parallel state was made in alive past ``destroy_model_parallel``
    and ``destroy_process_group``, megastart or not.)"""
    with RankPool(2, timeout_s=120) as pool:
        results = pool.run(reinit_on_the_same_port, str(llama), _free_port())
    for result in results:
        assert result["held"] <= 0, result  # no group, no store, no socket of the old world
        assert result["init_s"] < 2.0, result  # not gloo's connect timeout
        read_before, read_after = result["read"]
        assert read_before == read_after > 0, result
        assert result["warmed"], result


def test_a_process_whose_load_failed_exits_within_seconds(llama: Path) -> None:
    """A load (timeout_s=20) makes the kept control plane; a second (timeout_s=1) fails on
    rank 0 while rank 1 hangs, its report's operation in flight: rank 0's host process
    still exits within seconds of the load returning, not when that operation's time (24 s
    from its start) runs out."""
    port = _free_port()
    tests = str(Path(__file__).parents[1])
    code = (
        "import sys; from support.control_ranks import fail_a_load_then_exit; "
        f"fail_a_load_then_exit({str(llama)!r}, {port}, int(sys.argv[1]), 2)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    env = {k: v for k, v in env.items() if not k.startswith("MEGASTART_")}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank)],
            env={**env, "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        out, err = ranks[0].communicate(timeout=120)
        exited = time.time()
        assert "failed: rank0_loader: mapping" in out, (out, err[-3000:])
        returned = float(out.rsplit("returned at ", 1)[1])
        assert exited - returned < 8.0, exited - returned  # the interpreter's own teardown
    finally:
        for process in ranks:
            process.kill()
            process.communicate()
