"""A pytest plugin (``pytest -p support.preloaded``): the ranks of the suite's pools fork from a
server that imported torch, Megatron and transformers once (:func:`preload_ranks`), instead of
importing them in every fresh world. For suites whose ranks put no stub (Transformer Engine)
on their path before importing Megatron: the core suite and the megatron-core sessions."""

from __future__ import annotations

import pytest

from megastart.harness.launch import preload_ranks

PRELOADED = ("torch", "torch.distributed", "megatron.core.models.gpt", "transformers")


def pytest_configure(config: pytest.Config) -> None:
    preload_ranks(*PRELOADED)
