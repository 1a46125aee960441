"""The process's one plugin manager, built lazily on first use.

Building it reads the core settings first, blocks the plugins on the
blocklist, and only then loads the ``megastart`` entry points, so a blocked
plugin is never imported (pluggy skips blocked names in
``load_setuptools_entrypoints``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import pluggy

from megastart import hookspec
from megastart.settings import _CORE_ENV, Settings, SettingsError, resolve, to_plain_mapping

PLUGIN_GROUP = "megastart"
ENGINE_GROUP = "megastart.engines"

log = logging.getLogger("megastart")

_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_settings: Settings | None = None
_config: Any = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager, with every enabled, unblocked plugin loaded."""
    global _manager, _settings
    with _lock:
        if _manager is None:
            _manager, _settings = _build(_config)
        return _manager


def get_settings() -> Settings:
    """The process's resolved settings (builds the plugin manager if needed)."""
    get_plugin_manager()
    assert _settings is not None
    return _settings


def configure(config: Any = None) -> Settings:
    """Give megastart the ``megastart:`` section of a host config.

    Hosts with a config call this before the first hook; it rebuilds the
    manager if one was built already with a different config.
    """
    global _config
    with _lock:
        if config is not _config:
            _config = config
            reset(keep_config=True)
        return get_settings()


def reset(*, keep_config: bool = False) -> None:
    """Forget the manager and settings; the next use rebuilds them (for tests and ``configure``)."""
    global _manager, _settings, _config
    with _lock:
        _manager = None
        _settings = None
        if not keep_config:
            _config = None


def plugin_entry_points() -> list[metadata.EntryPoint]:
    """Every installed hook-implementation plugin, loaded or not."""
    return sorted(metadata.entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name)


def engine_entry_points() -> list[metadata.EntryPoint]:
    """Every installed engine adapter, named by the host module it attaches to."""
    return sorted(metadata.entry_points(group=ENGINE_GROUP), key=lambda ep: ep.name)


def call_hook(name: str, **kwargs: Any) -> Any:
    """Call hook ``name`` on every plugin; log once on rank 0 what ran and how long.

    Returns what pluggy returns: the first non-``None`` result of a
    ``firstresult`` hook, else the list of results. With megastart disabled,
    nothing runs and the result is ``None`` (or ``[]``).
    """
    pm = get_plugin_manager()
    hook = getattr(pm.hook, name)
    impls = [impl.plugin_name for impl in reversed(hook.get_hookimpls())]
    start = time.perf_counter()
    result = hook(**kwargs)
    seconds = time.perf_counter() - start
    if _rank() == 0:
        if hasattr(result, "summary"):
            what = result.summary()
        elif hook.spec is not None and hook.spec.opts.get("firstresult"):
            what = "not handled by any plugin; the host's own code runs"
        else:
            what = f"ran {impls or 'no plugin'}"
        log.info("megastart: %s %s (%.2f s)", name, what, seconds)
    return result


def _build(config: Any) -> tuple[pluggy.PluginManager, Settings]:
    known = [ep.name for ep in plugin_entry_points()]
    core_only = _core_settings(config)
    core = core_only.core
    pm = pluggy.PluginManager(hookspec.PROJECT)
    pm.add_hookspecs(hookspec)
    if not core.enabled:
        return pm, core_only
    unknown = sorted(set(core.blocklist) - set(known))
    if unknown:
        log.warning(
            "megastart: blocklist names %s, which no installed plugin is called; installed: %s",
            unknown,
            known,
        )
    for name in core.blocklist:
        pm.set_blocked(name)
    pm.load_setuptools_entrypoints(PLUGIN_GROUP)
    sections = {
        name: plugin.megastart_settings
        for name, plugin in pm.list_name_plugin()
        if plugin is not None and hasattr(plugin, "megastart_settings")
    }
    sections.update(_engine_sections())
    settings = resolve(config, sections=sections, ignored_sections=set(known) - set(sections))
    if settings.core.trace:
        pm.trace.root.setwriter(_trace_writer)
        pm.enable_tracing()
    return pm, settings


def _core_settings(config: Any) -> Settings:
    """The top-level settings alone: read before any plugin or adapter is imported,
    so sections (whose classes live in those modules) are not looked at yet."""
    top_level = {k: v for k, v in to_plain_mapping(config).items() if not isinstance(v, Mapping)}
    environ = {k: v for k, v in os.environ.items() if k in _CORE_ENV}
    return resolve(top_level, environ=environ)


def _engine_sections() -> dict[str, type]:
    """Settings sections that engine adapters declare, named after their host.

    Adapters of one host (verl's engine and legacy-worker adapters) share its
    section, so they must declare the same class. Loading an adapter class imports
    megastart's adapter module, never the host.
    """
    sections: dict[str, type] = {}
    for ep in engine_entry_points():
        try:
            adapter_class = ep.load()
        except ImportError as e:  # one broken adapter must not stop the others
            log.warning("megastart: engine adapter for %s could not be imported: %s", ep.name, e)
            continue
        if hasattr(adapter_class, "megastart_settings"):
            declared = sections.setdefault(adapter_class.host, adapter_class.megastart_settings)
            if declared is not adapter_class.megastart_settings:
                raise SettingsError(
                    f"engine adapters of host {adapter_class.host!r} declare different settings "
                    f"sections ({declared.__qualname__} and "
                    f"{adapter_class.megastart_settings.__qualname__}, the latter from {ep.value}); "
                    "adapters of one host share one section: declare the same class"
                )
    return sections


def _trace_writer(message: str) -> None:
    log.info("megastart[rank %s] %s", _rank(), message.rstrip())


def _rank() -> int:
    """This process's global rank, without importing torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))
