"""The process's one sticky-failure latch: once a collective call failed, later calls fail at once.

One latch per process, consulted by every engine adapter before it reaches a
hook and by every collective entry point of megastart's own (the loader, the
warmup): a failure in any of them leaves peers and groups in an unknown state,
so none of them may issue collectives again in this process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from megastart.distributed.errors import FailedBefore, describe

_IN_STEP = "_megastart_in_step"
"""The attribute :meth:`Sticky.guard` marks an error of its ``passes`` types with."""


class Sticky:
    """Once a collective call failed in a process, every later call there fails at once.

    A failed call leaves its peers and groups in an unknown state, and ranks do
    not retry together (a host retries an RPC on the rank where it failed), so a
    second run would wait for ranks that are not coming, or meet collectives
    that are not its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failed: str | None = None
        """What failed first (``"rank0_loader"``, ``"pre_first_step"``); ``None``: nothing."""
        self.failure: BaseException | None = None

    def refuse_if_failed(self, what: str) -> None:
        """Raise :class:`FailedBefore` for ``what`` if a call failed before in this process."""
        if self.failure is not None:
            raise FailedBefore(
                f"{what}: not run: {self.failed} already failed in this process "
                f"({describe(self.failure)}); a retry on some ranks only would wait for "
                "the others or meet their collectives. Restart the process (and do not let "
                "the host retry calls that reach megastart hooks)"
            ) from self.failure

    @contextmanager
    def guard(self, what: str, *, passes: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Run the block unless a call failed before; remember its failure.

        Errors of the ``passes`` types leave the ranks in step (decided on every rank
        before any transfer): they are not kept, here or by a guard around this one. The
        error itself carries that mark: by identity, whatever its type (a set of them would
        hash it, which an exception with ``__eq__`` refuses, and hold it weakly, which a
        built-in exception refuses).
        """
        self.refuse_if_failed(what)
        try:
            yield
        except passes as e:
            setattr(e, _IN_STEP, True)
            raise
        except BaseException as e:
            with self._lock:
                if self.failure is None and not getattr(e, _IN_STEP, False):
                    self.failed, self.failure = what, e
            raise

    def reset(self) -> None:
        """Forget the failure: only for a process that rebuilt its process groups (tests, demos)."""
        with self._lock:
            self.failed = self.failure = None


LATCH = Sticky()
"""This process's latch."""
