"""Rank pools started on first use, one per world size, for the ``rank_pools`` fixtures."""

from __future__ import annotations

from collections.abc import Iterator

from megastart.harness.launch import RankPool


def started_pools() -> Iterator[dict[int, RankPool]]:
    """Yield ``pools[world]``: a RankPool per world size, started on first use; close them after."""
    made: dict[int, RankPool] = {}

    class Pools(dict):
        def __missing__(self, world: int) -> RankPool:
            made[world] = self[world] = RankPool(world, timeout_s=180)
            return made[world]

    yield Pools()
    for pool in made.values():
        pool.close()
