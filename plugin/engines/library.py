"""What the library adapters share: the adapters of Megatron-Bridge, mbridge and megatron-core,
which serve every host that loads and trains through those libraries (NeMo-RL, slime,
ROLL, Megatron-LM, a plain script), and pass through where a host adapter above them
answers the event (:func:`~megastart.engines.base.answered_above`).

They see only what the library call carries: the model (chunks, possibly wrapped in
megatron-core's DDP), megatron-core's ``parallel_state``, and what the library knows
of the checkpoint. The ``library_adapters`` setting keeps them all detached.
"""

from __future__ import annotations

import logging
import os
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import wrapt

from megastart.engines.base import EngineAdapter, answered_above, hook, load_through_hook, unwrap
from megastart.records import EngineContext

log = logging.getLogger("megastart")


class LibraryAdapter(EngineAdapter):
    """An adapter on a library every Megatron host passes through."""

    layer: ClassVar[Literal["host", "library"]] = "library"

    def load_if_served(
        self,
        wrapped: Callable[..., Any],
        args: Any,
        kwargs: Any,
        source: Any,
        *,
        context: Callable[[Any], EngineContext],
        model_at: int,
        loaded: Callable[[Any], Any] = lambda model: None,
    ) -> Any:
        """The library's HF loader behind ``on_model_load`` (:func:`load_through_hook`) where
        megastart can load ``source`` (:func:`served_here`); the library's own load where a
        host adapter above answers the event, or where megastart cannot."""
        checkpoint = None if answered_above("on_model_load") else served_here(source, self.host)
        if checkpoint is None:
            return wrapped(*args, **kwargs)
        return load_through_hook(
            wrapped,
            args,
            kwargs,
            context=context,
            model_at=model_at,
            checkpoint=checkpoint,
            loaded=loaded,
        )


class RecoverLoadAdapter(LibraryAdapter):
    """``post_recover_load`` after the library module's ``load_checkpoint`` returned an
    iteration past zero (a resume, not a fine-tune start or a conversion)."""

    def _attach(self, module: Any) -> None:
        self._module = module
        self._load = wrapt.wrap_function_wrapper(module, "load_checkpoint", self._after_load)

    def _detach(self, module: Any) -> None:
        unwrap(module, "load_checkpoint", self._load)

    def _after_load(self, wrapped: Callable[..., Any], _: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        iteration = result[0]
        if iteration > 0 and not answered_above("post_recover_load"):
            model, checkpoint = self._resumed(wrapped, args, kwargs)
            hook(
                "post_recover_load",
                engine=self.model_context(model, is_restart=True),
                checkpoint=checkpoint,
            )
        return result

    @abstractmethod
    def _resumed(self, wrapped: Callable[..., Any], args: Any, kwargs: Any) -> tuple[Any, str]:
        """The model the call loaded into, and the checkpoint it resumed from."""


def served_here(source: Any, library: str) -> str | None:
    """``source`` as a checkpoint directory megastart can load, or ``None`` (with one line on
    rank 0) where the library's own loader must: a source that is not a local directory,
    or no process group to load over.

    Rank 0 decides (it reads the checkpoint) and every rank takes its answer, over the
    loader's control plane, bounded by ``rank0_loader.timeout_s``: a directory seen on some
    nodes only would otherwise send some ranks into megastart's load and the others into
    the library's, whose collectives never meet."""
    import torch.distributed as dist

    from megastart.distributed import broadcast_or_raise, discarding_control, kept_control
    from megastart.loader.settings import resolved

    if not dist.is_initialized():
        return None
    timeout_s = resolved().timeout_s
    with discarding_control():  # a broadcast that failed may have left the plane half used
        checkpoint: str | None = broadcast_or_raise(
            f"megastart: {library}: whether rank 0 sees {source!r} as a checkpoint directory",
            lambda: str(source) if source is not None and os.path.isdir(str(source)) else None,
            timeout_s=timeout_s,
            control=kept_control(timeout_s=timeout_s),
        )
    if checkpoint is None and dist.get_rank() == 0:
        log.warning(
            "megastart: %s loads from %r, not a local checkpoint directory: left to %s",
            library,
            None if source is None else str(source),
            library,
        )
    return checkpoint
