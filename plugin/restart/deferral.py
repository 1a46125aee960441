"""Deferred HF loads, one per model: run by the first thing that needs the weights
(:meth:`Deferrals.run`), or made unnecessary by a resume that restores every parameter
(:meth:`Deferrals.resuming`)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from megastart.restart.coverage import agree_restored, capture_reads, model_keys
from megastart.restart.policy import checkpoint_bytes
from megastart.restart.report import SkippedLoad, record_skip

log = logging.getLogger("megastart")


@dataclass(slots=True, kw_only=True)
class Deferred:
    """An HF load a host adapter put off, to run later exactly as it would have run."""

    host: str
    """The host (``"areal"``, ``"verl"``, ...), for the report."""

    checkpoint: str
    """The HF checkpoint directory."""

    load: Callable[[], object]
    """Runs the HF load as the host would have (through ``on_model_load``)."""

    chunks: Callable[[], Sequence[Any]]
    """This rank's model chunks (unwrapped), for the coverage check after a resume."""

    refresh: Callable[[], object] | None = None
    """Copies the model's parameters into the optimizer's main parameters
    (``reload_model_params()``) where the host built its optimizer before the load ran."""

    timeout_s: float = 300.0
    """Bound of the coverage check's agreement (``rank0_loader.timeout_s``)."""


class Deferrals:
    """The deferred HF loads of this process, by the object that owns the model (the host's
    engine), held weakly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: weakref.WeakKeyDictionary[Any, Deferred] = weakref.WeakKeyDictionary()

    def defer(self, owner: Any, deferred: Deferred) -> None:
        """Put off ``owner``'s HF load until :meth:`run` or :meth:`resuming`."""
        with self._lock:
            self._pending[owner] = deferred
        if _rank() == 0:
            log.info(
                "megastart: %s resumes: the HF load of %s waits for the resume load (%s)",
                deferred.host,
                deferred.checkpoint,
                "rank0_loader.skip_hf_load_on_resume",
            )

    def pending(self, owner: Any) -> bool:
        return owner in self._pending

    def run(self, owner: Any, before: str) -> None:
        """Run ``owner``'s deferred HF load, if one is pending, before ``before`` (a forward, a
        save, a weight sync, ...) uses the weights; then refresh the optimizer's main parameters."""
        with self._lock:
            deferred = self._pending.pop(owner, None)
        if deferred is None:
            return
        start = time.perf_counter()
        deferred.load()
        if deferred.refresh is not None:
            deferred.refresh()
        if _rank() == 0:
            log.info(
                "megastart: ran the deferred HF load of %s before %s (%.2f s): no resume load "
                "came first",
                deferred.checkpoint,
                before,
                time.perf_counter() - start,
            )

    @contextmanager
    def resuming(self, owner: Any, resume: str, *, restores_optimizer: bool) -> Iterator[bool]:
        """Around a host's resume load into ``owner``'s model: where ``owner``'s HF load is
        pending, the resume replaces it. After the block every rank checks that the resume
        restored every parameter (:mod:`megastart.restart.coverage`), then, unless the resume
        restored the optimizer too, refreshes its main parameters from the model.

        Yields whether the resume replaced a deferred load. Collective where it did.
        """
        with self._lock:
            deferred = self._pending.pop(owner, None)
        if deferred is None:
            yield False
            return
        with capture_reads() as reads:
            yield True
        keys = model_keys(deferred.chunks())
        missing = [name for key, name in keys.items() if key not in reads.keys]
        agree_restored(missing, total=len(keys), resume=resume, timeout_s=deferred.timeout_s)
        if deferred.refresh is not None and not restores_optimizer:
            deferred.refresh()
        skip = SkippedLoad(
            host=deferred.host,
            checkpoint=deferred.checkpoint,
            resume=str(resume),
            bytes_not_read=checkpoint_bytes(deferred.checkpoint),
            parameters=len(keys),
        )
        record_skip(skip, rank=_rank())


DEFERRALS = Deferrals()
"""The process's deferred HF loads (every adapter's)."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
