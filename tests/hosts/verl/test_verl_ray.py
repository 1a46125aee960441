"""A real ``@hydra.main`` app over verl's config (and a script that composes it with
Hydra's compose API) runs verl's ``run_ppo``: the Ray worker it starts has megastart
attached to verl's engine with the settings from the command line, or nothing
attached with ``+megastart=off``, and still imports the user's own external modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verl_configs import ENV_VARS

HERE = Path(__file__).parent


def run_app(tmp_path: Path, *overrides: str, compose: bool = False) -> dict:
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGASTART_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["RAY_DEDUP_LOGS"] = "0"
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "ray_app.py"),
            *(["--compose"] if compose else []),
            "model_engine=megatron",
            "ray_kwargs.ray_init.num_cpus=1",
            "+ray_kwargs.ray_init.include_dashboard=false",
            f"+probe_report={report}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
            *overrides,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return json.loads(report.read_text())


SETTINGS = (
    "+megastart=on",
    "megastart.blocklist=[comm_warmup]",
    "megastart.rank0_loader.bucket_mb=64",
)


def check_settings_resolved(out: dict) -> None:
    assert out["attached"]["verl.workers.engine.megatron.transformer_impl"] is True
    assert out["build_wrapped"]
    assert out["env"]["MEGASTART_BLOCKLIST"] == "comm_warmup"
    assert out["blocklist"] == ["comm_warmup"]
    assert "comm_warmup" not in out["plugins"] and "rank0_loader" in out["plugins"]
    assert out["bucket_mb"] == 64  # int or float, as the loader declares it


def test_ray_worker_of_a_hydra_main_run_resolves_the_settings_overrides(tmp_path):
    out = run_app(tmp_path, f"+{ENV_VARS}.VERL_USE_EXTERNAL_MODULES=verl_user_module", *SETTINGS)
    check_settings_resolved(out)
    assert out["autoload_imported"]  # through verl.plugins: no variable
    assert out["bootstrap"] is None
    assert out["external_modules"] == "verl_user_module" and out["user_module_imported"]


def test_ray_worker_of_a_composed_run_resolves_the_settings_overrides(tmp_path):
    check_settings_resolved(run_app(tmp_path, *SETTINGS, compose=True))


def test_ray_worker_of_a_megastart_off_run_has_nothing_attached(tmp_path):
    out = run_app(tmp_path, "+megastart=off")
    assert out["env"]["MEGASTART_ENABLED"] == "false"
    assert out["attached"] == {} and not out["build_wrapped"]
