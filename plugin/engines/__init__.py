"""Engine adapters: discovered through the ``megastart.engines`` entry points and
attached when the host module they name is imported.

Discovery waits for the first import of ``megatron.core``: every engine that
megastart serves imports it before building a model, and waiting keeps the
entry-point scan out of every process that never trains.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType

from megastart.engines.base import Compatibility, EngineAdapter, IncompatibleHost

__all__ = [
    "Compatibility",
    "EngineAdapter",
    "IncompatibleHost",
    "activate",
    "adapters",
    "detach_all",
]

log = logging.getLogger("megastart")

TRIGGER_MODULE = "megatron.core"

_lock = threading.Lock()
_adapters: dict[str, EngineAdapter] = {}
_watching = False


def activate() -> None:
    """Attach every installed adapter once its host module is imported (idempotent)."""
    global _watching
    import wrapt

    with _lock:
        if _watching:
            return
        _watching = True
    wrapt.register_post_import_hook(_discover, TRIGGER_MODULE)


def adapters() -> dict[str, EngineAdapter]:
    """Adapters loaded so far, by host module name."""
    return dict(_adapters)


def load_adapter(name: str) -> EngineAdapter:
    """The adapter registered for host module ``name`` (loaded once per process)."""
    from megastart.manager import engine_entry_points

    with _lock:
        if name not in _adapters:
            (ep,) = [ep for ep in engine_entry_points() if ep.name == name]
            _adapters[name] = ep.load()()
        return _adapters[name]


def detach_all() -> None:
    """Restore every host method megastart wrapped in this process."""
    for adapter in adapters().values():
        adapter.detach()


def _discover(_module: ModuleType) -> None:
    import wrapt

    from megastart.manager import engine_entry_points, get_settings

    if not get_settings().enabled:
        log.info("megastart: disabled; no engine adapter attaches")
        return
    for ep in engine_entry_points():
        wrapt.register_post_import_hook(_attacher(ep.name), ep.name)


def _attacher(name: str):  # type: ignore[no-untyped-def]
    def attach(module: ModuleType) -> None:
        try:
            adapter = load_adapter(name)
        except ImportError as e:
            log.warning("megastart: engine adapter for %s could not be imported: %s", name, e)
            return
        adapter.attach(module)

    return attach
