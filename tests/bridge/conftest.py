"""Fixtures the Megatron-Bridge tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.pools import started_pools

from megastart.harness.launch import RankPool


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[dict[int, RankPool]]:
    """The bridge's modules share their ranks: starting a pool and importing Megatron-Bridge
    in it costs more than any of these tests (each leaves its ranks as it found them)."""
    yield from started_pools()
