"""The megatron-core adapters: ``pre_first_step`` before the first schedule call,
``post_recover_load`` after Megatron-LM's resume, and a new world after
``destroy_model_parallel``.

- ``megatron.core.pipeline_parallel.schedules``: ``get_forward_backward_func()``
  returns one of three module-level functions (``forward_backward_no_pipelining``,
  ``forward_backward_pipelining_without_interleaving``,
  ``forward_backward_pipelining_with_interleaving``), and callers cache what it
  returns (Megatron-LM, ROLL) or ask each step (slime, verl, NeMo-RL). Wrapping
  the three in their module, when it is imported, reaches both: ``pre_first_step``
  runs before the first call of any of them in the process, forward-only (a
  log-prob pass) included; never while a CUDA graph is being captured.
- ``megatron.training.checkpointing.load_checkpoint`` (Megatron-LM, and the
  ``megatron.training`` that megatron-core wheels ship from 0.19): ``post_recover_load``
  when it returns an iteration past zero (a resume, not a fine-tune start).
- ``megatron.core.parallel_state.destroy_model_parallel``: the once-per-world
  latches (the first step, the warmup) start again
  (:func:`megastart.distributed.world.new_world`): a process that converts a
  checkpoint in one world and trains in the next (NeMo-RL) warms the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import wrapt

from megastart.distributed.world import capturing_cuda_graph, new_world
from megastart.engines.base import answered_above, argument, before_first_step, hook, unwrap
from megastart.engines.library import LibraryAdapter, RecoverLoadAdapter
from megastart.requirements import MEGATRON_CORE_TESTED

SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
"""What ``get_forward_backward_func()`` returns, by pipeline layout."""

SERVES = ("NeMo-RL", "slime", "ROLL", "Megatron-LM", "any loop over get_forward_backward_func()")


class MegatronCoreScheduleAdapter(LibraryAdapter):
    """``pre_first_step`` before the first call of megatron-core's schedules."""

    host: ClassVar[str] = "megatron-core"
    module: ClassVar[str] = "megatron.core.pipeline_parallel.schedules"
    requirement: ClassVar[str] = MEGATRON_CORE_TESTED
    serves: ClassVar[tuple[str, ...]] = SERVES
    wraps: ClassVar[dict[str, tuple[str, ...]]] = dict.fromkeys(SCHEDULES, ("model",))

    def _attach(self, module: Any) -> None:
        self._steps = {
            name: wrapt.wrap_function_wrapper(module, name, self._before_first_step)
            for name in SCHEDULES
        }

    def _detach(self, module: Any) -> None:
        for name, wrapper in self._steps.items():
            unwrap(module, name, wrapper)

    def _before_first_step(
        self, wrapped: Callable[..., Any], _: Any, args: Any, kwargs: Any
    ) -> Any:
        if not answered_above("pre_first_step") and not capturing_cuda_graph():
            model = kwargs["model"]  # the schedules take keyword arguments only
            before_first_step(lambda: hook("pre_first_step", engine=self.model_context(model)))
        return wrapped(*args, **kwargs)


class MegatronCoreStateAdapter(LibraryAdapter):
    """A new world (once-per-world latches due again) after ``destroy_model_parallel``."""

    host: ClassVar[str] = "megatron-core"
    module: ClassVar[str] = "megatron.core.parallel_state"
    requirement: ClassVar[str] = MEGATRON_CORE_TESTED
    serves: ClassVar[tuple[str, ...]] = ("NeMo-RL (a conversion world, then a training one)",)
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {"destroy_model_parallel": ()}

    def _attach(self, module: Any) -> None:
        self._destroy = wrapt.wrap_function_wrapper(
            module, "destroy_model_parallel", self._after_destroy
        )

    def _detach(self, module: Any) -> None:
        unwrap(module, "destroy_model_parallel", self._destroy)

    def _after_destroy(self, wrapped: Callable[..., Any], _: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        new_world()
        return result


class MegatronLMCheckpointAdapter(RecoverLoadAdapter):
    """``post_recover_load`` after Megatron-LM's ``load_checkpoint`` resumed training."""

    host: ClassVar[str] = "megatron-lm"  # shipped in megatron-core wheels from 0.19
    module: ClassVar[str] = "megatron.training.checkpointing"
    requirement: ClassVar[str] = MEGATRON_CORE_TESTED
    serves: ClassVar[tuple[str, ...]] = ("Megatron-LM", "slime")
    wraps: ClassVar[dict[str, tuple[str, ...]]] = {
        "load_checkpoint": ("ddp_model", "optimizer", "opt_param_scheduler", "load_arg")
    }

    def _resumed(self, wrapped: Callable[..., Any], args: Any, kwargs: Any) -> tuple[Any, str]:
        load_arg = argument(wrapped, args, kwargs, 3)
        checkpoint = getattr(self._module.get_args(), load_arg, None)
        return argument(wrapped, args, kwargs, 0), str(checkpoint)
