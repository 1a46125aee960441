"""megastart: start Megatron-core RL jobs without host-RAM or first-step GPU OOM.

``import megastart`` is cheap: it imports nothing (no torch, no pluggy, no
entry-point scan), because it runs in every worker of a host. Each public name
is imported on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megastart.hookspec import hookimpl
    from megastart.loader.api import load_hf_checkpoint
    from megastart.records import EngineContext, LoadReport, WarmupReport
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

_LAZY = {
    "hookimpl": "megastart.hookspec",
    "EngineContext": "megastart.records",
    "LoadReport": "megastart.records",
    "WarmupReport": "megastart.records",
    "load_hf_checkpoint": "megastart.loader.api",
    "warmup_communicators": "megastart.warmup.api",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # importlib.metadata costs ~20 ms: only when asked
        from importlib import metadata

        return metadata.version("megastart")
    if name in _LAZY:
        value = globals()[name] = getattr(import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'megastart' has no attribute {name!r}")
