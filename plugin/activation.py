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
at module level it imports only ``threading``, ``typing`` and :mod:`megastart.routes`
(the routes as data, which imports nothing more; wrapt, which autowrapt has
imported by then, imports both).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from megastart.routes import BOOTSTRAP_GROUP

if TYPE_CHECKING:
    from types import ModuleType

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
