"""Test-only stand-in for flash-attn, which has no CPU build.

verl 0.7's legacy model builder takes its value head (``LinearForLastLayer``, a
``torch.nn.Linear``) from ``verl.models.llama.megatron.layers``, a package whose
``__init__`` also imports verl's old ParallelLlama modules, and those import
flash-attn at import time. The critic built from the head never calls
flash-attn; every function here raises if anything does. It is put on
``sys.path`` by ``tests/hosts/verl/verl_legacy_cpu.py`` for the legacy critic
only, never installed (no distribution metadata, so ``transformers`` still
reports flash-attn as unavailable).
"""

from collections.abc import Callable
from typing import Any


def missing(name: str) -> Callable[..., Any]:
    """A function that says flash-attn's ``name`` was called, which the tests do not allow."""

    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"flash_attn stub: {name} was called; flash-attn has no CPU build"
        )

    return call


flash_attn_varlen_func = missing("flash_attn_varlen_func")
