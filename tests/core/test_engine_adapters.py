"""Engine adapters attach the moment their host module's import returns (through
autowrapt's variable, or ``import megastart.autoload`` before or after the host),
refuse incompatible hosts loudly, and detach cleanly; without the variable,
nothing of megastart is imported."""

from __future__ import annotations

import json
from textwrap import dedent

from support.pyrun import run_python

REPORT = dedent("""
    import json, logging
    from megastart.engines import adapters, detach_all
    from megastart_toyhost import engine
    original = engine.Engine.__dict__["load_weights"]
    e = engine.Engine()
    e.load_weights("toy:weights")
    by_plugin = e.loaded_by
    e.load_weights("/real/checkpoint")
    by_host = e.loaded_by
    attached = {name: a.attached for name, a in adapters().items()}
    wrapped = hasattr(engine.Engine.__dict__["load_weights"], "__wrapped__")
    detach_all(); detach_all()
    restored = engine.Engine.__dict__["load_weights"]
    print(json.dumps({"attached": attached, "wrapped": wrapped, "by_plugin": by_plugin,
                      "by_host": by_host, "unwrapped": not hasattr(restored, "__wrapped__")}))
""")


def check_attached(out: dict) -> None:
    assert out["attached"]["megastart_toyhost.engine"] is True
    assert out["wrapped"] and out["unwrapped"]
    assert out["by_plugin"] == "toy_handler"
    assert out["by_host"] == "host"


# The built-in loader would try to read the toy checkpoints from disk.
TOY_ONLY = {"MEGASTART_BLOCKLIST": "rank0_loader"}
BOOTSTRAP = {"AUTOWRAPT_BOOTSTRAP": "megastart.bootstrap"}


def test_variable_wraps_the_host_class_when_its_import_returns():
    code = """
        import json
        from megastart_toyhost import engine
        print(json.dumps(hasattr(engine.Engine.__dict__["load_weights"], "__wrapped__")))
    """
    assert json.loads(run_python(code, env={**TOY_ONLY, **BOOTSTRAP}).stdout) is True


def test_host_imported_with_the_variable_is_attached_and_detached():
    check_attached(json.loads(run_python(REPORT, env={**TOY_ONLY, **BOOTSTRAP}).stdout))


def test_host_imported_after_autoload_is_attached_and_detached():
    code = "import megastart.autoload\n" + REPORT
    check_attached(json.loads(run_python(code, env=TOY_ONLY).stdout))


def test_host_imported_before_autoload_is_attached_too():
    code = "import megastart_toyhost.engine\nimport megastart.autoload\n" + REPORT
    check_attached(json.loads(run_python(code, env=TOY_ONLY).stdout))


def test_both_routes_in_one_process_attach_once():
    code = "import megastart.autoload\n" + REPORT
    check_attached(json.loads(run_python(code, env={**TOY_ONLY, **BOOTSTRAP}).stdout))


def test_without_the_variable_nothing_of_megastart_is_imported_or_attached():
    # autowrapt's own start-up file imports autowrapt (one small module) and stops there
    code = """
        import json, sys
        from megastart_toyhost import engine
        print(json.dumps({
            "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("megastart", "wrapt")),
            "wrapped": hasattr(engine.Engine.__dict__["load_weights"], "__wrapped__"),
        }))
    """
    out = json.loads(run_python(code, env={"AUTOWRAPT_BOOTSTRAP": ""}).stdout)
    assert out == {"imported": [], "wrapped": False}


def test_disabled_megastart_attaches_nothing():
    proc = run_python(REPORT, env={**BOOTSTRAP, "MEGASTART_DISABLE": "1"})
    out = json.loads(proc.stdout)
    assert out["attached"] == {} and not out["wrapped"] and out["by_plugin"] == "host"


REFUSED = """
    import importlib, logging; logging.basicConfig(level=logging.INFO)
    import megastart.autoload
    host = importlib.import_module({module!r})
    from megastart.engines import adapters
    print(adapters()[{module!r}].attached, hasattr(host.Engine.load_weights, "__wrapped__"))
"""


def refused(module: str) -> str:
    """Import the toy host ``module`` after activation; assert nothing was wrapped; its stderr."""
    proc = run_python(REFUSED.format(module=module))
    assert proc.stdout.split() == ["False", "False"]
    return proc.stderr


def test_incompatible_version_is_refused_with_the_version():
    assert (
        "not attaching to megastart_toyhost.future: requested megastart-toyplugin>=99 "
        "but found megastart-toyplugin 1.0.0" in refused("megastart_toyhost.future")
    )


def test_missing_attribute_is_refused_by_name():
    assert (
        "not attaching to megastart_toyhost.renamed (toyhost 1.0.0): missing "
        "megastart_toyhost.renamed.Engine.load_hf_weights" in refused("megastart_toyhost.renamed")
    )
