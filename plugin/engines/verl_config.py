"""``+megastart=on`` for verl: carry the activation and the settings to verl's Ray workers.

verl passes ``ray_kwargs.ray_init`` to ``ray.init`` (``verl/trainer/main_ppo.py``
``run_ppo``), and Ray gives every worker ``runtime_env.env_vars``. So the
activation (``VERL_USE_EXTERNAL_MODULES=...,megastart.autoload``: every
``import verl`` then imports :mod:`megastart.autoload`) and the ``megastart:``
settings (as ``MEGASTART_*`` variables) go there.

They must be plain strings when verl reads them: ``run_ppo`` merges that
section into its defaults and hands it to Ray without resolving
interpolations, so a resolver in the YAML would reach Ray as the literal text
``${...}``. They also depend on the final command line (``megastart.blocklist=
[comm_warmup]``, the user's own ``VERL_USE_EXTERNAL_MODULES``), which Hydra
applies after every config group. Hence a Hydra callback: ``on_run_start`` sees
the composed config, with the command line applied, before the task function
(verl's ``main``) runs, and writes the strings into it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from megastart.settings import ENV_PREFIX, Settings

AUTOLOAD = "megastart.autoload"
EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"


class ExportToRayWorkers(Callback):
    """Hydra callback installed by ``+megastart=on``: see :func:`export_to_ray_workers`."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        export_to_ray_workers(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra copies each job's config before any per-job callback runs, so
        # nothing could reach the workers: refuse rather than run without megastart.
        raise RuntimeError(
            "megastart: +megastart=on does not support Hydra multirun (-m): the settings "
            "cannot reach each job's Ray workers; run the jobs one by one"
        )


def export_to_ray_workers(config: DictConfig) -> dict[str, str]:
    """Validate ``config.megastart`` and write it, with the activation, into verl's Ray env vars.

    Call it yourself on a config composed with Hydra's compose API (the callback
    only runs under ``@hydra.main``).

    :returns: the variables written to ``ray_kwargs.ray_init.runtime_env.env_vars``.
    :raises megastart.settings.SettingsError: an unknown or invalid setting (the
        message lists the valid ones), before Ray starts.
    """
    from megastart.manager import configure

    section = OmegaConf.to_container(config.megastart, resolve=True)
    assert isinstance(section, dict)
    settings = configure(_without_nulls(section))
    env = settings_env(settings)
    env[EXTERNAL_MODULES] = ",".join(_with_autoload(config))
    with open_dict(config):
        for name, value in env.items():
            OmegaConf.update(config, f"{ENV_VARS}.{name}", value, force_add=True)
    return env


def settings_env(settings: Settings) -> dict[str, str]:
    """``MEGASTART_*`` variables that reproduce ``settings`` in another process.

    The core settings always; a plugin's setting only where it is not the
    default, so the variables name what the user chose.
    """
    env = {
        f"{ENV_PREFIX}{field.name.upper()}": _env_value(getattr(settings.core, field.name))
        for field in dataclasses.fields(settings.core)
    }
    for name, section in settings.sections.items():
        for field in dataclasses.fields(section):
            if settings.sources[f"{name}.{field.name}"] != "default":
                var = f"{ENV_PREFIX}{name.upper()}_{field.name.upper()}"
                env[var] = _env_value(getattr(section, field.name))
    return env


def _with_autoload(config: DictConfig) -> list[str]:
    """The user's external modules (from the config, else the launching shell) plus ours."""
    listed = OmegaConf.select(config, f"{ENV_VARS}.{EXTERNAL_MODULES}", default=None)
    if listed is None:
        listed = os.environ.get(EXTERNAL_MODULES, "")
    modules = [module.strip() for module in str(listed).split(",") if module.strip()]
    return modules if AUTOLOAD in modules else [*modules, AUTOLOAD]


def _without_nulls(section: Mapping[Any, Any]) -> dict[str, Any]:
    """The section without ``null`` values, which mean "the plugin's default"."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, Mapping):
            out[key] = _without_nulls(value)
        elif value is not None:
            out[key] = value
    return out


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(str(item) for item in value)
    return str(value)
