"""Importing AReaL's Megatron engine on a machine without a GPU or Transformer Engine
(:mod:`support.te_stub`), and starting ranks with megastart activated as in AReaL's workers.
Call :func:`import_megatron_engine` instead of importing AReaL directly.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

from support.te_stub import STUBS, import_with_te_stub

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))

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
    return os.pathsep.join([HERE, TESTS, STUBS, os.environ.get("PYTHONPATH", "")])


def import_megatron_engine() -> ModuleType:
    """``areal.engine.megatron_engine``, imported with megatron-core kept off TE paths."""
    return import_with_te_stub("areal.engine.megatron_engine")
