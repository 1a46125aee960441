"""The control plane away from the happy path: each call bounded by its own timeout, the real
error on every rank within seconds (a killed node leader, a peer whose connections closed,
a node whose page cannot be made), a timed-out check-in that costs the store a request per
rank, and no wait without a bound (real ranks over gloo, real processes killed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.control_ranks import (
    check_in_without,
    control_closed_under_a_report,
    kill_a_node_leader,
    page_refused_on,
    two_calls_with_their_own_timeouts,
    wait_before_check_in,
)

from megastart.harness.launch import RankFailure, RankPool


@pytest.fixture(scope="module")
def four() -> RankPool:
    with RankPool(4, timeout_s=60) as pool:
        yield pool


def test_a_call_is_bounded_by_its_own_timeout_not_by_the_first_calls(four: RankPool) -> None:
    """A warmup with timeout_s=2 made the kept control plane; a load with timeout_s=20 whose
    rank 1 is 6 s late still passes."""
    results = four.run(two_calls_with_their_own_timeouts, 2.0, 20.0, 6.0)
    for outcome, seconds in results:
        assert outcome == "passed", outcome
        # each rank's clock starts as it leaves the first call, a little after rank 1's may
        assert 5.5 <= seconds < 10.0, seconds


def test_a_peer_that_failed_is_named_with_its_own_error_not_as_a_timeout() -> None:
    with RankPool(2, timeout_s=60) as pool:
        (announced, _), (closed, _) = (
            pool.run(control_closed_under_a_report, True),
            pool.run(control_closed_under_a_report, False),
        )
    message, seconds = announced
    assert message == "a phase failed on rank 1: RuntimeError: rank 1 ran out of disk", message
    assert seconds < 2.0, seconds
    message, seconds = closed  # no word on the board: gloo's own error, as it was
    assert message.startswith("a phase the other ranks did not report: the control group of "), (
        message
    )
    assert "within" not in message and seconds < 2.0, (message, seconds)


@pytest.mark.parametrize("report_at_s", [0.0, 1.5])
def test_a_killed_node_leader_is_named_on_every_rank_within_seconds(
    tmp_path: Path, report_at_s: float
) -> None:
    """Nodes (0, 1) and (2, 3); leader 2 is SIGKILLed while every rank waits at a barrier
    (rank 3 on its node's page); with ``report_at_s``, rank 0 also reports a failure then."""
    with RankPool(4, timeout_s=60, grace_s=10) as pool, pytest.raises(RankFailure):
        pool.run(kill_a_node_leader, 2, 2, str(tmp_path), report_at_s)
    results: dict[int, Any] = {
        rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1, 3)
    }
    for rank, result in results.items():
        if rank == 0 and report_at_s:
            continue  # its own error, raised where it was
        assert "rank 3: its node's leader, rank 2, is gone" in result["outcome"], (rank, result)
        assert result["after_s"] < 1.5, (rank, result)


def test_a_timed_out_check_in_asks_the_store_about_each_rank_once(four: RankPool) -> None:
    results = four.run(check_in_without, 3, 1.0)
    for result in results[:3]:
        assert "rank(s) [3] did not start it within timeout_s=1 s" in result["outcome"], result
    # one rank asks about every rank; the others wait for what it finds (at 8,192 ranks,
    # 8,192 requests, not 67 million)
    assert sum(result["checks"] for result in results) == 4, results


def test_a_node_whose_page_cannot_be_made_stops_every_node_before_its_groups(
    four: RankPool,
) -> None:
    results = four.run(page_refused_on, 2, 2)
    for rank, (outcome, seconds) in enumerate(results):
        assert "No space left on device (injected)" in outcome, (rank, outcome)
        assert seconds < 2.0, (rank, seconds)  # not the leaders' 10 s connect


def test_a_board_wait_before_check_in_is_an_error_not_a_hang(four: RankPool) -> None:
    outcomes = four.run(wait_before_check_in)
    assert all("a wait before check_in(timeout_s)" in outcome for outcome in outcomes), outcomes
