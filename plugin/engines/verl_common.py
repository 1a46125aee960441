"""What verl's two adapters share: the engine adapter (verl 0.7 to 0.9) and the
legacy-worker adapter (verl 0.7).

Both can be attached in one process: verl 0.7 with
``trainer.use_legacy_worker_impl=disable`` trains the actor on the engine and a
Megatron critic in the legacy ``CriticWorker``, colocated in one Ray actor. So
the log level they raise is kept here, once for both, and put back when the last
of them detaches (``pre_first_step``, once per process, is
:func:`megastart.engines.base.before_first_step`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import wrapt

from megastart.engines.base import EngineAdapter, training_device
from megastart.records import EngineContext

log = logging.getLogger("megastart")

BRIDGE_LOADERS = {True: "load_weights", False: "load_hf_weights"}
"""``vanilla_bridge`` -> the bridge method verl loads HF weights with (mbridge's
``load_weights``, Megatron-Bridge's ``load_hf_weights``)."""

_lock = threading.Lock()
_log_level_holders = 0
_saved_log_level = logging.NOTSET


def show_summaries() -> None:
    """Let megastart's rank-0 INFO summaries through while a verl adapter is attached.

    ``import verl`` sets the root logger to WARNING; a level the user set is kept.
    """
    global _log_level_holders, _saved_log_level
    with _lock:
        if _log_level_holders == 0:
            _saved_log_level = log.level
            log.setLevel(log.level or logging.INFO)
        _log_level_holders += 1


def restore_log_level() -> None:
    """The pair of :func:`show_summaries`: the last adapter to detach restores the level."""
    global _log_level_holders
    with _lock:
        _log_level_holders -= 1
        if _log_level_holders == 0:
            log.setLevel(_saved_log_level)


def verl_context(
    adapter: EngineAdapter,
    model: Any,
    *,
    dtype: Any,
    hf_config: Any,
    is_restart: bool = False,
    value_model: bool,
    extra: dict[str, Any],
    hf_bridge: Any = None,
) -> EngineContext:
    """The host-agnostic view of one verl model (a list of DDP/Float16 chunks: the DDP
    wrapper's config travels as ``ddp_config``)."""
    from megatron.core import parallel_state
    from verl.utils.megatron_utils import unwrap_model

    return adapter.engine_context(
        model_chunks=unwrap_model(list(model)),
        ddp_config=getattr(next(iter(model)), "ddp_config", None),
        parallel_state=parallel_state,
        device=training_device(),
        dtype=dtype,
        hf_config=hf_config,
        is_restart=is_restart,
        value_model=value_model,
        hf_bridge=hf_bridge,
        extra=extra,
    )


@contextmanager
def shadowed(obj: Any, name: str, wrapper: Callable[..., Any]) -> Iterator[None]:
    """Wrap ``obj.name`` on this object only (an instance or a module), until the block ends."""
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
