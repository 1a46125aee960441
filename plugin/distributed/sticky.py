"""The sticky-failure latch: once a collective call failed in a process, later calls fail at once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from megastart.distributed.errors import FailedBefore, describe

if TYPE_CHECKING:
    pass


class Sticky:
    """Once a collective call failed in a process, every later call there fails at once.

    A failed call leaves its peers and groups in an unknown state, and ranks do
    not retry together (a host retries an RPC on the rank where it failed), so a
    second run would wait for ranks that are not coming, or meet collectives
    that are not its own.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.failure: BaseException | None = None

    @contextmanager
    def guard(self, *, passes: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Run the block unless the call failed before; remember its failure
        (errors of the ``passes`` types leave the ranks in step and are not kept)."""
        if self.failure is not None:
            raise FailedBefore(
                f"{self.what}: not run again: it already failed in this process "
                f"({describe(self.failure)}); a retry on some ranks only would wait for "
                "the others or meet their collectives. Restart the process (and do not let "
                "the host retry calls that reach megastart hooks)"
            ) from self.failure
        try:
            yield
        except passes:
            raise
        except BaseException as e:
            self.failure = e
            raise

    def reset(self) -> None:
        """Forget the failure: only for a process that rebuilt its process groups (tests, demos)."""
        self.failure = None
