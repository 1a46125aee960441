"""The :class:`Node` protocol: what a :class:`~megastart.distributed.Board` needs of the page
of node-shared memory where a node's ranks other than its leader wait."""

from __future__ import annotations

from typing import Protocol


class Node(Protocol):
    """What the ranks of one node share about a call without the store: a page of node-shared
    memory (``megastart.loader.stream.node.NodeBoard``), the leader its only writer but for the
    failure flag and each rank's own arrivals. See :meth:`~megastart.distributed.Board.attach`."""

    @property
    def leads(self) -> bool:
        """Whether this rank is the node's leader, the one that talks to the store."""
        ...

    @property
    def leader(self) -> int:
        """The global rank of the node's leader."""
        ...

    @property
    def size(self) -> int:
        """The node's ranks, its leader included."""
        ...

    def leader_gone(self) -> bool:
        """Whether the node's leader process ended (on a rank other than the leader)."""
        ...

    def failed(self) -> bool:
        """Whether a failure was announced (its text is on the store)."""
        ...

    def fail(self) -> None: ...

    def progress(self) -> int:
        """How often the leader saw the call progress (a count that only grows)."""
        ...

    def advanced(self) -> None:
        """The leader saw the call progress: it read, received, or saw a reader's progress."""
        ...

    def arrive(self) -> None:
        """Count this rank in at the node's next barrier."""
        ...

    def arrived(self, count: int) -> bool:
        """Whether every rank of the node arrived at ``count`` barriers."""
        ...

    def gate(self) -> int:
        """How many barriers the leader opened to the node."""
        ...

    def open(self, count: int) -> None: ...
