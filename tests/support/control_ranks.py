"""What each rank runs in the control plane's failure tests: real boards, node pages and gloo
groups over torch.distributed's store, with the failures made real (a process killed, a
rank that never comes, ``/dev/shm`` refusing a page)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from megastart.bench.world import CountingStore


def _fresh_control() -> None:
    """No control plane kept from an earlier test in this process (the next is made anew)."""
    from megastart.distributed.kept import let_go

    let_go()


def two_calls_with_their_own_timeouts(short_s: float, long_s: float, late_s: float) -> Any:
    """A first call of ``short_s`` (the warmup's) makes the kept control plane; a second of
    ``long_s`` (a load's) has rank 1 ``late_s`` late in its block. Its outcome, and when."""
    import torch.distributed as dist

    from megastart.distributed import all_or_none, kept_control

    _fresh_control()
    kept_control(timeout_s=short_s).gather("first call", timeout_s=short_s)
    started = time.monotonic()
    try:
        with all_or_none("second call", timeout_s=long_s, control=kept_control(timeout_s=long_s)):
            if dist.get_rank() == 1:
                time.sleep(late_s)
    except Exception as e:
        return str(e), time.monotonic() - started
    return "passed", time.monotonic() - started


def control_closed_under_a_report(board_failure: bool) -> Any:
    """Rank 1 fails (announcing it on the board, if ``board_failure``), then its control
    plane's connections close (as when its process ends) while rank 0 waits for its report.
    Rank 0's error, and how long it took."""
    import torch.distributed as dist

    from megastart.distributed import Board, all_or_none, kept_control
    from megastart.distributed.kept import let_go

    _fresh_control()
    kept_control(timeout_s=30.0)  # made on every rank; rank 1 keeps no reference to it
    board = Board("control-closed")
    board.check_in(30.0)
    dist.barrier()
    if dist.get_rank() == 1:
        if board_failure:
            board.announce(RuntimeError("rank 1 ran out of disk"))
        let_go()  # its sockets close: rank 0's gather hears it at once
        time.sleep(3.0)
        return "left"
    started = time.monotonic()
    try:
        control = kept_control(timeout_s=30.0)
        with all_or_none("a phase", timeout_s=30.0, control=control, board=board):
            time.sleep(0.3)
    except Exception as e:
        return str(e), time.monotonic() - started
    return "passed", time.monotonic() - started


def kill_a_node_leader(ranks_per_node: int, leader: int, out: str, report_at_s: float) -> None:
    """Ranks on nodes of ``ranks_per_node`` meet at a barrier of a board with node pages;
    node leader ``leader`` is killed (SIGKILL) first, and rank 0 announces a failure of its
    own ``report_at_s`` later (``0``: none). Each rank writes its error, and how long after
    the kill it came, to ``out``/<rank>.json (the killed rank's pool dies with it)."""
    import torch.distributed as dist

    from megastart.distributed import Board, CollectiveError
    from megastart.loader.stream.node import node_board

    rank = dist.get_rank()
    first = rank - rank % ranks_per_node
    board = Board("killed-leader")
    board.check_in(10.0)
    members = list(range(first, first + ranks_per_node))
    with node_board(board, members, nodes=dist.get_world_size() // ranks_per_node):
        killed = time.time() + 0.5
        if rank == leader:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0 and report_at_s:
            timer = threading.Timer(
                killed + report_at_s - time.time(),
                board.announce,
                (RuntimeError("rank 0 lost the stream from rank 2"),),
            )
            timer.start()
        try:
            board.barrier("the test's barrier")
            outcome = "passed"
        except CollectiveError as e:
            outcome = str(e)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"outcome": outcome, "after_s": time.time() - killed}, f)


def check_in_without(missing: int, timeout_s: float) -> dict[str, Any]:
    """Every rank but ``missing`` checks in; its error and its store requests, by kind."""
    import torch.distributed as dist

    from megastart.distributed import Board, CollectiveError

    board = Board("check-in-test")
    counting = CountingStore(board._store)
    board._store = counting
    outcome = "came"
    if dist.get_rank() != missing:
        try:
            board.check_in(timeout_s)
            outcome = "checked in"
        except CollectiveError as e:
            outcome = str(e)
    dist.barrier()
    return {"outcome": outcome, "checks": counting.names.count("check")}


def page_refused_on(leader: int, ranks_per_node: int) -> Any:
    """Node leader ``leader`` cannot make its node's page (``/dev/shm`` full); then the node
    leaders make a group together, as the stream does. Each rank's error, and when."""
    import errno

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from megastart.distributed import Board, LocalGroup
    from megastart.loader.stream import node, shm

    rank = dist.get_rank()
    first = rank - rank % ranks_per_node
    board = Board("page-refused")
    board.check_in(10.0)
    original = shm.Segment.create

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device (injected)", "/dev/shm")

    if rank == leader:
        shm.Segment.create = refused  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        members = list(range(first, first + ranks_per_node))
        with node.node_board(board, members, nodes=dist.get_world_size() // ranks_per_node):
            leaders = range(0, dist.get_world_size(), ranks_per_node)
            if rank in leaders:
                store = dist.PrefixStore("page-refused/leaders/", _get_default_store())
                LocalGroup.make(store, leaders, timeout_s=10.0)
        return "made", time.monotonic() - started
    except Exception as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - started
    finally:
        shm.Segment.create = original  # type: ignore[method-assign]


def wait_before_check_in() -> str:
    """A board's wait made before ``check_in`` set its bound: what came of it within 3 s."""
    from megastart.distributed import Board

    board = Board("unbounded")
    outcome = ["still waiting"]

    def wait() -> None:
        try:
            board.wait(lambda slice_s: time.sleep(slice_s) or False, "nothing")
        except Exception as e:
            outcome[0] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(3.0)
    return outcome[0]


def _sockets() -> int:
    """The sockets this process holds open."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed in between
            pass
    return held


def reinit_on_the_same_port(checkpoint: str, port: int) -> dict[str, Any]:
    """As NeMo-RL between its worlds: a load in the pool's world, then ``destroy_process_group``;
    a world on ``port`` (rank 0 serving its store) whose phases megastart reports over its
    control plane (a node page too), destroyed; a new world on the same port, where a load
    and a warmup run. What megastart held of the destroyed world (sockets), and how long the
    new world took to start."""
    import datetime
    import gc

    import torch.distributed as dist

    from megastart import load_hf_checkpoint
    from megastart.distributed import Board, all_or_none, kept_control
    from megastart.harness.cpu import destroy_megatron, initialize_megatron
    from megastart.loader.stream.node import node_board
    from megastart.warmup.api import warmup_communicators
    from megastart.warmup.settings import CommWarmupSettings
    from support.loader_ranks import build, settings

    rank, world = dist.get_rank(), dist.get_world_size()

    def load() -> int:
        chunks = build(checkpoint)
        return load_hf_checkpoint(chunks, checkpoint, settings=settings(timeout_s=20.0)).bytes_read

    def new_world() -> float:
        started = time.monotonic()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=20),
        )
        return time.monotonic() - started

    initialize_megatron(tp=2)
    read_before = load()
    destroy_megatron()
    dist.destroy_process_group()  # the pool's world (its store served by the pool's parent)
    gc.collect()
    before = _sockets()
    new_world()  # megastart's control plane in it, and a node page, without Megatron's groups
    board = Board("reinit")
    board.check_in(20.0)
    with all_or_none("a phase", timeout_s=20.0, control=kept_control(timeout_s=20.0)):
        with node_board(board, list(range(world)), nodes=1):
            pass
    del board
    dist.destroy_process_group()
    held = _sockets() - before
    init_s = new_world()
    initialize_megatron(tp=2)
    read_after = load()
    warmed = warmup_communicators(settings=CommWarmupSettings(timeout_s=20.0))
    destroy_megatron()
    return {
        "held": held,
        "init_s": init_s,
        "read": (read_before, read_after),
        "warmed": bool(warmed.operations),
    }


def fail_a_load_then_exit(checkpoint: str, port: int, rank: int, world: int) -> None:
    """A host process of its own (``python -c``): a world on ``port``, a load with
    ``timeout_s=20`` (it makes the kept control plane), then one with ``timeout_s=1`` whose
    rank 1 hangs mapping its parameters: the others' report times out with its operation
    left in flight, then the host exits. Prints when the second load returned
    (``time.time()``)."""
    import torch.distributed as dist

    from megastart import load_hf_checkpoint
    from megastart.harness.cpu import initialize_megatron
    from megastart.loader.plan import demands
    from support.loader_ranks import build, settings

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    initialize_megatron(tp=2)
    chunks = build(checkpoint)
    load_hf_checkpoint(chunks, checkpoint, settings=settings(timeout_s=20.0))
    original = demands.local_needs

    def late(*args: Any, **kwargs: Any) -> Any:
        time.sleep(60.0)  # hung: the test kills it
        return original(*args, **kwargs)

    if rank == 1:
        demands.local_needs = late  # type: ignore[assignment]
    try:
        load_hf_checkpoint(chunks, checkpoint, settings=settings(timeout_s=1.0))
    except Exception as e:
        print(f"failed: {e}", flush=True)

    print(f"returned at {time.time()}", flush=True)
