"""Engine adapters, registered in the ``megastart.engines`` entry points by the host
module they attach to, and loaded once per process.

:mod:`megastart.activation` calls :func:`attach_adapter` from a post-import hook
on each host module.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType

from megastart.engines.base import Compatibility, EngineAdapter
from megastart.manager import ENGINE_GROUP, engine_entry_points, get_settings

__all__ = [
    "Compatibility",
    "EngineAdapter",
    "adapters",
    "attach_adapter",
    "detach_all",
    "load_adapter",
]

log = logging.getLogger("megastart")

_lock = threading.Lock()
_adapters: dict[str, EngineAdapter] = {}


def attach_adapter(module: ModuleType) -> None:
    """Attach the adapter registered for ``module``, unless megastart is disabled (or, for
    a library adapter, the ``library_adapters`` setting is off)."""
    settings = get_settings()
    if not settings.enabled:
        log.info("megastart: disabled; not attaching to %s", module.__name__)
        return
    try:
        adapter = load_adapter(module.__name__)
    except ImportError as e:
        log.warning(
            "megastart: engine adapter for %s could not be imported: %s", module.__name__, e
        )
        return
    if adapter.layer == "library" and not settings.core.library_adapters:
        log.info("megastart: library_adapters is off; not attaching to %s", module.__name__)
        return
    adapter.attach(module)


def adapters() -> dict[str, EngineAdapter]:
    """Adapters loaded so far, by host module name."""
    return dict(_adapters)


def load_adapter(name: str) -> EngineAdapter:
    """The adapter registered for host module ``name`` (loaded once per process)."""
    with _lock:
        if name not in _adapters:
            found = [ep for ep in engine_entry_points() if ep.name == name]
            if not found:
                raise LookupError(
                    f"megastart: no engine adapter is registered for {name} in the "
                    f"{ENGINE_GROUP!r} entry points; a distribution that hooks a host module "
                    "must register its adapter there under the same name"
                )
            _adapters[name] = found[0].load()()
        return _adapters[name]


def detach_all() -> None:
    """Restore every host method megastart wrapped in this process."""
    for adapter in adapters().values():
        adapter.detach()
