"""The plugin manager finds plugins through real entry points (the installed
``megastart-toyplugin`` test distribution), blocks before import, and dispatches
``firstresult`` hooks in order. Each test runs in a fresh interpreter."""

from __future__ import annotations

import json
from textwrap import dedent

import pytest
from support.pyrun import run_python

DISPATCH = dedent("""
    import json, sys
    from megastart import EngineContext
    from megastart.manager import call_hook, get_plugin_manager
    from megastart_toyplugin import CALLS
    ctx = EngineContext(host="t", host_version="0", model_chunks=[], parallel_state=sys, device="cpu")
    report = call_hook("on_model_load", engine=ctx, checkpoint="toy:ckpt")
    print(json.dumps({
        "report": None if report is None else report.plugin,
        "calls": CALLS,
        "plugins": sorted(n for n, p in get_plugin_manager().list_name_plugin() if p is not None),
        "imported": sorted(m for m in sys.modules if m.startswith("megastart_toyplugin.")),
    }))
""")


# The built-in loader would try to read "toy:ckpt" from disk: block it, so
# the toy plugins are the only implementations of on_model_load.
BUILTIN = "rank0_loader,comm_warmup"


def dispatch(blocklist: str = "", **env: str) -> dict:
    env["MEGASTART_BLOCKLIST"] = ",".join(filter(None, [BUILTIN, blocklist]))
    return json.loads(run_python(DISPATCH, env=env).stdout)


def test_plugins_are_discovered_through_entry_points():
    code = "from megastart.manager import get_plugin_manager; print(sorted(get_plugin_manager().list_name_plugin()))"
    names = run_python(code).stdout
    for name in ("rank0_loader", "comm_warmup", "toy_pass", "toy_handler", "toy_heavy"):
        assert f"('{name}', <module" in names


def test_firstresult_falls_through_in_order_to_the_first_handler():
    out = dispatch()
    assert out["calls"] == ["toy_pass", "toy_handler"]
    assert out["report"] == "toy_handler"


def test_blocked_handler_falls_through_to_the_host():
    out = dispatch("toy_handler")
    assert out["calls"] == ["toy_pass"]
    assert out["report"] is None


def test_blocklist_skips_import():
    out = dispatch("toy_heavy")
    assert "megastart_toyplugin.heavy" not in out["imported"]
    assert "toy_heavy" not in out["plugins"] and "comm_warmup" not in out["plugins"]
    assert "megastart_toyplugin.handler" in out["imported"]


def test_blocklist_from_config_section():
    code = """
        import sys
        from megastart import manager
        manager.configure({"blocklist": ["toy_heavy"]})
        manager.get_plugin_manager()
        print("megastart_toyplugin.heavy" in sys.modules)
    """
    assert run_python(code).stdout.strip() == "False"


def test_disable_runs_no_hook_and_imports_no_plugin():
    out = dispatch(MEGASTART_DISABLE="1")
    assert out["calls"] == [] and out["report"] is None
    assert out["imported"] == [] and out["plugins"] == []


def test_misspelt_blocklist_entry_warns():
    proc = run_python(DISPATCH, env={"MEGASTART_BLOCKLIST": f"{BUILTIN},toy_hevy"})
    assert "blocklist names ['toy_hevy'], which no installed plugin is called" in proc.stderr


def test_hook_call_is_logged_once_with_what_handled_it():
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + DISPATCH
    proc = run_python(code, env={"MEGASTART_BLOCKLIST": BUILTIN})
    lines = [line for line in proc.stderr.splitlines() if "megastart: on_model_load" in line]
    assert len(lines) == 1 and "toy_handler" in lines[0]


def test_trace_logs_every_implementation_call():
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + DISPATCH
    proc = run_python(code, env={"MEGASTART_TRACE": "1", "MEGASTART_BLOCKLIST": BUILTIN})
    trace = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("INFO:megastart:megastart[rank 0]")
    ]
    assert any("on_model_load" in line for line in trace)


def test_invalid_settings_fail_at_first_use_with_the_valid_keys():
    proc = run_python(
        DISPATCH,
        env={"MEGASTART_TOY_HANDLER_RETRIES": "-1", "MEGASTART_BLOCKLIST": BUILTIN},
        check=False,
    )
    assert proc.returncode != 0
    assert "invalid megastart settings toy_handler: retries must be >= 0, got -1" in proc.stderr


def test_plugin_settings_section_comes_from_its_dataclass():
    code = """
        from megastart.manager import get_settings
        s = get_settings()
        print(s.section("toy_handler").greeting, s.sources["toy_handler.greeting"])
    """
    out = run_python(code, env={"MEGASTART_TOY_HANDLER_GREETING": "hi"}).stdout.split()
    assert out == ["hi", "env:MEGASTART_TOY_HANDLER_GREETING"]


def test_import_megastart_imports_neither_torch_nor_entry_points():
    code = """
        import sys, megastart, megastart.autoload
        print(sorted(m for m in ("torch", "megastart.manager", "importlib.metadata", "megastart_toyplugin") if m in sys.modules))
    """
    loaded = run_python(code).stdout.strip()
    assert (
        "torch" not in loaded
        and "megastart.manager" not in loaded
        and "megastart_toyplugin" not in loaded
    )


class FirstHostSettings:
    pass


class SecondHostSettings:
    pass


class FirstHostAdapter:
    host = "twoadapters"
    megastart_settings = FirstHostSettings


class SecondHostAdapter:
    host = "twoadapters"
    megastart_settings = FirstHostSettings


class ConflictingHostAdapter:
    host = "twoadapters"
    megastart_settings = SecondHostSettings


def engine_points(*classes: str) -> list:
    from importlib import metadata

    return [
        metadata.EntryPoint(name=f"host.m{i}", value=f"test_plugin_manager:{name}", group="g")
        for i, name in enumerate(classes)
    ]


def test_adapters_of_one_host_share_its_settings_section(monkeypatch):
    from megastart import manager

    monkeypatch.setattr(
        manager,
        "engine_entry_points",
        lambda: engine_points("FirstHostAdapter", "SecondHostAdapter"),
    )
    assert manager._engine_sections() == {"twoadapters": FirstHostSettings}


def test_adapters_of_one_host_with_different_sections_are_an_error(monkeypatch):
    from megastart import manager
    from megastart.settings import SettingsError

    monkeypatch.setattr(
        manager,
        "engine_entry_points",
        lambda: engine_points("FirstHostAdapter", "ConflictingHostAdapter"),
    )
    with pytest.raises(SettingsError, match=r"host 'twoadapters' declare different settings"):
        manager._engine_sections()
