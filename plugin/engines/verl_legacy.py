"""The verl adapter for verl 0.7's legacy Megatron workers (``verl.workers.megatron_workers``).

verl 0.7 trains Megatron models in these workers unless a run sets
``trainer.use_legacy_worker_impl=disable`` (then its actor and reference run on
the engine: :mod:`megastart.engines.verl`), and always for a Megatron critic.
verl 0.8 removed them.

- ``on_model_load``: the HF load in ``ActorRolloutRefWorker._build_model_optimizer``
  (actor and reference) and ``CriticWorker._build_critic_model_optimizer``
  (critic, a value model): verl's legacy loader ``load_megatron_gptmodel_weights``
  (``use_mbridge=false``: rank 0 reads the whole model with ``from_pretrained``
  and broadcasts it), or the bridge's loader (mbridge's ``load_weights``, verl
  0.7's default, or Megatron-Bridge's ``load_hf_weights``). ``None`` falls
  through to that loader.
- ``post_recover_load``: after ``ActorRolloutRefWorker.load_checkpoint`` or
  ``CriticWorker.load_checkpoint`` restored a checkpoint (not when verl calls
  them without one, which only offloads the model).
- ``pre_first_step``: before the first of the workers' Megatron steps in the
  process (``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``,
  ``compute_values``, ``update_critic``), at the worker method's entry: before
  verl moves offloaded parameters back to the GPU.

Where ``on_model_load`` intercepts: the build method makes this worker's bridge
(``_init_hf_config_and_tf_config``), builds the model, then loads it. For the
duration of the build only, the adapter shadows the loader the build calls: the
module's ``load_megatron_gptmodel_weights``, and, once
``_init_hf_config_and_tf_config`` has made the bridge, the bridge's loader on
that instance. The checkpoint manager's later use of the same bridge (HF-format
checkpoints) is untouched. Runs with ``use_dist_checkpointing`` call neither
loader and are left alone.

The wrapped worker methods carry verl's ``@register`` attributes through
(``wrapt`` proxies attribute access to the original), so verl's worker groups
bind and dispatch them as before.

``EngineContext.extra`` carries ``"verl_worker"`` (the worker).
``EngineContext.value_model`` is set for the ``CriticWorker``, whose model verl
builds with a one-output value head (``LinearForLastLayer``) and untied
embeddings; verl's own loaders read that head from a reward head of its shape
(``lm_head.weight``, ``reward_head.weight``, ``score.weight``; mbridge only the
first), as megastart's ``rank0_loader`` does, and otherwise leave it as built.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from types import ModuleType
from typing import Any, ClassVar

import wrapt

from megastart.engines.base import (
    EngineAdapter,
    answering,
    argument,
    before_first_step,
    hook,
    load_through_hook,
    unwrap,
)
from megastart.engines.verl_common import (
    BRIDGE_LOADERS,
    restore_log_level,
    shadowed,
    show_summaries,
    verl_context,
)
from megastart.records import EngineContext

BUILDS = (
    "ActorRolloutRefWorker._build_model_optimizer",
    "CriticWorker._build_critic_model_optimizer",
)
RECOVER_LOADS = ("ActorRolloutRefWorker.load_checkpoint", "CriticWorker.load_checkpoint")
FIRST_STEPS = (
    "ActorRolloutRefWorker.compute_log_prob",
    "ActorRolloutRefWorker.compute_ref_log_prob",
    "ActorRolloutRefWorker.update_actor",
    "CriticWorker.compute_values",
    "CriticWorker.update_critic",
)
LEGACY_LOADER = "load_megatron_gptmodel_weights"
MAKES_BRIDGE = "_init_hf_config_and_tf_config"


class VerlLegacyAdapter(EngineAdapter):
    """Attaches megastart's hooks to verl 0.7's ``ActorRolloutRefWorker`` and ``CriticWorker``."""

    host: ClassVar[str] = "verl"
    module: ClassVar[str] = "verl.workers.megatron_workers"
    requirement: ClassVar[str] = "verl>=0.7,<0.8"
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {
        **dict.fromkeys(BUILDS, ()),
        f"MegatronWorker.{MAKES_BRIDGE}": (),
        LEGACY_LOADER: (),
        **dict.fromkeys(RECOVER_LOADS, ("checkpoint_path",)),
        **dict.fromkeys(FIRST_STEPS, ()),
    }

    def _attach(self, module: ModuleType) -> None:
        self._workers = module
        self._wrappers = {
            **{
                name: wrapt.wrap_function_wrapper(module, name, self._around_build)
                for name in BUILDS
            },
            **{
                name: wrapt.wrap_function_wrapper(module, name, self._after_recover_load)
                for name in RECOVER_LOADS
            },
            **{
                name: wrapt.wrap_function_wrapper(module, name, self._before_first_step)
                for name in FIRST_STEPS
            },
        }
        show_summaries()

    def _detach(self, module: ModuleType) -> None:
        for name, wrapper in self._wrappers.items():
            owner, method = name.split(".")
            unwrap(getattr(module, owner), method, wrapper)
        restore_log_level()

    # -- wrappers ------------------------------------------------------------

    def _around_build(
        self, wrapped: Callable[..., Any], worker: Any, args: Any, kwargs: Any
    ) -> Any:
        with ExitStack() as build, answering("on_model_load"):

            def after_bridge_made(make: Callable[..., Any], _: Any, a: Any, k: Any) -> Any:
                result = make(*a, **k)
                if worker.bridge is not None:
                    loader = BRIDGE_LOADERS[bool(worker.vanilla_bridge)]
                    bridge_loader = self._through_hook(worker, model_at=0, path_at=1)
                    build.enter_context(shadowed(worker.bridge, loader, bridge_loader))
                return result

            legacy_loader = self._through_hook(worker, model_at=2, path_at=None)
            build.enter_context(shadowed(self._workers, LEGACY_LOADER, legacy_loader))
            build.enter_context(shadowed(worker, MAKES_BRIDGE, after_bridge_made))
            return wrapped(*args, **kwargs)

    def _through_hook(
        self, worker: Any, *, model_at: int, path_at: int | None
    ) -> Callable[..., Any]:
        """A loader wrapper: ``on_model_load`` first, the loader itself if no plugin handled it.

        :param model_at: the loader's parameter that holds the model chunks.
        :param path_at: the one that holds the checkpoint directory (``None``: the
            loader reads ``config.model.path``, which the worker copied to ``local_path``).
        """

        def load(wrapped: Callable[..., Any], _: Any, args: Any, kwargs: Any) -> Any:
            return load_through_hook(
                wrapped,
                args,
                kwargs,
                context=partial(self._context, worker),
                model_at=model_at,
                checkpoint=worker.local_path
                if path_at is None
                else argument(wrapped, args, kwargs, path_at),
            )

        return load

    def _after_recover_load(
        self, wrapped: Callable[..., Any], worker: Any, args: Any, kwargs: Any
    ) -> Any:
        with answering("post_recover_load", "on_model_load"):  # weights a resume reads are its own
            result = wrapped(*args, **kwargs)
        checkpoint = argument(wrapped, args, kwargs, 0)
        if checkpoint is not None:
            hook(
                "post_recover_load",
                engine=self._context(worker, _trained_model(worker), is_restart=True),
                checkpoint=str(checkpoint),
            )
        return result

    def _before_first_step(
        self, wrapped: Callable[..., Any], worker: Any, args: Any, kwargs: Any
    ) -> Any:
        with answering("pre_first_step"):
            before_first_step(
                lambda: hook("pre_first_step", engine=self._context(worker, _trained_model(worker)))
            )
            return wrapped(*args, **kwargs)

    # -- the host-agnostic view ----------------------------------------------

    def _context(self, worker: Any, model: Any, *, is_restart: bool = False) -> EngineContext:
        return verl_context(
            self,
            model,
            dtype=worker.dtype,
            hf_config=worker.hf_config,
            is_restart=is_restart,
            value_model=self._is_critic(worker),
            extra={"verl_worker": worker},
        )

    def _is_critic(self, worker: Any) -> bool:
        return isinstance(worker, self._workers.CriticWorker)


def _trained_model(worker: Any) -> Any:
    """The model chunks of this worker: an actor's, a reference's or a critic's."""
    for name in ("actor_module", "critic_module", "ref_module"):
        if hasattr(worker, name):
            return getattr(worker, name)
    raise RuntimeError(
        f"megastart: verl's {type(worker).__name__} has no model yet (actor_module, "
        "critic_module or ref_module); call init_model first"
    )
