"""Tests that need the real verl (``nox -s verl``); skipped where verl is not installed."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl.workers.engine.megatron.transformer_impl", reason="needs verl >= 0.8")


@pytest.fixture(autouse=True)
def no_megastart_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the MEGASTART_* variables it means; none leak in from the shell."""
    for name in list(os.environ):
        if name.startswith("MEGASTART_") or name == "VERL_USE_EXTERNAL_MODULES":
            monkeypatch.delenv(name)
