"""The slime adapter: ``on_model_load`` around slime's own HF loader.

Read at THUDM/slime 624b824a (slime 0.3.1). slime's ``load_checkpoint``
(``slime.backends.megatron_utils.checkpoint``) resumes a Megatron checkpoint with
Megatron-LM's ``load_checkpoint``, and otherwise (an HF directory as ``--load``)
calls ``_load_checkpoint_hf``, which imports and calls
``slime.backends.megatron_utils.hf_to_megatron.load_hf_weights(args, model, path)``
(every rank reads the full tensors it needs), then reloads the optimizer's main
parameters. The adapter wraps that function in its module: ``on_model_load``
first, slime's loader only if no plugin loaded; the optimizer reload after it runs
as before. ``EngineContext.extra`` carries ``"slime_args"`` (Megatron's ``args``).

``post_recover_load`` (Megatron-LM's ``load_checkpoint`` of a resume) and
``pre_first_step`` (``get_forward_backward_func()`` each step) come from the
megatron-core library adapters: slime reaches megastart there with no call
site of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any, ClassVar

import wrapt

from megastart.engines.base import (
    EngineAdapter,
    argument,
    load_through_hook,
    unwrap,
)
from megastart.records import EngineContext


class SlimeAdapter(EngineAdapter):
    """``on_model_load`` around slime's ``load_hf_weights``."""

    host: ClassVar[str] = "slime"
    module: ClassVar[str] = "slime.backends.megatron_utils.hf_to_megatron"
    requirement: ClassVar[str] = "slime>=0.3,<0.4"
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {"load_hf_weights": ("args", "model", "path")}

    def _attach(self, module: ModuleType) -> None:
        self._load = wrapt.wrap_function_wrapper(module, "load_hf_weights", self._around_load)

    def _detach(self, module: ModuleType) -> None:
        unwrap(module, "load_hf_weights", self._load)

    def _around_load(self, wrapped: Callable[..., Any], _: Any, args: Any, kwargs: Any) -> Any:
        return load_through_hook(
            wrapped,
            args,
            kwargs,
            context=partial(self._context, argument(wrapped, args, kwargs, 0)),
            model_at=1,
            checkpoint=argument(wrapped, args, kwargs, 2),
        )

    def _context(self, slime_args: Any, model: Any) -> EngineContext:
        return self.model_context(list(model), extra={"slime_args": slime_args})
