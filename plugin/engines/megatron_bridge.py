"""The Megatron-Bridge adapters: ``on_model_load`` in its HF loader, ``post_recover_load``
after its training loop's resume.

- ``MegatronModelBridge.load_weights_hf_to_megatron(hf_pretrained, megatron_model)``,
  in ``megatron.bridge.models.conversion.model_bridge``: the one loader behind
  ``AutoBridge.load_hf_weights`` and behind ``to_megatron_provider(load_weights=True)``
  (a pre-wrap hook of the provider, bound when the provider is made: so NeMo-RL's
  ``provide_distributed_model`` reaches it). The checkpoint directory is the
  bridge's ``hf_pretrained.model_name_or_path``; the bridge's own registry
  (``mapping_registry()``) decides which tensor fills which parameter, as
  ``megastart architectures`` reports. A load with ``allowed_mismatched_params``, a
  source that is not a local directory, or a process without a process group is left
  to the bridge.
- ``load_checkpoint(state, model, ...)`` in ``megatron.bridge.training.checkpointing``:
  ``post_recover_load`` when it returns an iteration past zero (a resume; a
  fine-tune start or a conversion returns zero).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import wrapt

from megastart.engines.base import argument, unwrap
from megastart.engines.library import LibraryAdapter, RecoverLoadAdapter

REQUIREMENT = "megatron-bridge>=0.4,<0.7"
"""Megatron-Bridge releases read: 0.4.0 (AReaL 1.0.4's; the same two signatures) and 0.5.1
(tested: the nearest on the index to verl 0.9.1's 0.5.2)."""

SERVES = (
    "NeMo-RL (AutoBridge.to_megatron_provider(load_weights=True), load_checkpoint)",
    "verl 0.9 default branch and AReaL bridge_cls=megatron-bridge (their host adapters answer)",
    "any script calling AutoBridge.load_hf_weights",
)


class MegatronBridgeAdapter(LibraryAdapter):
    """``on_model_load`` around Megatron-Bridge's HF loader."""

    host: ClassVar[str] = "megatron-bridge"
    module: ClassVar[str] = "megatron.bridge.models.conversion.model_bridge"
    requirement: ClassVar[str] = REQUIREMENT
    serves: ClassVar[tuple[str, ...]] = SERVES
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {
        "MegatronModelBridge.load_weights_hf_to_megatron": (
            "hf_pretrained",
            "megatron_model",
            "allowed_mismatched_params",
        ),
    }

    def _attach(self, module: Any) -> None:
        self._load = wrapt.wrap_function_wrapper(
            module, "MegatronModelBridge.load_weights_hf_to_megatron", self._around_load
        )

    def _detach(self, module: Any) -> None:
        unwrap(module.MegatronModelBridge, "load_weights_hf_to_megatron", self._load)

    def _around_load(self, wrapped: Callable[..., Any], bridge: Any, args: Any, kwargs: Any) -> Any:
        if argument(wrapped, args, kwargs, 2):
            return wrapped(*args, **kwargs)  # allowed_mismatched_params: the bridge's own load
        hf_pretrained = argument(wrapped, args, kwargs, 0)
        return self.load_if_served(
            wrapped,
            args,
            kwargs,
            getattr(hf_pretrained, "model_name_or_path", None),
            context=partial(self._context, bridge, hf_pretrained),
            model_at=1,
            loaded=lambda model: model if isinstance(model, list) else [model],
        )

    def _context(self, bridge: Any, hf_pretrained: Any, model: Any) -> Any:
        hf_config = getattr(hf_pretrained, "config", None)
        return self.model_context(model, hf_config=hf_config, hf_bridge=bridge)


class MegatronBridgeCheckpointAdapter(RecoverLoadAdapter):
    """``post_recover_load`` after Megatron-Bridge's ``load_checkpoint`` resumed training."""

    host: ClassVar[str] = "megatron-bridge"
    module: ClassVar[str] = "megatron.bridge.training.checkpointing"
    requirement: ClassVar[str] = REQUIREMENT
    serves: ClassVar[tuple[str, ...]] = SERVES[:1]
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {"load_checkpoint": ("state", "model")}

    def _resumed(self, wrapped: Callable[..., Any], args: Any, kwargs: Any) -> tuple[Any, str]:
        state, model = argument(wrapped, args, kwargs, 0), argument(wrapped, args, kwargs, 1)
        checkpoint = state.cfg.checkpoint
        return model, str(checkpoint.load or checkpoint.pretrained_checkpoint)
