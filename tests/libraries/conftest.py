"""Fixtures the library adapters' tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.pools import started_pools

from megastart.harness.launch import RankPool


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[dict[int, RankPool]]:
    """The library modules share their ranks: starting a pool and importing Megatron (and the
    libraries) in it costs more than most of these tests (each leaves its ranks as it found
    them; an adapter attached in a rank stays attached, as in a host's worker)."""
    yield from started_pools()
