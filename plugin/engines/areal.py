"""The AReaL adapter: megastart's hooks inside ``areal.engine.megatron_engine``.

Where each hook runs (AReaL 1.0.4 and 2.0.0):

- ``on_model_load`` replaces ``MegatronEngine._load_model_from_hf`` (called by
  ``initialize`` on every start, restarts included); ``None`` runs AReaL's own
  loader. A critic (``TrainEngineConfig.is_critic``: AReaL replaced its
  ``output_layer`` with a one-output ``ValueHead``) is a value model
  (``EngineContext.value_model``); after a plugin loaded it, the adapter does
  what AReaL's loader does last for a critic: where the checkpoint directory has
  AReaL's own ``value_head.pt`` (written by ``save_critic_value_head``), the last
  pipeline stage loads the head from it.
- ``post_recover_load`` right after ``MegatronEngine.load`` restored a recover
  checkpoint (``RecoverHandler._load_checkpoint``: DCP format, a
  ``recover_checkpoint`` directory), before ``update_weights``. In AReaL builds
  whose ``RecoverHandler.load`` has the colocated protocol, that load comes after
  the rollout's pause and offload; in 1.0.4 the colocated offload happens later,
  in ``PPOTrainer._apply_initial_offload_policy`` (see docs/hosts/areal.md for what to
  set there).
- ``pre_first_step`` before the first ``train_batch`` / ``forward_batch`` /
  ``eval_batch``: ``compute_logp`` and ``ppo_update`` (and SFT, reward and DPO
  training) reach the Megatron step only through these.

Restarts (:mod:`megastart.restart`): ``initialize`` of a trainable actor (an optimizer, no
LoRA, not a critic) defers its HF load while ``rank0_loader.skip_hf_load_on_resume`` is on.
A recover load (``MegatronEngine.load`` of the ``recover_checkpoint``) then replaces it, once
every rank checked that it restored every parameter; without optimizer state
(``recover.no_load_optim``) the optimizer's main parameters are refreshed from the model.
Anything else first (``train_batch``, ``forward_batch``, ``eval_batch``, ``save``,
``update_weights``, ``offload``, another ``load``) runs the deferred load before it, and
refreshes the main parameters the optimizer built in ``initialize`` from random weights.
A worker does not see AReaL's recover info (its ``fileroot`` is the controller's), so a fresh
start defers too and loads at its first such call.

Every hook is collective, and AReaL's schedulers retry failed RPCs (Ray on a
timeout, Slurm and local on an HTTP 500 saying "timeout"). After a hook failed,
every later megastart hook in the process raises
:class:`~megastart.distributed.FailedBefore` instead of issuing collectives that
the other ranks, which did not retry, never join: each wrapper consults the
process's one latch (:data:`megastart.distributed.sticky.LATCH`) before AReaL's
own collectives run. Each wrapper answers its event for the duration of AReaL's
call, so the library adapters underneath (Megatron-Bridge's loader when
``bridge_cls`` is ``megatron-bridge``, megatron-core's schedules) pass through.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import wrapt

from megastart.distributed.sticky import LATCH
from megastart.engines.base import (
    EngineAdapter,
    answering,
    argument,
    before_first_step,
    hook,
    unwrap,
    unwrap_chunks,
)
from megastart.records import EngineContext
from megastart.restart import DEFERRALS, Deferred, skip_wanted

log = logging.getLogger("megastart")

Wrapped = Callable[..., Any]
"""The host method a wrapt wrapper receives (bound: ``self`` is ``instance``)."""

_DEQUANTISES = {"mbridge": frozenset({"fp8"})}
"""What AReaL's own HF loader dequantises, by ``MegatronEngine.bridge_cls``: its default
(``load_weights_from_hf_with_mbridge_fast``) dequantises FP8 block-scaled weights
(``weight_scale_inv``); Megatron-Bridge's bridges of the architectures megastart serves do not."""


@dataclass(kw_only=True, slots=True)
class ArealSettings:
    """Settings of the AReaL adapter (section ``areal``, variables ``MEGASTART_AREAL_*``)."""

    skip_hf_load_on_recover: bool = False
    """Deprecated (goes in the next release): ``rank0_loader.skip_hf_load_on_resume``
    (``MEGASTART_RANK0_LOADER_SKIP_HF_LOAD_ON_RESUME``, on by default) replaces it. Given
    alone it is honoured, with one warning; given with the new setting and disagreeing,
    the load is refused naming both."""


class ArealAdapter(EngineAdapter):
    """Attaches megastart's hooks to AReaL's ``MegatronEngine`` (see the module docstring).

    One instance per process (the adapter registry holds it); the state it keeps is
    per engine (deferred HF loads, restarted engines).
    """

    host: ClassVar[str] = "areal"
    module: ClassVar[str] = "areal.engine.megatron_engine"
    requirement: ClassVar[str] = "areal>=1.0.4,<2.1"
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {
        "MegatronEngine._load_model_from_hf": ("self", "path"),
        "MegatronEngine.load": ("self", "meta"),
        "MegatronEngine.train_batch": ("self", "input_"),
        "MegatronEngine.forward_batch": ("self", "input_"),
        "MegatronEngine.eval_batch": ("self", "input_"),
        "MegatronEngine.save": ("self", "meta"),
        "MegatronEngine.update_weights": ("self", "meta"),
        "MegatronEngine.offload": ("self",),
    }
    megastart_settings: ClassVar[type[ArealSettings]] = ArealSettings

    def __init__(self) -> None:
        super().__init__()
        self._restarted: weakref.WeakSet[Any] = weakref.WeakSet()
        self._wrappers: dict[str, Any] = {}

    def _attach(self, module: ModuleType) -> None:
        engine = module.MegatronEngine
        around: dict[str, Callable[[Wrapped, Any, Any, Any], Any]] = {
            "_load_model_from_hf": self._load_hf,
            "load": self._load,
            "train_batch": self._step,
            "forward_batch": self._step,
            "eval_batch": self._step,
            "save": self._uses_weights,
            "update_weights": self._uses_weights,
            "offload": self._uses_weights,
        }
        self._wrappers = {
            name: wrapt.wrap_function_wrapper(engine, name, wrapper)
            for name, wrapper in around.items()
        }

    def _detach(self, module: ModuleType) -> None:
        engine = module.MegatronEngine
        for name, wrapper in self._wrappers.items():
            unwrap(engine, name, wrapper)

    # -- wrappers: (wrapped, instance, args, kwargs) -------------------------

    def _load_hf(self, wrapped: Wrapped, instance: Any, args: Any, kwargs: Any) -> Any:
        path = argument(wrapped, args, kwargs, 0)
        LATCH.refuse_if_failed("on_model_load")
        if not instance.initialized and defers(instance) and skip_wanted():
            DEFERRALS.defer(instance, self._deferred(instance, path))
            return None
        with answering("on_model_load"):
            report = hook("on_model_load", engine=self.context(instance), checkpoint=path)
            if report is None:
                return wrapped(*args, **kwargs)
        if instance.config.is_critic:
            load_saved_value_head(instance, path)
        return None

    def _load(self, wrapped: Wrapped, instance: Any, args: Any, kwargs: Any) -> Any:
        meta = argument(wrapped, args, kwargs, 0)
        recover = is_recover_load(meta)
        if recover:
            LATCH.refuse_if_failed("post_recover_load")
            wait_for_saves(instance)  # AReaL 2.0's load waits first: before megastart's collectives
        else:
            DEFERRALS.run(instance, before="MegatronEngine.load")
        resuming = DEFERRALS.resuming(
            instance, str(meta.path) if recover else "", restores_optimizer=bool(meta.with_optim)
        )
        with (
            resuming if recover else nullcontext(),
            answering("post_recover_load", "on_model_load"),  # weights a resume reads are its own
        ):
            result = wrapped(*args, **kwargs)
        if recover:
            self._restarted.add(instance)
            context = self.context(instance, is_restart=True)
            hook("post_recover_load", engine=context, checkpoint=meta.path)
        return result

    def _step(self, wrapped: Wrapped, instance: Any, args: Any, kwargs: Any) -> Any:
        LATCH.refuse_if_failed("pre_first_step")
        DEFERRALS.run(instance, before=f"MegatronEngine.{wrapped.__name__}")
        with answering("pre_first_step"):
            before_first_step(
                lambda: hook(
                    "pre_first_step",
                    engine=self.context(instance, is_restart=instance in self._restarted),
                )
            )
            return wrapped(*args, **kwargs)

    def _uses_weights(self, wrapped: Wrapped, instance: Any, args: Any, kwargs: Any) -> Any:
        DEFERRALS.run(instance, before=f"MegatronEngine.{wrapped.__name__}")
        return wrapped(*args, **kwargs)

    # -- helpers --------------------------------------------------------------

    def context(self, engine: Any, *, is_restart: bool = False) -> EngineContext:
        """The ``EngineContext`` of one AReaL ``MegatronEngine``."""
        from megatron.core import parallel_state

        bridge_cls = str(getattr(engine, "bridge_cls", ""))
        return self.engine_context(
            model_chunks=unwrap_chunks(list(engine.model)),
            parallel_state=parallel_state,
            device=engine.device if engine.device is not None else "cpu",
            dtype=engine.dtype,
            hf_config=getattr(engine, "hf_config", None),
            is_restart=is_restart,
            value_model=bool(engine.config.is_critic),
            host_dequantises=_DEQUANTISES.get(bridge_cls, frozenset()),
            hf_bridge=engine.bridge if bridge_cls == "megatron-bridge" else None,
            ddp_config=getattr(engine.model[0], "ddp_config", None),
            extra={"areal_engine": engine},
        )

    def _deferred(self, engine: Any, path: str) -> Deferred:
        """The HF load ``initialize`` puts off: the wrapped ``_load_model_from_hf`` (through
        ``on_model_load``), under the engine's device as ``initialize`` runs it."""
        from megastart.loader.settings import resolved

        def load() -> None:
            with engine.device:
                engine._load_model_from_hf(path)

        def refresh() -> None:  # initialize built the optimizer from the unloaded weights
            if engine.optimizer is not None:
                engine.optimizer.reload_model_params()

        return Deferred(
            host=self.host,
            checkpoint=path,
            load=load,
            chunks=lambda: unwrap_chunks(list(engine.model)),
            refresh=refresh,
            timeout_s=resolved().timeout_s,
        )


def defers(engine: Any) -> bool:
    """Whether a recover load can follow this engine's HF load: a trainable actor (its config
    has an optimizer), not a critic or a reference (no recover load follows) and not LoRA
    (its recover checkpoint holds the adapter only)."""
    config = engine.config
    trainable = getattr(config, "optimizer", None) is not None
    return trainable and not config.is_critic and not getattr(config, "use_lora", False)


def wait_for_saves(engine: Any) -> None:
    """AReaL 2.0's ``MegatronCheckpointManager.load_checkpoint`` first waits for pending
    asynchronous saves (a collective); wait here, so that megastart's collectives of the
    recover load come after it on every rank, in AReaL's order."""
    wait = getattr(getattr(engine, "checkpointer", None), "wait_async_saves", None)
    if wait is not None:
        wait()


def is_recover_load(meta: Any) -> bool:
    """Whether ``MegatronEngine.load(meta)`` restores a recover checkpoint.

    ``RecoverHandler._load_checkpoint`` loads DCP from
    ``Saver.get_recover_checkpoint_path(...)``, a directory named
    ``recover_checkpoint``.
    """
    path = os.path.normpath(str(meta.path))
    return meta.weight_format == "dcp" and os.path.basename(path) == "recover_checkpoint"


VALUE_HEAD_FILE = "value_head.pt"
"""Where AReaL 1.0.4 keeps a critic's value head next to its HF weights
(``areal.models.mcore.hf_save.save_critic_value_head``)."""


def load_saved_value_head(engine: Any, path: str) -> None:
    """Load the critic's value head from AReaL's ``value_head.pt`` in ``path``, if there is one.

    The same as the end of AReaL's ``load_weights_from_hf_with_mbridge_fast`` for a
    critic: on the last pipeline stage, ``torch.load(weights_only=True)`` of the head's
    state dict (a few KB) into each chunk's ``output_layer``; no collective. Without
    the file the head stays as the plugin left it (from a reward head, or AReaL's
    initialisation).
    """
    import torch
    from megatron.core import parallel_state

    saved = os.path.join(path, VALUE_HEAD_FILE)
    if not parallel_state.is_pipeline_last_stage() or not os.path.exists(saved):
        return
    state = torch.load(saved, weights_only=True)
    for model in unwrap_chunks(list(engine.model)):
        if hasattr(model, "output_layer"):
            model.output_layer.load_state_dict(state)
    log.info("megastart: loaded the critic's value head from %s, as AReaL does", saved)
