"""The verl adapter: megastart's hooks in verl's Megatron engine (verl 0.7 to 0.9).

Attaches to ``verl.workers.engine.megatron.transformer_impl.MegatronEngine``,
the engine behind every Megatron actor, reference and critic worker of verl 0.8
and later, and behind verl 0.7's actor and reference workers when a run sets
``trainer.use_legacy_worker_impl=disable`` (verl 0.7's default workers are the
legacy ones: see :mod:`megastart.engines.verl_legacy`):

- ``on_model_load``: the HF weight load inside ``_build_megatron_module``;
- ``post_recover_load``: right after ``load_checkpoint`` (resume);
- ``pre_first_step``: before the first ``forward_backward_batch`` of the
  process, which both ``train_batch`` and ``infer_batch`` (the first
  ``compute_log_prob``) go through, so the communicators are connected before
  any step uses them.

Where ``on_model_load`` intercepts, and why there: ``_build_megatron_module``
builds the model with ``make_megatron_module`` and then calls its bridge,
``self.bridge.load_weights(module, path)`` (mbridge, ``vanilla_mbridge``) or
``self.bridge.load_hf_weights(module, path, ...)`` (Megatron-Bridge, verl's
default). That call is the one place where both the built model and the
checkpoint path exist and nothing else happens. So, for the duration of
``_build_megatron_module`` only, the adapter shadows that one method on this
engine's bridge *instance* and removes the shadow afterwards. Nothing else
verl does with its bridge (weight export to the rollout engine, checkpoint
saving) and no other engine is affected, no bridge library is imported, and the
surrounding verl code (DDP wrapping, PEFT, routing replay, printing) runs
unchanged. Runs with ``use_dist_checkpointing`` load a Megatron checkpoint, not
HF weights, and are left alone.

``EngineContext.extra`` carries ``"verl_engine"``: the ``MegatronEngine`` itself.

A critic (``MegatronEngineWithValueHead``) is loaded through ``on_model_load``
too, with ``EngineContext.value_model`` set: verl has built its value head
(``LinearForLastLayer``, one output, embeddings untied), and a plugin loads the
backbone and either reads the head from the checkpoint's reward head or leaves
it as verl initialised it (verl's own loaders keep it too, unless the checkpoint
holds a one-row ``lm_head.weight``). Which engine holds a value model is verl's
own decision, ``engine.is_value_model``, which every verl from 0.7 to 0.9 sets
before it loads (0.7 from the architecture's name, later versions from
``model_type``). ``post_recover_load`` and ``pre_first_step`` run for critics as
for actors.
"""

from __future__ import annotations

from collections.abc import Callable
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


class VerlAdapter(EngineAdapter):
    """Attaches megastart's hooks to verl's ``MegatronEngine``."""

    host: ClassVar[str] = "verl"
    module: ClassVar[str] = "verl.workers.engine.megatron.transformer_impl"
    requirement: ClassVar[str] = "verl>=0.7,<0.10"
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {
        "MegatronEngine._build_megatron_module": (),
        "MegatronEngine.load_checkpoint": ("local_path",),
        "MegatronEngine.forward_backward_batch": (),
    }

    def _attach(self, module: ModuleType) -> None:
        engine = module.MegatronEngine
        self._build = wrapt.wrap_function_wrapper(
            engine, "_build_megatron_module", self._around_build
        )
        self._load = wrapt.wrap_function_wrapper(
            engine, "load_checkpoint", self._after_recover_load
        )
        self._step = wrapt.wrap_function_wrapper(
            engine, "forward_backward_batch", self._before_first_step
        )
        show_summaries()

    def _detach(self, module: ModuleType) -> None:
        engine = module.MegatronEngine
        unwrap(engine, "_build_megatron_module", self._build)
        unwrap(engine, "load_checkpoint", self._load)
        unwrap(engine, "forward_backward_batch", self._step)
        restore_log_level()

    # -- wrappers ------------------------------------------------------------

    def _around_build(
        self, wrapped: Callable[..., Any], engine: Any, args: Any, kwargs: Any
    ) -> Any:
        with answering("on_model_load"):  # this adapter answers whatever the build loads
            if engine.engine_config.use_dist_checkpointing:
                return wrapped(*args, **kwargs)
            loader = BRIDGE_LOADERS[bool(engine.vanilla_bridge)]
            with shadowed(engine.bridge, loader, self._bridge_loader(engine)):
                return wrapped(*args, **kwargs)

    def _bridge_loader(self, engine: Any) -> Callable[..., Any]:
        def load(wrapped: Callable[..., Any], _bridge: Any, args: Any, kwargs: Any) -> Any:
            return load_through_hook(
                wrapped,
                args,
                kwargs,
                context=partial(self._context, engine),
                model_at=0,
                checkpoint=argument(wrapped, args, kwargs, 1) or engine.model_config.local_path,
            )

        return load

    def _after_recover_load(
        self, wrapped: Callable[..., Any], engine: Any, args: Any, kwargs: Any
    ) -> Any:
        with answering("post_recover_load", "on_model_load"):  # weights a resume reads are its own
            result = wrapped(*args, **kwargs)
        checkpoint = argument(wrapped, args, kwargs, 0)
        hook(
            "post_recover_load",
            engine=self._context(engine, is_restart=True),
            checkpoint=str(checkpoint),
        )
        return result

    def _before_first_step(
        self, wrapped: Callable[..., Any], engine: Any, args: Any, kwargs: Any
    ) -> Any:
        with answering("pre_first_step"):
            before_first_step(lambda: hook("pre_first_step", engine=self._context(engine)))
            return wrapped(*args, **kwargs)

    # -- the host-agnostic view ----------------------------------------------

    def _context(
        self, engine: Any, model: Any = None, *, is_restart: bool = False
    ) -> EngineContext:
        return verl_context(
            self,
            engine.module if model is None else model,
            dtype=engine.param_dtype,
            hf_config=engine.model_config.hf_config,
            is_restart=is_restart,
            value_model=bool(engine.is_value_model),  # set by verl before it loads (0.7-0.9)
            # Megatron-Bridge's registry decides its branch's mapping (mbridge's: the tables)
            hf_bridge=None if engine.vanilla_bridge else engine.bridge,
            extra={"verl_engine": engine},
        )
