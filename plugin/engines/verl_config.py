"""``+megastart=on|off`` for verl: carry the settings (and, where verl needs it, the
activation) to verl's Ray workers.

verl passes ``ray_kwargs.ray_init`` to ``ray.init`` (``verl/trainer/main_ppo.py``
``run_ppo``), and Ray gives every worker ``runtime_env.env_vars``. So the
``megastart:`` settings go there as ``MEGASTART_*`` variables, and, for a verl
without the plugin group ``verl.plugins`` (before 0.9), the activation
variable ``AUTOWRAPT_BOOTSTRAP=megastart.bootstrap``.

They must be plain strings when verl reads them: ``run_ppo`` merges that
section into its defaults and hands it to Ray without resolving
interpolations, so a resolver in the YAML would reach Ray as the literal text
``${...}``. They also depend on the final command line (``megastart.blocklist=
[comm_warmup]``), which Hydra applies after every config group. So they are
written into the composed config just before Ray starts: by this module's
Hydra callback, whose ``on_run_start`` sees the composed config before the task
function runs (any ``@hydra.main`` app over verl's config: ``python -m
verl.trainer.main_ppo``, the recipes), and by the verl driver adapter around
``run_ppo`` (:mod:`megastart.engines.verl_driver`: a script that composes the
config with the compose API, where no callback runs, and calls ``run_ppo``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from megastart.routes import (
    BOOTSTRAP_GROUP,
    BOOTSTRAP_VARIABLE,
    loads_megastart,
    plugin_group,
)
from megastart.settings import ENV_PREFIX, Settings

ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"

log = logging.getLogger("megastart")


class ExportToRayWorkers(Callback):
    """Hydra callback installed by ``+megastart=on|off``: see :func:`export_to_ray_workers`."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        export_to_ray_workers(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra copies each job's config before any per-job callback runs, so
        # nothing could reach the workers: refuse rather than run without megastart.
        raise RuntimeError(
            "megastart: +megastart=on|off does not support Hydra multirun (-m): the settings "
            "cannot reach each job's Ray workers; run the jobs one by one"
        )


def export_to_ray_workers(config: DictConfig) -> dict[str, str]:
    """Validate ``config.megastart`` and write it into verl's Ray env vars, with the
    activation variable where the installed verl has no plugin group (idempotent).

    ``run_ppo`` calls it (the verl driver adapter); call it yourself only when you
    start verl's Ray workers without ``run_ppo``.

    :returns: the variables written to ``ray_kwargs.ray_init.runtime_env.env_vars``.
    :raises megastart.settings.SettingsError: an unknown or invalid setting (the
        message lists the valid ones), before Ray starts.
    """
    from megastart.manager import configure

    section = OmegaConf.to_container(config.megastart, resolve=True)
    assert isinstance(section, dict)
    settings = configure(_without_nulls(section))
    env = settings_env(settings)
    if settings.enabled:
        group = plugin_group("verl")
        if group is None:
            env[BOOTSTRAP_VARIABLE] = ",".join(_with_bootstrap_group(config))
        elif not loads_megastart(group, _worker_env(config, group.filter_variable)):
            log.warning(
                "megastart: megastart.enabled is true, but %s=%s leaves megastart out of %s: "
                "verl will not load it in the workers; add megastart to that list",
                group.filter_variable,
                _worker_env(config, group.filter_variable),
                group.group,
            )
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


def _worker_env(config: DictConfig, name: str) -> str | None:
    """Variable ``name`` as the workers will see it: from the config, else the launching shell."""
    value = OmegaConf.select(config, f"{ENV_VARS}.{name}", default=None)
    return os.environ.get(name) if value is None else str(value)


def _with_bootstrap_group(config: DictConfig) -> list[str]:
    """The entry-point groups the user's ``AUTOWRAPT_BOOTSTRAP`` names, plus megastart's."""
    listed = _worker_env(config, BOOTSTRAP_VARIABLE) or ""
    groups = [group.strip() for group in listed.split(",") if group.strip()]
    return groups if BOOTSTRAP_GROUP in groups else [*groups, BOOTSTRAP_GROUP]


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
