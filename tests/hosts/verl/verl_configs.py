"""Compose verl's own ``ppo_trainer`` config, the way ``verl.trainer.main_ppo`` does;
start worker processes the way the installed verl's users activate megastart."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import verl
from omegaconf import DictConfig
from packaging.version import Version

VERL_CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"

HAS_PLUGIN_GROUP = Version(metadata.version("verl")) >= Version("0.9")
"""verl >= 0.9 loads ``verl.plugins`` at ``import verl``: installed = on."""

ACTIVATION = {} if HAS_PLUGIN_GROUP else {"AUTOWRAPT_BOOTSTRAP": "megastart.bootstrap"}
"""What a user puts in the workers' environment to activate megastart on this verl
(start rank pools inside ``pyrun.started_with(ACTIVATION)``)."""


def compose_ppo_trainer(*overrides: str) -> DictConfig:
    """verl's ``ppo_trainer`` config with ``overrides``, including the ``hydra`` node."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides), return_hydra_config=True)
