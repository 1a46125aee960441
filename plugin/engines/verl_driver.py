"""The verl driver adapter: a run's ``megastart:`` section reaches every Ray worker
when a script composes verl's config with Hydra's compose API and calls ``run_ppo``.

verl's ``run_ppo(config, ...)`` (``verl/trainer/main_ppo.py``, 0.7 to 0.9) starts
Ray with ``config.ray_kwargs.ray_init``, and Ray gives every worker that
``runtime_env``'s ``env_vars``. The adapter wraps ``run_ppo`` so that, before
Ray starts, the section is validated and written there as ``MEGASTART_*``
variables (:func:`megastart.engines.verl_config.export_to_ray_workers`): any
program that imports ``run_ppo`` needs nothing else. ``python -m
verl.trainer.main_ppo`` runs that module as ``__main__``, which no post-import
hook sees: there the Hydra callback of ``+megastart=on|off`` writes the section.
A config without a ``megastart`` section passes untouched.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import wrapt

from megastart.engines.base import EngineAdapter, argument, unwrap

log = logging.getLogger("megastart")


class VerlDriverAdapter(EngineAdapter):
    """Wraps verl's ``run_ppo`` in the driver (see the module docstring)."""

    host: ClassVar[str] = "verl"
    module: ClassVar[str] = "verl.trainer.main_ppo"
    requirement: ClassVar[str] = "verl>=0.7,<0.10"
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {"run_ppo": ("config",)}

    def _attach(self, module: ModuleType) -> None:
        self._run = wrapt.wrap_function_wrapper(module, "run_ppo", self._export_first)

    def _detach(self, module: ModuleType) -> None:
        unwrap(module, "run_ppo", self._run)

    def _export_first(self, wrapped: Callable[..., Any], _: Any, args: Any, kwargs: Any) -> Any:
        config = argument(wrapped, args, kwargs, 0)
        if "megastart" in config:
            # Hydra's Callback base class: imported where a driver runs, not in every worker
            from megastart.engines.verl_config import ENV_VARS, export_to_ray_workers

            export_to_ray_workers(config)
            ray = sys.modules.get("ray")
            if ray is not None and ray.is_initialized():
                log.warning(
                    "megastart: Ray was initialised before run_ppo, so %s does not reach "
                    "the workers; pass megastart's variables to your own ray.init",
                    ENV_VARS,
                )
        return wrapped(*args, **kwargs)
