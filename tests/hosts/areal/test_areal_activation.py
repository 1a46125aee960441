"""What an AReaL user types activates megastart in the workers: one override per
setting through the workers' ``env_vars`` (the user's worker spec kept), and
``AUTOWRAPT_BOOTSTRAP`` wraps ``MegatronEngine`` when its import returns, in a fresh
interpreter and in a Ray actor started as AReaL's Ray scheduler starts one. The
adapter attaches to (and detaches from) the installed AReaL, or refuses it loudly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from areal_cpu import python_path
from support.pyrun import run_python

from megastart.engines.areal import ArealAdapter

CONFIG = os.path.join(os.path.dirname(__file__), "data", "experiment.yaml")

COMPOSE = """
    import json, sys
    from areal.api.cli_args import GRPOConfig, load_expr_config
    cfg, _ = load_expr_config(sys.argv[1:], GRPOConfig)
    print(json.dumps({role: {"cmd": getattr(cfg, role).scheduling_spec[0].cmd,
                             "env": getattr(cfg, role).scheduling_spec[0].env_vars,
                             "gpu": getattr(cfg, role).scheduling_spec[0].gpu}
                      for role in ("actor", "ref", "rollout")}))
"""


def compose(tmp_path, *overrides: str, config: str = CONFIG) -> dict:
    """AReaL's own ``load_expr_config`` on the test experiment, in a fresh process."""
    script = tmp_path / "compose.py"
    script.write_text(__import__("textwrap").dedent(COMPOSE))
    proc = subprocess.run(
        [sys.executable, str(script), "--config", config, *overrides],
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


ON = "++actor.scheduling_spec.0.env_vars.AUTOWRAPT_BOOTSTRAP=megastart.bootstrap"


def test_one_override_per_setting_keeps_the_users_worker_spec(tmp_path):
    out = compose(
        tmp_path,
        ON,
        "++actor.scheduling_spec.0.env_vars.MEGASTART_BLOCKLIST=comm_warmup",
        "++actor.scheduling_spec.0.env_vars.MEGASTART_AREAL_SKIP_HF_LOAD_ON_RECOVER=1",
    )
    for role in ("actor", "ref"):  # the experiment's ref spec is ${actor.scheduling_spec}
        assert out[role] == {
            "cmd": "python3 -m areal.infra.rpc.rpc_server",  # the user's, untouched
            "env": {
                "AUTOWRAPT_BOOTSTRAP": "megastart.bootstrap",
                "MEGASTART_BLOCKLIST": "comm_warmup",
                "MEGASTART_AREAL_SKIP_HF_LOAD_ON_RECOVER": "1",
            },
            "gpu": 2,  # the experiment's own spec, untouched
        }


def test_the_same_override_works_on_a_spec_without_env_vars(tmp_path):
    config = tmp_path / "experiment.yaml"
    with open(CONFIG) as f:
        config.write_text(f.read().replace("      env_vars: {}\n", ""))
    out = compose(tmp_path, ON, config=str(config))
    assert out["actor"]["env"] == {"AUTOWRAPT_BOOTSTRAP": "megastart.bootstrap"}
    assert out["actor"]["gpu"] == 2


def test_unknown_megastart_key_is_what_areal_refuses(tmp_path):
    with pytest.raises(AssertionError, match="megastart"):
        compose(tmp_path, "+megastart.enabled=true")


BOOTSTRAP = {"AUTOWRAPT_BOOTSTRAP": "megastart.bootstrap"}

WRAPPED_AFTER_IMPORT = """
    import json, sys, wrapt
    from areal_cpu import import_megatron_engine
    module = import_megatron_engine()
    print(json.dumps({
        "wrapped": sorted(n for n, v in vars(module.MegatronEngine).items()
                          if isinstance(v, wrapt.FunctionWrapper)),
        "megastart_imported": sorted(m for m in sys.modules if m.split(".")[0] == "megastart"),
    }))
"""


def test_variable_wraps_megatron_engine_when_its_import_returns():
    env = {"PYTHONPATH": python_path(), **BOOTSTRAP}
    out = json.loads(last_line(run_python(WRAPPED_AFTER_IMPORT, env=env).stdout))
    assert out["wrapped"] == sorted(name.split(".")[1] for name in ArealAdapter.wraps)


def test_without_the_variable_areal_imports_none_of_megastart():
    env = {"PYTHONPATH": python_path(), "AUTOWRAPT_BOOTSTRAP": ""}
    out = json.loads(last_line(run_python(WRAPPED_AFTER_IMPORT, env=env).stdout))
    assert out == {"wrapped": [], "megastart_imported": []}


RAY_SCHEDULER = """
    import json, ray
    from types import SimpleNamespace
    from ray.runtime_env import RuntimeEnv
    from areal.api.cli_args import SchedulingSpec
    from areal.infra.rpc.ray_rpc_server import RayRPCServer
    from areal.infra.scheduler.ray import RayScheduler

    def report(name, env_vars):
        # what RayScheduler._create_ray_workers does for each worker of a role
        spec = SchedulingSpec(cpu=1, gpu=0, env_vars=env_vars)
        env = RayScheduler._build_env_vars(SimpleNamespace(enable_tms_offload=False), spec)
        actor = RayRPCServer.options(
            name=name, num_cpus=1, runtime_env=RuntimeEnv(env_vars=env)
        ).remote()
        ray.get(actor.create_engine.remote("areal_ray_engine.ReportingEngine"))
        out = ray.get(actor.call.remote("report"))
        ray.kill(actor)
        return out

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        print("REPORT", json.dumps({
            "on": report("actor/0", {"AUTOWRAPT_BOOTSTRAP": "megastart.bootstrap",
                                     "MEGASTART_BLOCKLIST": "comm_warmup"}),
            "off": report("actor/1", {}),
        }))
    finally:
        ray.shutdown()
"""


def test_ray_actor_started_as_areals_ray_scheduler_starts_it_has_the_adapter_attached():
    proc = run_python(RAY_SCHEDULER, env={"PYTHONPATH": python_path(), "AUTOWRAPT_BOOTSTRAP": ""})
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    out = json.loads(line.removeprefix("REPORT "))
    assert out["on"]["bootstrap"] == "megastart.bootstrap"
    assert out["on"]["wrapped_when_imported"] == sorted(
        name.split(".")[1] for name in ArealAdapter.wraps
    )
    attached = out["on"]["attached"]
    assert attached["areal.engine.megatron_engine"] is True
    # and the library adapters of what AReaL's engine imports, beneath it
    assert attached["megatron.core.pipeline_parallel.schedules"] is True
    assert out["on"]["blocklist"] == ["comm_warmup"]
    assert out["off"]["wrapped_when_imported"] == [] and out["off"]["attached"] == {}


ATTACH = """
    import json, wrapt
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
    env = {"PYTHONPATH": python_path(), **BOOTSTRAP}
    out = json.loads(last_line(run_python(ATTACH, env=env).stdout))
    assert out["wrapped"] == out["names"] and len(out["names"]) == 8
    assert out["restored"] == out["names"]
    assert out["attached"]  # the adapter existed and is detached now


def test_incompatible_areal_version_is_refused_loudly(tmp_path):
    dist_info = tmp_path / "areal-0.9.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: areal\nVersion: 0.9.0\n")
    code = """
        import logging, sys; logging.basicConfig(level=logging.INFO)
        from areal_cpu import import_megatron_engine
        from megastart.engines import adapters
        module = import_megatron_engine()
        import wrapt
        print(adapters()["areal.engine.megatron_engine"].attached,
              isinstance(vars(module.MegatronEngine)["load"], wrapt.FunctionWrapper))
    """
    path = os.pathsep.join([str(tmp_path), python_path()])
    proc = run_python(code, env={"PYTHONPATH": path, **BOOTSTRAP})
    assert last_line(proc.stdout).split() == ["False", "False"]
    assert (
        "not attaching to areal.engine.megatron_engine: requested areal>=1.0.4,<2.1 "
        "but found areal 0.9.0" in proc.stderr
    )
