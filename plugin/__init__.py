"""megastart: start Megatron-core RL jobs without host-RAM or first-step GPU OOM.

``import megastart`` is cheap: no torch, no entry-point scan. The heavy parts
(the loader, the warmup) are imported on first use of their names.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from pluggy import HookimplMarker

from megastart.hookspec import PROJECT
from megastart.records import EngineContext, LoadReport, WarmupReport

if TYPE_CHECKING:
    from megastart.loader.api import load_hf_checkpoint
    from megastart.warmup.api import warmup_communicators

__all__ = [
    "EngineContext",
    "LoadReport",
    "WarmupReport",
    "__version__",
    "hookimpl",
    "load_hf_checkpoint",
    "warmup_communicators",
]

hookimpl = HookimplMarker(PROJECT)
"""Marker for hook implementations: ``@megastart.hookimpl``."""

_LAZY = {
    "load_hf_checkpoint": "megastart.loader.api",
    "warmup_communicators": "megastart.warmup.api",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # importlib.metadata costs ~20 ms: only when asked
        from importlib import metadata

        return metadata.version("megastart")
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megastart' has no attribute {name!r}")
