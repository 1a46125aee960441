"""``megastart status``: what is installed, how it activates, what is blocked, which library
adapters would attach here (and for which hosts), and the resolved settings."""

from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "show plugins, engine adapters, how each host activates megastart, and settings"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def collect() -> dict[str, Any]:
    """The status as plain data (the ``--json`` output)."""
    import megastart
    from megastart import manager
    from megastart.engines import load_adapter

    pm = manager.get_plugin_manager()
    settings = manager.get_settings()
    plugins = []
    for ep in manager.plugin_entry_points():
        plugin = pm.get_plugin(ep.name)
        hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or []) if plugin else []
        plugins.append(
            {
                "name": ep.name,
                "distribution": ep.dist.name if ep.dist else None,
                "version": ep.dist.version if ep.dist else None,
                "hooks": hooks,
                "blocked": pm.is_blocked(ep.name),
                "loaded": plugin is not None,
            }
        )
    engines = []
    for ep in manager.engine_entry_points():
        adapter = load_adapter(ep.name)
        compat = adapter.compatibility()
        library = adapter.layer == "library"
        engines.append(
            {
                "name": ep.name,
                "host": adapter.host,
                "layer": adapter.layer,
                "serves": list(adapter.serves),
                "supported": adapter.requirement,
                "installed_version": compat.installed_version,
                "compatible": compat.compatible,
                "reason": compat.reason,
                "would_attach": compat.compatible
                and settings.enabled
                and (settings.core.library_adapters or not library),
            }
        )
    return {
        "version": megastart.__version__,
        "enabled": settings.enabled,
        "plugins": plugins,
        "engines": engines,
        "activation": activation(engines),
        "megatron_core": megatron_core_support(),
        "last_restart": last_restart(),
        "settings": settings.as_dict(),
    }


def last_restart() -> dict[str, Any] | None:
    """The last HF load a restart skipped on this machine (rank 0 of the job writes it)."""
    from dataclasses import asdict

    from megastart.restart.report import read_status

    skip = read_status()
    return None if skip is None else asdict(skip)


def activation(engines: list[dict[str, Any]]) -> dict[str, Any]:
    """How each installed host activates megastart, and this shell's bootstrap variable."""
    import os
    from importlib import metadata

    from megastart.routes import (
        BOOTSTRAP_GROUP,
        BOOTSTRAP_VARIABLE,
        HOST_PLUGIN_GROUPS,
        loads_megastart,
        plugin_group,
    )

    try:
        autowrapt: str | None = metadata.version("autowrapt")
    except metadata.PackageNotFoundError:
        autowrapt = None
    value = os.environ.get(BOOTSTRAP_VARIABLE, "")
    names_megastart = BOOTSTRAP_GROUP in [group.strip() for group in value.split(",")]
    hooked = {ep.name for ep in metadata.entry_points(group=BOOTSTRAP_GROUP)}
    hosts: dict[str, dict[str, Any]] = {}
    for engine in engines:
        if engine["installed_version"] is None or engine["host"] in hosts:
            continue
        if engine["layer"] == "library":  # reached through whichever host imports the library
            continue
        group = plugin_group(engine["host"])
        filtered = group is not None and not loads_megastart(
            group, os.environ.get(group.filter_variable)
        )
        if group is not None and not filtered:
            route = f"{group.group} (loaded by every import of {engine['host']}): installed = on"
        elif autowrapt is None:
            route = f"none: autowrapt is not installed, so {BOOTSTRAP_VARIABLE} does nothing"
        else:
            route = f"{BOOTSTRAP_VARIABLE}={BOOTSTRAP_GROUP} in the workers' environment"
        if filtered:
            assert group is not None
            route += (
                f" ({group.group} is filtered: {group.filter_variable}="
                f"{os.environ[group.filter_variable]} leaves megastart out)"
            )
        elif engine["host"] in HOST_PLUGIN_GROUPS and group is None:
            route += f" (this {engine['host']} is older than {HOST_PLUGIN_GROUPS[engine['host']].requirement})"
        hosts[engine["host"]] = {"version": engine["installed_version"], "route": route}
    return {
        "variable": BOOTSTRAP_VARIABLE,
        "value": value or None,
        "names_megastart": names_megastart,
        "autowrapt": autowrapt,
        "hosts": hosts,
        "unhooked_adapters": sorted({e["name"] for e in engines} - hooked),
    }


def megatron_core_support() -> dict[str, Any]:
    """The installed megatron-core against :data:`MEGATRON_CORE_TESTED`, with a warning
    when it is installed and outside that range (reads metadata only)."""
    from megastart.requirements import MEGATRON_CORE_TESTED, check_requirement

    compat = check_requirement(MEGATRON_CORE_TESTED)
    outside = compat.installed_version is not None and not compat.compatible
    return {
        "tested": MEGATRON_CORE_TESTED,
        "installed_version": compat.installed_version,
        "warning": (
            f"megatron-core {compat.installed_version} is outside the tested range "
            f"({MEGATRON_CORE_TESTED}): the loader's parameter names and the warmup's "
            "process groups may not match it"
            if outside
            else None
        ),
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        f"megastart {report['version']} — {'enabled' if report['enabled'] else 'DISABLED'}",
        "",
    ]
    lines.append("plugins (entry-point group 'megastart'):")
    for p in report["plugins"]:
        state = "BLOCKED" if p["blocked"] else ("loaded" if p["loaded"] else "not loaded")
        hooks = ", ".join(p["hooks"]) or "-"
        lines.append(
            f"  {p['name']:<16} {state:<10} {p['distribution']} {p['version']}  hooks: {hooks}"
        )
    if not report["plugins"]:
        lines.append("  (none installed)")
    lines += ["", "engine adapters (entry-point group 'megastart.engines'):"]
    hosts = [e for e in report["engines"] if e["layer"] == "host"]
    for e in hosts:
        lines.append(
            f"  {e['host']:<8} {e['name']}\n           supports {e['supported']}; {_host_state(e)}"
        )
    if not hosts:
        lines.append("  (none installed)")
    library = report["settings"].get("library_adapters", {}).get("value", True)
    lines += [
        "",
        "library adapters (any host that loads or trains through these libraries; "
        f"library_adapters={'on' if library else 'OFF'}):",
    ]
    for e in (e for e in report["engines"] if e["layer"] == "library"):
        attach = "would attach here" if e["would_attach"] else "would NOT attach here"
        lines.append(
            f"  {e['host']:<15} {e['name']}\n           supports {e['supported']}; "
            f"{_host_state(e)}; {attach}\n           for: {'; '.join(e['serves'])}"
        )
    lines += ["", *render_activation(report["activation"])]
    core = report["megatron_core"]
    lines += [
        "",
        f"megatron-core: installed {core['installed_version'] or '-'}; tested {core['tested']}",
    ]
    if core["warning"]:
        lines.append(f"  WARNING: {core['warning']}")
    skip = report.get("last_restart")
    lines += ["", "last restart on this machine:"]
    lines.append(
        "  (no HF load skipped)"
        if skip is None
        else f"  {skip['host']}: HF load of {skip['checkpoint']} skipped, "
        f"{skip['bytes_not_read']:,} bytes not read; the resume from {skip['resume']} "
        f"restored all {skip['parameters']} parameters of rank 0"
    )
    lines += ["", "settings (value  <- source):"]
    rows = [
        (key, entry) if "source" in entry else (f"{key}.{field}", sub)
        for key, entry in report["settings"].items()
        for field, sub in ([(None, entry)] if "source" in entry else entry.items())
    ]
    width = max((len(name) for name, _ in rows), default=0)
    values = max((len(repr(entry["value"])) for _, entry in rows), default=0)
    for name, entry in rows:
        lines.append(f"  {name:<{width}}  {entry['value']!r:<{values}}  <- {entry['source']}")
    return "\n".join(lines)


def _host_state(engine: dict[str, Any]) -> str:
    """Whether the adapter can attach here: its host installed and in its range, or why not."""
    if engine["installed_version"] is None:
        return "not installed here (nothing to attach to)"
    if engine["compatible"]:
        return f"installed {engine['installed_version']}: compatible"
    return f"installed {engine['installed_version']}: NOT compatible ({engine['reason']})"


def render_activation(report: dict[str, Any]) -> list[str]:
    from megastart.routes import BOOTSTRAP_GROUP

    if report["value"] is None:
        shell = "unset"
    elif report["names_megastart"]:
        shell = f"{report['value']!r}: megastart activates in this shell's processes"
    else:
        shell = f"{report['value']!r}: does not name {BOOTSTRAP_GROUP}"
    lines = [f"activation ({report['variable']} in this shell: {shell}):"]
    for host, entry in report["hosts"].items():
        lines.append(f"  {host:<8} {entry['version']:<10} {entry['route']}")
    if not report["hosts"]:
        lines.append("  (no supported host installed)")
    for name in report["unhooked_adapters"]:
        lines.append(f"  {name}: never attaches (no {BOOTSTRAP_GROUP!r} entry point)")
    return lines
