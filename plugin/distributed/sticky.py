"""The process's one sticky-failure latch: once a collective call failed, later calls fail at once.

One latch per process, consulted by every engine adapter before it reaches a
hook and by every collective entry point of megastart's own (the loader, the
warmup): a failure in any of them leaves peers and groups in an unknown state,
so none of them may issue collectives again in this process.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from megastart.distributed.errors import FailedBefore, describe


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
        self._in_step: weakref.WeakSet[BaseException] = weakref.WeakSet()

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
        before any transfer): they are not kept, here or by a guard around this one.
        """
        self.refuse_if_failed(what)
        try:
            yield
        except passes as e:
            self._in_step.add(e)
            raise
        except BaseException as e:
            with self._lock:
                if self.failure is None and e not in self._in_step:
                    self.failed, self.failure = what, e
            raise

    def reset(self) -> None:
        """Forget the failure: only for a process that rebuilt its process groups (tests, demos)."""
        with self._lock:
            self.failed = self.failure = None


LATCH = Sticky()
"""This process's latch."""
