"""The sticky-failure latch keeps the first failure of any type, the very error raised, and
lets the errors that leave the ranks in step pass, built-in types included."""

from __future__ import annotations

import dataclasses

import pytest

from megastart.distributed import FailedBefore
from megastart.distributed.sticky import Sticky


@dataclasses.dataclass
class HostError(Exception):
    """An error as a host may define it: a dataclass, so equal by value and unhashable."""

    code: int


def test_an_unhashable_error_is_raised_as_itself_and_kept() -> None:
    latch = Sticky()
    with pytest.raises(HostError) as raised, latch.guard("rank0_loader"):
        raise HostError(3)
    assert latch.failure is raised.value and latch.failed == "rank0_loader"
    with pytest.raises(FailedBefore, match="rank0_loader already failed"), latch.guard("warmup"):
        pytest.fail("a call after a failure ran")


def test_an_in_step_error_of_a_built_in_type_passes_the_guards_around_it_unkept() -> None:
    latch = Sticky()
    with pytest.raises(KeyError), latch.guard("hook"), latch.guard("load", passes=(KeyError,)):
        raise KeyError("not a table of megastart's")
    assert latch.failure is None
    with latch.guard("load"):  # the next call runs
        pass


def test_an_error_equal_to_a_passed_one_is_still_kept() -> None:
    latch = Sticky()
    with pytest.raises(HostError), latch.guard("load", passes=(HostError,)):
        raise HostError(1)
    with pytest.raises(HostError) as raised, latch.guard("hook"):
        raise HostError(1)  # equal to the one that passed, but another failure
    assert latch.failure is raised.value
