"""How megastart is activated in a host's processes, as data: the variable, its entry-point
group, and the hosts' own plugin groups. :mod:`megastart.activation` acts on them;
``megastart status`` and the verl config group report them. Imported at interpreter
start-up wherever the variable is set: at module level it imports only ``typing``."""

from __future__ import annotations

from typing import NamedTuple

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
    from megastart.requirements import check_requirement  # not at start-up: packaging

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
