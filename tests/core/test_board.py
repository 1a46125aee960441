"""Waiting at the board costs torch.distributed's store almost nothing and adds no latency:
a read is one blocking request, a barrier one ``add`` and one blocking wait per node leader
and no request at all from the node's other ranks, and a failure announced anywhere releases
every waiting rank at once (real ranks, the real store; the requests counted as they go out)."""

from __future__ import annotations

import pytest
from support.board_ranks import meet_at_a_barrier, wait_for_a_late_post

from megastart.distributed import POLL_S
from megastart.harness.launch import RankPool


def test_a_long_read_is_one_blocking_request_answered_at_once() -> None:
    with RankPool(2, timeout_s=60) as pool:
        waited, _ = pool.run(wait_for_a_late_post, 5.0)
    assert waited["requests"] <= 3, waited  # the wait, and the value
    assert waited["seen_late_s"] < 0.2, waited


@pytest.fixture(scope="module")
def four() -> RankPool:
    with RankPool(4, timeout_s=60) as pool:
        yield pool


def test_at_a_barrier_only_node_leaders_ask_the_store_and_all_leave_when_the_last_arrives(
    four: RankPool,
) -> None:
    late_s = 3.0
    results = four.run(meet_at_a_barrier, 2, 3, late_s, False)  # two nodes of two; rank 3 late
    last = results[3]["arrived"]
    for rank, result in enumerate(results):
        assert result["outcome"] == "passed", (rank, result)
        assert last <= result["left"] < last + 0.2, (rank, result["left"] - last)
    assert [r["leads"] for r in results] == [True, False, True, False]
    assert [r["requests"] for r in results[1::2]] == [0, 0]  # members look at their page
    assert results[0]["requests"] <= 4, results[0]  # add, progress, the blocking wait, its value
    # rank 2 waits for its node's late rank, looking for failures every look_s (POLL_S here)
    assert results[2]["requests"] <= 4 + late_s / POLL_S + 1, results[2]


def test_a_failure_announced_instead_of_arriving_releases_every_rank_at_once(
    four: RankPool,
) -> None:
    results = four.run(meet_at_a_barrier, 2, 3, 2.0, True)
    failed = results[3]["arrived"]
    for rank, result in enumerate(results):
        assert "rank 3 could not arrive" in result["outcome"], (rank, result)
        assert failed <= result["left"] < failed + 0.3, (rank, result["left"] - failed)
