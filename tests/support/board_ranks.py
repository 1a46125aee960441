"""What each rank runs in the board tests: a real :class:`~megastart.distributed.Board` over
torch.distributed's own store, with the store's requests counted as they go out."""

from __future__ import annotations

import time
from typing import Any

from megastart.bench.world import CountingStore


def wait_for_a_late_post(post_after_s: float) -> dict[str, Any]:
    """Rank 1 posts a key after ``post_after_s``; rank 0 reads it through the board. Rank 0's
    store requests per second in each second of its wait, and how late it saw the post."""
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
    start = time.monotonic()
    posted = float(board.read("late", "rank 1's post"))
    seen_late_s = time.time() - posted
    dist.barrier()
    seconds = int(post_after_s)
    per_second = [
        sum(1 for t in counting.times if start + s <= t < start + s + 1) for s in range(seconds)
    ]
    return {"per_second": per_second, "seen_late_s": seen_late_s}
