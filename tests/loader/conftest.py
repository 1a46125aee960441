"""Fixtures the loader's tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.pools import started_pools

from megastart.harness.launch import RankPool


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[dict[int, RankPool]]:
    """The loader's modules share their ranks: starting a pool and importing Megatron in it
    costs more than most loads (each load leaves its rank as it found it)."""
    yield from started_pools()


@pytest.fixture
def pool(rank_pools: dict[int, RankPool]) -> RankPool:
    """Two ranks, started once for the loader's tests."""
    return rank_pools[2]


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama checkpoint (untied embeddings), sharded with an index; not to be
    damaged (copy it first)."""
    from megastart.harness.checkpoints import make_checkpoint

    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", directory, tie_word_embeddings=False)
    return directory
