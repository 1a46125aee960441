"""Fixtures the loader's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from megastart.harness.launch import RankPool


@pytest.fixture
def pool(rank_pools: dict[int, RankPool]) -> RankPool:
    """Two ranks, started once per module."""
    return rank_pools[2]


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama checkpoint (untied embeddings), sharded with an index; not to be
    damaged (copy it first)."""
    from megastart.harness.checkpoints import make_checkpoint

    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", directory, tie_word_embeddings=False)
    return directory
