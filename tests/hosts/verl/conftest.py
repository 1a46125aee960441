"""Tests that need the real verl (``nox -s verl``); skipped where verl is not installed."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from support.pyrun import started_with

from megastart.harness.launch import RankPool

pytest.importorskip("verl.workers.engine.megatron.transformer_impl", reason="needs verl >= 0.8")


@pytest.fixture(autouse=True)
def no_megastart_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the MEGASTART_* variables it means; none leak in from the shell."""
    for name in list(os.environ):
        if name.startswith("MEGASTART_") or name == "VERL_USE_EXTERNAL_MODULES":
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random two-layer Qwen2 with a tokenizer (verl's legacy workers load it first)."""
    from verl_legacy_cpu import save_tiny_qwen2_with_tokenizer

    path = tmp_path_factory.mktemp("qwen2")
    save_tiny_qwen2_with_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """verl_cpu.TP ranks, started with megastart activated as the installed verl does it."""
    import verl_cpu
    from verl_configs import ACTIVATION

    with started_with(ACTIVATION), RankPool(verl_cpu.TP, timeout_s=400) as ranks:
        yield ranks
