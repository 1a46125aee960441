"""The base of every engine adapter, and the helpers every adapter uses.

Modelled on OpenTelemetry's ``BaseInstrumentor``: the public ``attach`` and
``detach`` are idempotent guards around the adapter's own ``_attach`` and
``_detach``, which mirror each other line by line.

Adapters come in two layers: *library adapters* wrap what every Megatron host
passes through (Megatron-Bridge, mbridge, megatron-core), *host adapters* wrap a
host's own call sites, with a richer context. One event gives one hook call: a
host adapter answering an event marks it for the duration of the host's call
(:func:`answering`), and a library adapter underneath passes through
(:func:`answered_above`).

What every adapter needs once, and finds only here:

- :func:`unwrap`: the strict pair of ``wrapt.wrap_function_wrapper``;
- :func:`argument`: a wrapped host method's argument, however it was passed;
- :meth:`EngineAdapter.settings` and :meth:`EngineAdapter.engine_context`: the
  one lookup of this process's settings (:meth:`EngineAdapter.model_context` where the
  host hands over only the model);
- :func:`hook`: a hook call behind the process's one sticky-failure latch
  (:data:`megastart.distributed.sticky.LATCH`);
- :func:`load_through_hook`: ``on_model_load``, else the host's loader;
- :func:`before_first_step`: ``pre_first_step`` once per process and world;
- :func:`unwrap_chunks` and :func:`~megastart.distributed.world.training_device`: the
  model and device as hooks see them.

Imports point one way: adapters import this module, this module imports the
manager; the manager reaches adapters only through their entry points.
"""

from __future__ import annotations

import inspect
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from typing import Any, ClassVar, Literal

from megastart.distributed.sticky import LATCH
from megastart.distributed.world import OncePerWorld, training_device
from megastart.manager import call_hook, get_settings
from megastart.records import EngineContext
from megastart.requirements import Compatibility, check_requirement

log = logging.getLogger("megastart")


class EngineAdapter(ABC):
    """Attaches megastart's hooks to one host module without editing the host."""

    host: ClassVar[str]
    """Short host name used in ``EngineContext.host`` (``"verl"``)."""

    module: ClassVar[str]
    """The host module this adapter attaches to; its entry-point name."""

    requirement: ClassVar[str]
    """The supported host versions, as a requirement (``"verl>=0.8,<0.10"``)."""

    wraps: ClassVar[Mapping[str, tuple[str, ...]]]
    """``"Class.method"`` -> parameter names the wrapper relies on."""

    layer: ClassVar[Literal["host", "library"]] = "host"
    """``"library"``: wraps a library every Megatron host passes through; the
    ``library_adapters`` setting switches these off, keeping the host adapters."""

    serves: ClassVar[tuple[str, ...]] = ()
    """A library adapter's hosts, as ``megastart status`` lists them."""

    def __init__(self) -> None:
        self._attached_to: ModuleType | None = None

    @property
    def attached(self) -> bool:
        return self._attached_to is not None

    def compatibility(self) -> Compatibility:
        """Whether the installed host version is supported (reads metadata only)."""
        return check_requirement(self.requirement)

    def missing_attributes(self, module: ModuleType) -> list[str]:
        """The wrapped attributes (or their parameters) the host module lacks."""
        missing = []
        for dotted, params in self.wraps.items():
            obj: object = module
            for part in dotted.split("."):
                obj = getattr(obj, part, _MISSING)
                if obj is _MISSING:
                    break
            if obj is _MISSING:
                missing.append(f"{self.module}.{dotted}")
                continue
            have = inspect.signature(obj).parameters  # type: ignore[arg-type]
            lacking = [p for p in params if p not in have]
            if lacking:
                missing.append(f"{self.module}.{dotted}({', '.join(lacking)})")
        return missing

    def attach(self, module: ModuleType) -> bool:
        """Wrap the host module; warn once and wrap nothing if it does not fit."""
        if self.attached:
            return True
        compat = self.compatibility()
        if not compat.compatible:
            log.warning("megastart: not attaching to %s: %s", self.module, compat.reason)
            return False
        missing = self.missing_attributes(module)
        if missing:
            log.warning(
                "megastart: not attaching to %s (%s %s): missing %s",
                self.module,
                self.host,
                compat.installed_version,
                ", ".join(missing),
            )
            return False
        self._attach(module)
        self._attached_to = module
        log.debug("megastart: attached to %s %s", self.host, compat.installed_version)
        return True

    def detach(self) -> None:
        """Restore the host's originals; a no-op when not attached."""
        if self._attached_to is None:
            return
        self._detach(self._attached_to)
        self._attached_to = None

    def settings(self) -> Any:
        """This host's settings section (the adapter's ``megastart_settings``), as resolved
        in this process."""
        return get_settings().section(self.host)

    def engine_context(
        self,
        *,
        model_chunks: Sequence[Any],
        parallel_state: ModuleType,
        device: Any,
        dtype: Any,
        hf_config: Any,
        is_restart: bool,
        extra: Mapping[str, Any],
        value_model: bool = False,
        host_dequantises: frozenset[str] = frozenset(),
        hf_bridge: Any = None,
        ddp_config: Any = None,
    ) -> EngineContext:
        """The ``EngineContext`` of one of this host's models, with this process's settings."""
        return EngineContext(
            host=self.host,
            host_version=str(self.compatibility().installed_version),
            model_chunks=tuple(model_chunks),
            parallel_state=parallel_state,
            device=device,
            dtype=dtype,
            hf_config=hf_config,
            is_restart=is_restart,
            value_model=value_model,
            settings=get_settings(),
            host_dequantises=host_dequantises,
            hf_bridge=hf_bridge,
            ddp_config=ddp_config,
            extra=extra,
        )

    def model_context(
        self,
        model: Any,
        *,
        hf_config: Any = None,
        hf_bridge: Any = None,
        is_restart: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> EngineContext:
        """The ``EngineContext`` of ``model`` (a chunk or a list of chunks, wrapped or not in
        megatron-core's DDP), as a host that hands over only the model gives it."""
        from megatron.core import parallel_state

        chunks = model if isinstance(model, list) else [model]
        return self.engine_context(
            model_chunks=unwrap_chunks(chunks),
            parallel_state=parallel_state,
            device=training_device(),
            dtype=None,
            hf_config=hf_config,
            is_restart=is_restart,
            hf_bridge=hf_bridge,
            ddp_config=getattr(chunks[0], "ddp_config", None) if chunks else None,
            extra=extra or {},
        )

    @abstractmethod
    def _attach(self, module: ModuleType) -> None:
        """Wrap the host's methods (``wrapt.wrap_function_wrapper``)."""

    @abstractmethod
    def _detach(self, module: ModuleType) -> None:
        """Unwrap them, in the same order as ``_attach``."""


_MISSING = object()


def unwrap(owner: type | ModuleType, name: str, wrapper: Any) -> None:
    """Put back the function ``wrapper`` (what ``wrapt.wrap_function_wrapper`` returned)
    replaced on ``owner`` (a class or a module); refuse if someone replaced it since.

    Already restored is fine, so ``detach`` can be retried after such a refusal.
    """
    original = wrapper.__wrapped__
    current = vars(owner).get(name)
    if current is original:
        return
    if current is not wrapper:
        raise RuntimeError(
            f"megastart: cannot restore {getattr(owner, '__qualname__', owner.__name__)}.{name}: "
            "it was replaced after megastart wrapped it; detach the later wrapper first"
        )
    setattr(owner, name, original)


def argument(function: Callable[..., Any], args: Any, kwargs: Any, position: int) -> Any:
    """The value ``function`` receives for its parameter at ``position``: passed by
    position, by name, or its default (``None`` if it has none).

    ``function`` is the ``wrapped`` a wrapt wrapper receives: for a method, already
    bound, so ``self`` is not counted.
    """
    if len(args) > position:
        return args[position]
    parameter = list(inspect.signature(function).parameters.values())[position]
    if parameter.name in kwargs:
        return kwargs[parameter.name]
    return None if parameter.default is inspect.Parameter.empty else parameter.default


_answering: ContextVar[frozenset[str]] = ContextVar("megastart_answering", default=frozenset())


@contextmanager
def answering(*events: str) -> Iterator[None]:
    """Mark hooks ``events`` as answered by this adapter while the block (the host's own
    call) runs: a library adapter the call reaches passes through."""
    token = _answering.set(_answering.get() | set(events))
    try:
        yield
    finally:
        _answering.reset(token)


def answered_above(event: str) -> bool:
    """Whether an adapter further up this call answers hook ``event``."""
    return event in _answering.get()


def hook(name: str, **kwargs: Any) -> Any:
    """Call hook ``name`` (:func:`megastart.manager.call_hook`), unless a hook or a collective
    of megastart's failed before in this process; a failure here is remembered for the process.

    Every hook is collective: a host that retries an RPC on one rank would re-run it
    there alone, so a retried call is refused before it issues anything.
    """
    with LATCH.guard(name):
        return call_hook(name, **kwargs)


def load_through_hook(
    wrapped: Callable[..., Any],
    args: Any,
    kwargs: Any,
    *,
    context: Callable[[Any], EngineContext],
    model_at: int,
    checkpoint: Any,
    loaded: Callable[[Any], Any] = lambda model: None,
) -> Any:
    """Run a host's (or a library's) HF loader behind ``on_model_load``: the loader itself
    only if no plugin handled the load (a critic's too: the context says it is a value model).

    :param context: the engine context for the model chunks the loader was given.
    :param model_at: the loader's parameter that holds those chunks.
    :param loaded: what the loader returns for those chunks, returned when a plugin loaded.
    """
    model = argument(wrapped, args, kwargs, model_at)
    with answering("on_model_load"):
        if hook("on_model_load", engine=context(model), checkpoint=str(checkpoint)) is None:
            return wrapped(*args, **kwargs)
    return loaded(model)


_first_step_lock = threading.Lock()
_first_step = OncePerWorld()


def before_first_step(call: Callable[[], object]) -> None:
    """Run ``call`` (the adapter's ``pre_first_step``) unless a first step ran in this
    process already (in this Megatron world: :mod:`megastart.distributed.world`).

    Once per process, not per adapter: verl 0.7 trains an actor on the engine and a
    critic in the legacy workers in one process, and their communicators are the
    same. It counts as done only when ``call`` returns: a step retried after the
    hook raised reaches ``call`` again, where the latch refuses it.
    """
    with _first_step_lock:
        if _first_step.done:
            return
        call()
        _first_step.mark()


def unwrap_chunks(model: Any) -> list[Any]:
    """The Megatron model chunks inside a model or a list of them, unwrapped from DDP,
    FSDP and Float16Module (megatron-core's ``unwrap_model``)."""
    from megatron.core.utils import unwrap_model

    return list(unwrap_model(model if isinstance(model, list) else [model]))
