"""Activates megastart in this process; import it from a host's module hook.

verl: ``VERL_USE_EXTERNAL_MODULES=megastart.autoload``; AReaL: the worker
command or ``PYTHONSTARTUP``-style env vars set by megastart's config group.
Importing this module only registers a post-import hook (no entry-point scan,
no torch): adapters attach when the host's Megatron engine module is imported.
"""

from megastart.engines import activate

activate()
