"""What an AReaL user types activates megastart in the workers, and the adapter
attaches to (and detaches from) the installed AReaL, or refuses it loudly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from areal_cpu import python_path
from pyrun import run_python

CONFIG = os.path.join(os.path.dirname(__file__), "data", "experiment.yaml")
SEARCHPATH = "hydra.searchpath=[pkg://megastart.configs.overrides]"
"""Names megastart's groups explicitly: Hydra 1.3 does not find the SearchPathPlugin
of an editable install (its ``hydra_plugins`` scan misses setuptools' import finder)."""

COMPOSE = """
    import json, sys
    from areal.api.cli_args import GRPOConfig, load_expr_config
    cfg, _ = load_expr_config(sys.argv[1:], GRPOConfig)
    print(json.dumps({role: {"cmd": getattr(cfg, role).scheduling_spec[0].cmd,
                             "env": getattr(cfg, role).scheduling_spec[0].env_vars,
                             "gpu": getattr(cfg, role).scheduling_spec[0].gpu}
                      for role in ("actor", "ref", "rollout")}))
"""


def compose(tmp_path, *overrides: str) -> dict:
    """AReaL's own ``load_expr_config`` on the test experiment, in a fresh process."""
    script = tmp_path / "compose.py"
    script.write_text(__import__("textwrap").dedent(COMPOSE))
    proc = subprocess.run(
        [sys.executable, str(script), "--config", CONFIG, *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": python_path()},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(last_line(proc.stdout))


def last_line(stdout: str) -> str:
    """The test's own output: AReaL logs to stdout too."""
    return stdout.strip().splitlines()[-1]


def test_override_group_sets_worker_command_and_settings(tmp_path):
    out = compose(
        tmp_path,
        SEARCHPATH,
        "+megastart_areal=single_controller",
        "actor.scheduling_spec.0.env_vars.MEGASTART_AREAL_SKIP_HF_LOAD_ON_RECOVER=1",
    )
    for role in ("actor", "ref"):
        assert out[role]["cmd"] == "python3 -m megastart.areal_worker"
        assert out[role]["env"] == {
            "MEGASTART_ENABLED": "1",
            "MEGASTART_AREAL_SKIP_HF_LOAD_ON_RECOVER": "1",
        }
        assert out[role]["gpu"] == 1  # the group replaces the experiment's spec (gpu: 2)


def test_spmd_group_carries_settings_to_the_torchrun_trainers(tmp_path):
    out = compose(tmp_path, SEARCHPATH, "+megastart_areal=spmd")
    assert out["actor"]["cmd"] == "python3 -m areal.infra.rpc.rpc_server"
    assert out["actor"]["env"]["MEGASTART_ENABLED"] == "1"


def test_field_overrides_keep_a_custom_worker_spec(tmp_path):
    out = compose(
        tmp_path,
        "actor.scheduling_spec.0.cmd=python3 -m megastart.areal_worker",
        "+actor.scheduling_spec.0.env_vars.MEGASTART_BLOCKLIST=rank0_loader",
    )
    assert out["actor"] == {
        "cmd": "python3 -m megastart.areal_worker",
        "env": {"MEGASTART_BLOCKLIST": "rank0_loader"},
        "gpu": 2,
    }


def test_unknown_megastart_key_is_what_areal_refuses(tmp_path):
    with pytest.raises(AssertionError, match="megastart"):
        compose(tmp_path, "+megastart.enabled=true")


def test_worker_entry_point_runs_areals_rpc_server():
    proc = subprocess.run(
        [sys.executable, "-m", "megastart.areal_worker", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": python_path()},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--experiment-name" in proc.stdout and "--werkzeug-log-level" in proc.stdout


ATTACH = """
    import json, megastart.autoload, wrapt
    from areal_cpu import import_megatron_engine
    from megastart.engines import adapters, detach_all
    from megastart.engines.areal import ArealAdapter
    module = import_megatron_engine()
    names = [name.split(".")[1] for name in ArealAdapter.wraps]
    adapter = adapters().get("areal.engine.megatron_engine")
    wrapped = [n for n in names if isinstance(vars(module.MegatronEngine)[n], wrapt.FunctionWrapper)]
    originals = {n: vars(module.MegatronEngine)[n].__wrapped__ for n in wrapped}
    detach_all(); detach_all()
    restored = [n for n in names if vars(module.MegatronEngine)[n] is originals.get(n)]
    print(json.dumps({"attached": adapter is not None and not adapter.attached,
                      "names": names, "wrapped": wrapped, "restored": restored}))
"""


def test_adapter_attaches_to_installed_megatron_engine_and_detaches():
    out = json.loads(last_line(run_python(ATTACH, env={"PYTHONPATH": python_path()}).stdout))
    assert out["wrapped"] == out["names"] and len(out["names"]) == 8
    assert out["restored"] == out["names"]
    assert out["attached"]  # the adapter existed and is detached now


def test_incompatible_areal_version_is_refused_loudly(tmp_path):
    dist_info = tmp_path / "areal-0.9.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: areal\nVersion: 0.9.0\n")
    code = """
        import logging, sys; logging.basicConfig(level=logging.INFO)
        import megastart.autoload
        from areal_cpu import import_megatron_engine
        from megastart.engines import adapters
        module = import_megatron_engine()
        import wrapt
        print(adapters()["areal.engine.megatron_engine"].attached,
              isinstance(vars(module.MegatronEngine)["load"], wrapt.FunctionWrapper))
    """
    proc = run_python(code, env={"PYTHONPATH": os.pathsep.join([str(tmp_path), python_path()])})
    assert last_line(proc.stdout).split() == ["False", "False"]
    assert (
        "not attaching to areal.engine.megatron_engine: requested areal>=1.0.4,<1.1 "
        "but found areal 0.9.0" in proc.stderr
    )
