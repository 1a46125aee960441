"""Activation: each engine adapter attaches in a post-import hook on its host module.

Two routes register those hooks, and both read one entry-point group,
:data:`BOOTSTRAP_GROUP` (host module -> :func:`attach`):

- verl >= 0.9 loads its own plugin group ``verl.plugins`` at ``import verl``, in
  the driver and in every Ray worker; megastart's entry there is
  :mod:`megastart.autoload`, which calls :func:`activate`. Installed = on.
- Every other host: ``AUTOWRAPT_BOOTSTRAP=megastart.bootstrap`` in the workers'
  environment. autowrapt's start-up file then registers the group's entries as
  wrapt post-import hooks, as :func:`activate` does; without the variable it
  imports nothing.

wrapt calls a post-import hook right after the host module's body has run (at
once if it ran before), so the host's classes are wrapped when ``import
host.module`` returns.

This module is imported at interpreter start-up wherever the variable is set:
at module level it imports only ``threading`` and ``typing`` (wrapt, which
autowrapt has imported by then, imports both).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from types import ModuleType

BOOTSTRAP_GROUP = "megastart.bootstrap"
"""The entry-point group autowrapt's variable names: host module -> :func:`attach`."""

BOOTSTRAP_VARIABLE = "AUTOWRAPT_BOOTSTRAP"


class PluginGroup(NamedTuple):
    """A host's own entry-point group that loads megastart without a variable."""

    requirement: str
    """The host versions that load the group (``"verl>=0.9"``)."""

    group: str
    filter_variable: str
    """The host's variable that selects which of the group's plugins load."""


HOST_PLUGIN_GROUPS = {
    "verl": PluginGroup("verl>=0.9", "verl.plugins", "VERL_USE_EXTERNAL_PLUGINS"),
}
"""Hosts whose own plugin mechanism activates megastart, by distribution name."""

PLUGIN_NAME = "megastart"
"""megastart's name in every host plugin group."""


def plugin_group(host: str) -> PluginGroup | None:
    """The plugin group through which the installed ``host`` loads megastart, or
    ``None`` when its version has none (or it is not installed)."""
    from megastart.engines.base import check_requirement  # not at start-up: it loads pluggy

    group = HOST_PLUGIN_GROUPS.get(host)
    if group is None:
        return None
    return group if check_requirement(group.requirement).compatible else None


def loads_megastart(group: PluginGroup, filter_value: str | None) -> bool:
    """Whether the host loads megastart from ``group`` with its filter variable set to
    ``filter_value`` (verl: unset or ``auto``: every plugin; ``none``: none; else a
    comma list of names)."""
    value = (filter_value or "auto").strip().lower()
    if value == "auto":
        return True
    return PLUGIN_NAME in {name.strip() for name in value.split(",")}


_lock = threading.Lock()
_activated = False
_attached: set[str] = set()


def activate() -> None:
    """Register :func:`attach` for every host module of :data:`BOOTSTRAP_GROUP`
    (idempotent): what autowrapt does when the variable names the group."""
    global _activated
    with _lock:
        if _activated:
            return
        _activated = True
    import wrapt

    wrapt.discover_post_import_hooks(BOOTSTRAP_GROUP)


def attach(module: ModuleType) -> None:
    """Post-import hook: attach the engine adapter of ``module`` (once per module,
    however many routes registered the hook)."""
    with _lock:
        if module.__name__ in _attached:
            return
        _attached.add(module.__name__)
    from megastart.engines import attach_adapter

    attach_adapter(module)
