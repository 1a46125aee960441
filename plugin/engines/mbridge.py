"""The mbridge adapter: ``on_model_load`` around ``Bridge.load_weights(models, weights_path)``
in ``mbridge.core.bridge``, the loader of every mbridge model bridge (verl's
``vanilla_mbridge`` branch, AReaL's default ``bridge_cls``, scripts that call mbridge).

megastart's built-in mapping tables decide (mbridge's own mappings are code, not a
registry megastart reads). A ``weights_path`` that is not a local directory, or a
process without a process group, is left to mbridge.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import wrapt

from megastart.engines.base import argument, unwrap
from megastart.engines.library import LibraryAdapter

REQUIREMENT = "mbridge>=0.15,<0.16"
"""mbridge releases read and tested (0.15.1, on megatron-core 0.16.1: mbridge builds models
with ``ModelType.encoder_and_decoder``, which megatron-core 0.17 removed)."""


class MbridgeAdapter(LibraryAdapter):
    """``on_model_load`` around mbridge's HF loader."""

    host: ClassVar[str] = "mbridge"
    module: ClassVar[str] = "mbridge.core.bridge"
    requirement: ClassVar[str] = REQUIREMENT
    serves: ClassVar[tuple[str, ...]] = (
        "verl vanilla_mbridge and AReaL's default bridge_cls (their host adapters answer)",
        "any script calling mbridge's Bridge.load_weights",
    )
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {
        "Bridge.load_weights": ("models", "weights_path"),
    }

    def _attach(self, module: Any) -> None:
        self._load = wrapt.wrap_function_wrapper(module, "Bridge.load_weights", self._around_load)

    def _detach(self, module: Any) -> None:
        unwrap(module.Bridge, "load_weights", self._load)

    def _around_load(self, wrapped: Callable[..., Any], bridge: Any, args: Any, kwargs: Any) -> Any:
        source = argument(wrapped, args, kwargs, 1)
        context = partial(self._context, bridge)
        return self.load_if_served(wrapped, args, kwargs, source, context=context, model_at=0)

    def _context(self, bridge: Any, models: Any) -> Any:
        return self.model_context(list(models), hf_config=bridge.hf_config)
