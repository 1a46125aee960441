"""An engine for AReaL's own ``RayRPCServer`` actor (``create_engine("areal_ray_engine.
ReportingEngine")``) that reports what megastart did in that actor's process: which
``MegatronEngine`` methods were wrapped when ``import areal.engine.megatron_engine``
returned (this module imports it, as AReaL's engine modules do), and the settings."""

from __future__ import annotations

import os
from typing import Any

import wrapt
from areal_cpu import import_megatron_engine

_megatron_engine = import_megatron_engine()

WRAPPED_WHEN_IMPORTED = sorted(
    name
    for name, value in vars(_megatron_engine.MegatronEngine).items()
    if isinstance(value, wrapt.FunctionWrapper)
)


class ReportingEngine(_megatron_engine.MegatronEngine):
    """AReaL's ``MegatronEngine`` class, not built: it only answers ``report``."""

    def __init__(self) -> None:
        self._initialized = False  # what RayRPCServer.call reads (`initialized`) before calling

    def report(self) -> dict[str, Any]:
        from megastart.engines import adapters
        from megastart.manager import get_settings

        return {
            "bootstrap": os.environ.get("AUTOWRAPT_BOOTSTRAP"),
            "wrapped_when_imported": WRAPPED_WHEN_IMPORTED,
            "attached": {name: adapter.attached for name, adapter in adapters().items()},
            "blocklist": list(get_settings().blocklist),
        }
