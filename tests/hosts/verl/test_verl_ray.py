"""A real ``@hydra.main`` app over verl's config runs verl's ``run_ppo``: the Ray
worker it starts has megastart attached to verl's engine, with the settings from
the command line, and still imports the user's own external modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verl_configs import ENV_VARS

HERE = Path(__file__).parent


def run_app(tmp_path: Path, *overrides: str) -> dict:
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGASTART_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["RAY_DEDUP_LOGS"] = "0"
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "ray_app.py"),
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


def test_ray_worker_of_a_megastart_run_has_the_adapter_and_the_settings(tmp_path):
    out = run_app(
        tmp_path,
        f"+{ENV_VARS}.VERL_USE_EXTERNAL_MODULES=verl_user_module",
        "+megastart=on",
        "megastart.blocklist=[comm_warmup]",
        "megastart.rank0_loader.bucket_mb=64",
    )
    assert out["external_modules"] == "verl_user_module,megastart.autoload"
    assert out["autoload_imported"] and out["user_module_imported"]
    assert out["attached"] == {"verl.workers.engine.megatron.transformer_impl": True}
    assert out["build_wrapped"]
    assert out["env"]["MEGASTART_BLOCKLIST"] == "comm_warmup"
    assert out["blocklist"] == ["comm_warmup"]
    assert "comm_warmup" not in out["plugins"] and "rank0_loader" in out["plugins"]
    assert out["bucket_mb"] == 64  # int or float, as the loader declares it
