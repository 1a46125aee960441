"""Compose verl's own ``ppo_trainer`` config, the way ``verl.trainer.main_ppo`` does."""

from __future__ import annotations

from pathlib import Path

import verl
from omegaconf import DictConfig

VERL_CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"


def compose_ppo_trainer(*overrides: str) -> DictConfig:
    """verl's ``ppo_trainer`` config with ``overrides``, including the ``hydra`` node."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides), return_hydra_config=True)
