"""Engine adapters: discovered through the ``megastart.engines`` entry points and
attached when the host module they name is imported.

Discovery waits for the first import of ``megatron.core``: every engine that
megastart serves imports it before building a model, and waiting keeps the
entry-point scan out of every process that never trains.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    # the base imports the manager (pluggy): not on activation's path
    if name in ("Compatibility", "EngineAdapter", "IncompatibleHost"):
        from megastart.engines import base

        return getattr(base, name)
    raise AttributeError(f"module 'megastart.engines' has no attribute {name!r}")


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


def _attacher(name: str) -> Callable[[ModuleType], None]:
    def attach(module: ModuleType) -> None:
        if _executing(module):
            # The host module imports megatron.core itself (verl's transformer_impl
            # does), so discovery ran in the middle of the host module's import and
            # wrapt called this hook at once, before the host's classes exist.
            _when_imported.defer(name, attach)
            return
        try:
            adapter = load_adapter(name)
        except ImportError as e:
            log.warning("megastart: engine adapter for %s could not be imported: %s", name, e)
            return
        adapter.attach(module)

    return attach


def _executing(module: ModuleType) -> bool:
    """Whether the module's body is still running on this thread (it is importing something)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is vars(module) and frame.f_code.co_name == "<module>":
            return True
        frame = frame.f_back
    return False


class _WhenImported:
    """A meta-path finder that finds nothing: on every import it calls the deferred
    attaches whose host module has finished executing, and leaves ``sys.meta_path``
    once none is left. A host module's import is always followed by more imports
    (its package's, its caller's) before the host can build a model."""

    def __init__(self) -> None:
        self._pending: dict[str, Callable[[ModuleType], None]] = {}
        # Not the module's _lock: load_adapter holds that while it imports.
        self._lock = threading.Lock()

    def defer(self, name: str, attach: Callable[[ModuleType], None]) -> None:
        with self._lock:
            self._pending[name] = attach
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        ready = []
        with self._lock:
            for name in list(self._pending):
                module = sys.modules.get(name)
                if module is not None and not _executing(module):
                    ready.append((self._pending.pop(name), module))
            if not self._pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        for attach, module in ready:
            attach(module)


_when_imported = _WhenImported()
