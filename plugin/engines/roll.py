"""The ROLL adapter: ``on_model_load`` in ROLL's Megatron model factory (``mcore_adapter``).

Read at alibaba/ROLL 8eb27cc2 (``mcore_adapter`` 0.10.0.dev0). ROLL builds its
Megatron models with ``PretrainedModel.from_pretrained(model_name_or_path, ...)``
(``mcore_adapter.models.model_factory``): it builds the chunks
(``VirtualModels``), then, from an HF directory, asks a ``ModelConverter`` for each
virtual stage's state dict (``load_mca_state_dict_from_hf(model_path, vp_stage)``:
every rank reads the whole shard files it needs) and loads them with
``load_state_dict(strict=False)``, asserting that no key is missing or unexpected.

The converter returns a state dict instead of filling the model. So, for the
duration of ``from_pretrained`` only, the adapter notes the ``VirtualModels`` it
builds, and at the first conversion call runs ``on_model_load`` on those chunks:
a plugin fills them in place (megastart's one reader), and the converter's answer
for each stage is then that chunk's own state dict, so ROLL's ``load_state_dict``
copies each parameter onto itself (no file is read again) and its key checks pass
as after its own conversion. ``None`` from every plugin runs ROLL's converter.
A conversion outside ``from_pretrained`` (ROLL's offline converter) is left alone.

``pre_first_step`` comes from the megatron-core library adapter (ROLL caches
``get_forward_backward_func()`` once). ROLL resumes with a bare
``dist_checkpointing.load`` after the full HF load: no ``post_recover_load``, so
the warmup runs at the first step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import wrapt

from megastart.engines.base import (
    EngineAdapter,
    answering,
    argument,
    hook,
    training_device,
    unwrap,
)


@dataclass(slots=True)
class _Build:
    """One ``from_pretrained`` call: the models it built, and whether a plugin loaded them."""

    models: Any = None
    loaded: bool | None = None


_build: ContextVar[_Build | None] = ContextVar("megastart_roll_build", default=None)


class RollAdapter(EngineAdapter):
    """``on_model_load`` in ROLL's ``PretrainedModel.from_pretrained``."""

    host: ClassVar[str] = "roll"
    module: ClassVar[str] = "mcore_adapter.models.model_factory"
    requirement: ClassVar[str] = "mcore-adapter>=0.10.0.dev0,<0.11"
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {
        "PretrainedModel.from_pretrained": ("model_name_or_path",),
        "VirtualModels.__init__": ("cls", "config"),
        "ModelConverter.load_mca_state_dict_from_hf": ("model_path", "vp_stage"),
    }

    def _attach(self, module: ModuleType) -> None:
        self._build = wrapt.wrap_function_wrapper(
            module, "PretrainedModel.from_pretrained", self._around_build
        )
        self._models = wrapt.wrap_function_wrapper(
            module, "VirtualModels.__init__", self._after_models
        )
        self._convert = wrapt.wrap_function_wrapper(
            module, "ModelConverter.load_mca_state_dict_from_hf", self._around_convert
        )

    def _detach(self, module: ModuleType) -> None:
        unwrap(module.PretrainedModel, "from_pretrained", self._build)
        unwrap(module.VirtualModels, "__init__", self._models)
        unwrap(module.ModelConverter, "load_mca_state_dict_from_hf", self._convert)

    # -- wrappers ------------------------------------------------------------

    def _around_build(self, wrapped: Callable[..., Any], _: Any, args: Any, kwargs: Any) -> Any:
        token = _build.set(_Build())
        try:
            with answering("on_model_load"):
                return wrapped(*args, **kwargs)
        finally:
            _build.reset(token)

    def _after_models(
        self, wrapped: Callable[..., Any], models: Any, args: Any, kwargs: Any
    ) -> Any:
        wrapped(*args, **kwargs)
        build = _build.get()
        if build is not None and build.models is None:
            build.models = models

    def _around_convert(self, wrapped: Callable[..., Any], _: Any, args: Any, kwargs: Any) -> Any:
        build = _build.get()
        if build is None or build.models is None:
            return wrapped(*args, **kwargs)
        if build.loaded is None:
            checkpoint = str(argument(wrapped, args, kwargs, 0))
            report = hook(
                "on_model_load", engine=self._context(build.models), checkpoint=checkpoint
            )
            build.loaded = report is not None
        if not build.loaded:
            return wrapped(*args, **kwargs)
        chunk = build.models.models[argument(wrapped, args, kwargs, 1)]
        return {k: v for k, v in chunk.state_dict().items() if not k.endswith("._extra_state")}

    def _context(self, models: Any) -> Any:
        from megatron.core import parallel_state

        return self.engine_context(
            model_chunks=list(models.models),
            parallel_state=parallel_state,
            device=training_device(),
            dtype=None,
            hf_config=None,
            is_restart=False,
            extra={"roll_models": models},
        )
