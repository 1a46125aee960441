"""The verl adapter: megastart's hooks in verl's Megatron engine (verl 0.8 and later).

Attaches to ``verl.workers.engine.megatron.transformer_impl.MegatronEngine``,
the engine behind every Megatron actor, reference and critic worker:

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

``EngineContext.extra`` carries, for plugins that need them:

- ``"verl_engine"``: the ``MegatronEngine`` itself;
- ``"value_model"``: True for a critic, whose ``output_layer`` is a value head.

A critic's model is loaded by verl itself: its value head is not in the HF
checkpoint, and ``on_model_load`` promises every parameter filled, so the hook
is not called for it (one line on rank 0 says so). ``post_recover_load`` and
``pre_first_step`` run for critics as for actors.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, ClassVar

import wrapt

from megastart.engines.base import EngineAdapter
from megastart.manager import call_hook, get_settings
from megastart.records import EngineContext

log = logging.getLogger("megastart")

BRIDGE_LOADERS = {True: "load_weights", False: "load_hf_weights"}
"""``engine.vanilla_bridge`` -> the bridge method ``_build_megatron_module`` loads HF weights with."""


class VerlAdapter(EngineAdapter):
    """Attaches megastart's hooks to verl's ``MegatronEngine``."""

    host: ClassVar[str] = "verl"
    module: ClassVar[str] = "verl.workers.engine.megatron.transformer_impl"
    requirement: ClassVar[str] = "verl>=0.8,<0.10"
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {
        "MegatronEngine._build_megatron_module": (),
        "MegatronEngine.load_checkpoint": ("local_path",),
        "MegatronEngine.forward_backward_batch": (),
    }

    def __init__(self) -> None:
        super().__init__()
        self._first_step_seen = False

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
        # `import verl` sets the root logger to WARNING; the rank-0 summary lines
        # of megastart's hooks are INFO. A level the user set is kept.
        self._log_level = log.level
        log.setLevel(log.level or logging.INFO)

    def _detach(self, module: ModuleType) -> None:
        engine = module.MegatronEngine
        _unwrap(engine, "_build_megatron_module", self._build)
        _unwrap(engine, "load_checkpoint", self._load)
        _unwrap(engine, "forward_backward_batch", self._step)
        log.setLevel(self._log_level)

    # -- wrappers ------------------------------------------------------------

    def _around_build(
        self, wrapped: Callable[..., Any], engine: Any, args: Any, kwargs: Any
    ) -> Any:
        if engine.engine_config.use_dist_checkpointing:
            return wrapped(*args, **kwargs)
        if _is_value_model(engine):
            _log_rank0(
                "megastart: on_model_load is not called for verl's value model (critic): its "
                "value head is not in the HF checkpoint, and the hook must fill every parameter; "
                "verl's own loader runs"
            )
            return wrapped(*args, **kwargs)
        loader = BRIDGE_LOADERS[bool(engine.vanilla_bridge)]
        with _shadowed(engine.bridge, loader, self._bridge_loader(engine)):
            return wrapped(*args, **kwargs)

    def _bridge_loader(self, engine: Any) -> Callable[..., Any]:
        def load(wrapped: Callable[..., Any], _bridge: Any, args: Any, kwargs: Any) -> Any:
            model = _argument(wrapped, args, kwargs, 0)
            path = _argument(wrapped, args, kwargs, 1) or engine.model_config.local_path
            context = self._context(engine, model)
            if call_hook("on_model_load", engine=context, checkpoint=str(path)) is None:
                return wrapped(*args, **kwargs)
            return None

        return load

    def _after_recover_load(
        self, wrapped: Callable[..., Any], engine: Any, args: Any, kwargs: Any
    ) -> Any:
        result = wrapped(*args, **kwargs)
        checkpoint = _argument(wrapped, args, kwargs, 0)
        call_hook(
            "post_recover_load",
            engine=self._context(engine, is_restart=True),
            checkpoint=str(checkpoint),
        )
        return result

    def _before_first_step(
        self, wrapped: Callable[..., Any], engine: Any, args: Any, kwargs: Any
    ) -> Any:
        if not self._first_step_seen:
            self._first_step_seen = True
            call_hook("pre_first_step", engine=self._context(engine))
        return wrapped(*args, **kwargs)

    # -- the host-agnostic view ----------------------------------------------

    def _context(
        self,
        engine: Any,
        model: Any = None,
        *,
        is_restart: bool = False,
    ) -> EngineContext:
        from megatron.core import parallel_state
        from verl.utils.megatron_utils import unwrap_model

        chunks = unwrap_model(list(engine.module if model is None else model))
        return EngineContext(
            host=self.host,
            host_version=str(self.compatibility().installed_version),
            model_chunks=tuple(chunks),
            parallel_state=parallel_state,
            device=_training_device(),
            dtype=engine.param_dtype,
            hf_config=engine.model_config.hf_config,
            is_restart=is_restart,
            settings=get_settings(),
            extra={
                "verl_engine": engine,
                "value_model": _is_value_model(engine),
            },
        )


def _is_value_model(engine: Any) -> bool:
    """verl's own test; verl 0.8 sets ``engine.is_value_model`` only inside ``_build_megatron_module``."""
    return bool(engine.model_config.model_type == "value_model")


def _log_rank0(message: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(message)


def _training_device() -> Any:
    """The device the engine trains on, even while verl has offloaded the parameters."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _argument(function: Callable[..., Any], args: Any, kwargs: Any, position: int) -> Any:
    """The value of ``function``'s parameter at ``position``, passed by position or by name."""
    if len(args) > position:
        return args[position]
    name = list(inspect.signature(function).parameters)[position]
    return kwargs.get(name)


@contextmanager
def _shadowed(obj: Any, name: str, wrapper: Callable[..., Any]) -> Iterator[None]:
    """Wrap ``obj.name`` on this instance only, until the block ends."""
    had_own = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, wrapt.FunctionWrapper(original, wrapper))
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def _unwrap(owner: type, name: str, wrapper: Any) -> None:
    """Put back the function ``wrapper`` replaced; refuse if someone replaced it since.

    Already restored is fine, so ``detach`` can be retried after such a refusal.
    """
    current = vars(owner).get(name)
    if current is wrapper.__wrapped__:
        return
    if current is not wrapper:
        raise RuntimeError(
            f"megastart: cannot restore {owner.__qualname__}.{name}: it was replaced after "
            "megastart wrapped it; detach the later wrapper first"
        )
    setattr(owner, name, wrapper.__wrapped__)
