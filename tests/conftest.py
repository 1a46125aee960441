"""Fixtures shared by the distributed tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megastart.harness.launch import RankPool


@pytest.fixture(scope="module")
def rank_pools() -> Iterator[dict[int, RankPool]]:
    """``rank_pools[world]``: one RankPool per world size, started on first use, shared by the module."""
    made: dict[int, RankPool] = {}

    class Pools(dict):
        def __missing__(self, world: int) -> RankPool:
            made[world] = self[world] = RankPool(world, timeout_s=180)
            return made[world]

    yield Pools()
    for pool in made.values():
        pool.close()
