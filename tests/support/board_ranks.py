"""What each rank runs in the board tests: a real :class:`~megastart.distributed.Board` over
torch.distributed's own store, with the store's requests counted as they go out."""

from __future__ import annotations

import os
import time
from typing import Any

from megastart.bench.world import CountingStore


def wait_for_a_late_post(post_after_s: float) -> dict[str, Any]:
    """Rank 1 posts a key after ``post_after_s``; rank 0 reads it through the board. Rank 0's
    store requests in its wait, and how late it saw the post."""
    import torch.distributed as dist

    from megastart.distributed import Board

    board = Board("board-test")
    board.timeout_s = 60.0
    if dist.get_rank() == 1:
        time.sleep(post_after_s)
        board.post("late", str(time.time()))
        dist.barrier()
        return {}
    counting = CountingStore(board._store)
    board._store = counting
    posted = float(board.read("late", "rank 1's post"))
    seen_late_s = time.time() - posted
    dist.barrier()
    return {"requests": len(counting.times), "seen_late_s": seen_late_s}


def meet_at_a_barrier(ranks_per_node: int, late: int, late_s: float, fail: bool) -> dict[str, Any]:
    """Every rank meets at a barrier of a board with node pages, rank ``late`` ``late_s`` after
    the others (or, with ``fail``, announcing a failure instead of arriving). The store
    requests of each rank at the barrier, when it left it (``time.time()``), and how."""
    import torch.distributed as dist

    from megastart.distributed import Board, PeerFailed
    from megastart.loader.stream.node import node_board

    rank = dist.get_rank()
    first = rank - rank % ranks_per_node
    board = Board("board-test-barrier")
    board.check_in(60.0)
    members = list(range(first, first + ranks_per_node))
    with node_board(board, members, nodes=dist.get_world_size() // ranks_per_node) as page:
        counting = CountingStore(board._store)
        board._store = counting
        arrived = time.time()
        outcome = "passed"
        try:
            if rank == late:
                time.sleep(late_s)
                arrived = time.time()
                if fail:
                    error = RuntimeError(f"rank {rank} could not arrive")
                    board.announce(error)
                    raise error
            board.barrier("the test's barrier")
        except (PeerFailed, RuntimeError) as e:
            outcome = str(e)
        left = time.time()
        leads = page is None or page.leads
    dist.barrier()
    return {
        "requests": len(counting.times),
        "arrived": arrived,
        "left": left,
        "outcome": outcome,
        "leads": leads,
        "pid": os.getpid(),
    }
