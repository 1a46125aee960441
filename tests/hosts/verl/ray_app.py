"""A Hydra app over verl's own ``ppo_trainer`` config that runs verl's ``run_ppo``
(``ray.init`` with ``ray_kwargs.ray_init``) with a TaskRunner that only reports what a
Ray worker of that run sees. Run as a script; ``probe_report=PATH`` names the output.
``--compose`` first: compose the config with Hydra's compose API instead of
``@hydra.main`` (no Hydra callback runs), as a script that drives verl does.
"""

from __future__ import annotations

import json
import sys

import hydra
import ray
from verl_configs import VERL_CONFIG_DIR


@ray.remote(num_cpus=1)
class ReportingTaskRunner:
    """Stands in for verl's TaskRunner: imports verl's Megatron engine and reports."""

    def run(self, config) -> None:
        import os
        import sys

        import verl.workers.engine.megatron.transformer_impl as transformer_impl

        from megastart.engines import adapters
        from megastart.manager import get_settings

        settings = get_settings()
        build = transformer_impl.MegatronEngine.__dict__["_build_megatron_module"]
        report = {
            "env": {k: v for k, v in os.environ.items() if k.startswith("MEGASTART_")},
            "external_modules": os.environ.get("VERL_USE_EXTERNAL_MODULES"),
            "bootstrap": os.environ.get("AUTOWRAPT_BOOTSTRAP"),
            "autoload_imported": "megastart.autoload" in sys.modules,
            "user_module_imported": "verl_user_module" in sys.modules,
            "attached": {name: adapter.attached for name, adapter in adapters().items()},
            "build_wrapped": hasattr(build, "__wrapped__"),
            "blocklist": list(settings.blocklist),
            "plugins": sorted(name for name, _ in settings.sections.items()),
            "bucket_mb": getattr(settings.sections.get("rank0_loader"), "bucket_mb", None),
        }
        with open(config.probe_report, "w") as f:
            json.dump(report, f)


def run(config) -> None:
    from verl.trainer.main_ppo import run_ppo

    try:
        run_ppo(config, task_runner_class=ReportingTaskRunner)
    finally:
        ray.shutdown()


@hydra.main(config_path=VERL_CONFIG_DIR, config_name="ppo_trainer", version_base=None)
def main(config) -> None:
    run(config)


def main_compose(overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        config = compose("ppo_trainer", overrides=overrides)
    run(config)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compose"]:
        main_compose([a for a in sys.argv[2:] if not a.startswith("hydra.")])
    else:
        main()
