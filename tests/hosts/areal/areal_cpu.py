"""Importing AReaL's Megatron engine on a machine without a GPU or Transformer Engine.

megatron-bridge (which AReaL imports) runs ``import transformer_engine.pytorch``
unconditionally; ``stubs/transformer_engine`` satisfies it. megatron-core, on the
other hand, switches to Transformer Engine code paths whenever that import
succeeds, so its modules that probe for it are imported first, while the stub is
blocked. Call :func:`import_megatron_engine` instead of importing AReaL directly.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from types import ModuleType
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(HERE, "stubs")

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
"""Every megatron-core module that probes for Transformer Engine at import time
and that importing AReaL's engine would otherwise load after the stub (found
by importing AReaL and listing the new modules whose source names it)."""


ACTIVATION = {"AUTOWRAPT_BOOTSTRAP": "megastart.bootstrap"}
"""What activates megastart in an AReaL worker: start rank pools inside
``pyrun.started_with(ACTIVATION)`` (:func:`activated_pool` does)."""


def activated_pool(env: dict[str, str]) -> Any:
    """Two ranks that import this test directory's modules, with megastart activated
    from start-up as in AReaL's workers, and ``env`` in their environment."""
    from support.pyrun import started_with

    from megastart.harness.launch import RankPool

    with started_with(ACTIVATION):
        return RankPool(2, timeout_s=300, env={"PYTHONPATH": os.pathsep.join(sys.path), **env})


def python_path() -> str:
    """``PYTHONPATH`` for a subprocess that imports AReaL through this module."""
    return os.pathsep.join([HERE, STUBS, os.environ.get("PYTHONPATH", "")])


def import_megatron_engine() -> ModuleType:
    """``areal.engine.megatron_engine``, imported with megatron-core kept off TE paths."""
    return import_with_te_stub("areal.engine.megatron_engine")


def import_with_te_stub(module: str) -> ModuleType:
    """``module`` (one that imports megatron-bridge), imported with the stub on the path
    and megatron-core kept off TE paths; verl's Megatron-Bridge tests use it too."""
    if STUBS not in sys.path:
        sys.path.insert(0, STUBS)
    if module not in sys.modules:
        blocking = "transformer_engine" not in sys.modules
        if blocking:
            sys.modules["transformer_engine"] = None  # type: ignore[assignment]
        try:
            for name in MEGATRON_WITHOUT_TE:
                import_module(name)
        finally:
            if blocking:
                del sys.modules["transformer_engine"]
    return import_module(module)
