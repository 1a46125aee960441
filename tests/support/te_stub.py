"""Importing Megatron-Bridge (and what imports it: AReaL's engine, verl's bridge module) on a
machine without a GPU, Transformer Engine or Python 3.12.

Megatron-Bridge runs ``import transformer_engine.pytorch`` unconditionally;
``stubs/transformer_engine`` satisfies it. megatron-core, on the other hand,
switches to Transformer Engine code paths whenever that import succeeds, so its
modules that probe for it are imported first, while the stub is blocked.
megatron-core 0.18+ ships ``megatron.training``, which Megatron-Bridge 0.5 imports
and which uses Python 3.12's ``typing.override``: on 3.11 it is
``typing_extensions.override`` (a decorator that returns its argument).
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from importlib.util import find_spec
from types import ModuleType

STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")

MEGATRON_WITHOUT_TE = (
    "megatron.core",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
    "megatron.core.fp8_utils",
    "megatron.core.ssm.mamba_context_parallel",
    "megatron.core.transformer.heterogeneous.linear_replacements",
    "mbridge",
)
"""Every module that probes for Transformer Engine at import time and that importing AReaL's
engine would otherwise load after the stub (found by importing AReaL and listing the new
modules whose source names it); those not installed are skipped (mbridge, where only
Megatron-Bridge is)."""


def import_with_te_stub(module: str) -> ModuleType:
    """``module`` (one that imports Megatron-Bridge), imported with the stub on the path,
    megatron-core kept off TE paths and ``typing.override`` defined."""
    import typing

    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]
    if STUBS not in sys.path:
        sys.path.insert(0, STUBS)
    if module not in sys.modules:
        blocking = "transformer_engine" not in sys.modules
        if blocking:
            sys.modules["transformer_engine"] = None  # type: ignore[assignment]
        try:
            for name in MEGATRON_WITHOUT_TE:
                if find_spec(name.partition(".")[0]) is not None:
                    import_module(name)
        finally:
            if blocking:
                del sys.modules["transformer_engine"]
    return import_module(module)
