"""Engine adapters attach when their host module is imported (before or after
activation), refuse incompatible hosts loudly, and detach cleanly."""

from __future__ import annotations

import json
from textwrap import dedent

from pyrun import run_python

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


def test_host_imported_after_activation_is_attached_and_detached():
    code = "import megastart.autoload, megatron.core\n" + REPORT
    check_attached(json.loads(run_python(code, env=TOY_ONLY).stdout))


def test_host_imported_before_activation_is_attached_too():
    code = "import megastart_toyhost.engine\nimport megastart.autoload, megatron.core\n" + REPORT
    check_attached(json.loads(run_python(code, env=TOY_ONLY).stdout))


def test_nothing_attaches_before_megatron_core_is_imported():
    code = """
        import megastart.autoload, megastart_toyhost.engine
        from megastart.engines import adapters
        print(adapters())
    """
    assert run_python(code).stdout.strip() == "{}"


def test_disabled_megastart_attaches_nothing():
    code = "import megastart.autoload, megatron.core\n" + REPORT
    proc = run_python(code, env={"MEGASTART_DISABLE": "1"})
    out = json.loads(proc.stdout)
    assert out["attached"] == {} and not out["wrapped"] and out["by_plugin"] == "host"


REFUSED = """
    import importlib, logging; logging.basicConfig(level=logging.INFO)
    import megastart.autoload, megatron.core
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
