"""A rank that waits long at the board costs torch.distributed's store a few requests a
second, not a hundred, and still sees what it waited for within a second (real ranks, the
real store; the requests counted as they go out)."""

from __future__ import annotations

from support.board_ranks import wait_for_a_late_post

from megastart.distributed.board import LONG_POLL_S, SETTLE_S
from megastart.harness.launch import RankPool


def test_a_long_wait_backs_off_to_a_few_store_requests_a_second() -> None:
    with RankPool(2, timeout_s=60) as pool:
        waited, _ = pool.run(wait_for_a_late_post, 8.0)
    per_second = waited["per_second"]
    settled = per_second[int(SETTLE_S) + 1 :]
    # one look at the key and one at the board's failures per LONG_POLL_S, plus the peer
    # wait's progress look once a second
    assert max(settled) <= 4, per_second
    assert sum(per_second[:2]) >= 20, per_second  # looks often at first: most waits are short
    assert waited["seen_late_s"] < LONG_POLL_S + 0.5, waited
