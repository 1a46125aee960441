"""Fixtures shared by the distributed tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.pools import started_pools

from megastart.harness.launch import RankPool


@pytest.fixture(scope="module")
def rank_pools() -> Iterator[dict[int, RankPool]]:
    """``rank_pools[world]``: one RankPool per world size, started on first use, shared by the module."""
    yield from started_pools()
