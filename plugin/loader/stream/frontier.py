"""The reader's progress through the page cache, as a word of the node's page: how many
buckets it has made resident, or its error, which the node's ranks poll."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megastart.distributed import Board, CollectiveError, polled_locally
from megastart.loader.plan.buckets import Plan
from megastart.loader.stream.transport import ReaderError

if TYPE_CHECKING:
    import torch


class Frontier:
    """How many of the plan's buckets the reader has read into the page cache, or its error,
    in :data:`NBYTES` of the node's page (:attr:`~megastart.loader.stream.node.NodeBoard.spare`) that
    the node's ranks poll (a gloo header per bucket took milliseconds each on a busy node).

    Only the reader writes it, only after the bucket's pages are resident; what the
    ranks then read is the files', never bytes the reader wrote, so no memory order
    between the word and other data is needed.
    """

    NBYTES = 4096
    """``[read, failed, buckets, bytes, plan]`` (five int64: the reader's plan's buckets and
    bytes, and a word of both that says they are there), then the error message (UTF-8, cut
    to fit)."""

    _TEXT = 40

    def __init__(self, data: torch.Tensor, sender: str) -> None:
        import torch

        self._bytes = data[: self.NBYTES]
        self._words = self._bytes[: self._TEXT].view(torch.int64)
        self._sender = sender

    def plan(self, plan: Plan) -> None:
        """The reader's plan, which the ranks :meth:`check` against theirs."""
        self._words[2], self._words[3] = len(plan.buckets), plan.nbytes
        self._words[4] = _fingerprint(plan)  # one word: read alone, it says it all

    def check(self, plan: Plan, board: Board) -> None:
        """Once the reader has said its plan (watching the board), raise a
        :class:`~megastart.distributed.CollectiveError` if ``plan`` is not the reader's: each
        rank takes its slices by its own plan, and would wait for buckets that never come."""
        board.wait(
            polled_locally(lambda: bool(int(self._words[4]))),
            f"{self._sender} to say its plan",
            peer=True,
        )
        if int(self._words[4]) != _fingerprint(plan):
            theirs = int(self._words[2]), int(self._words[3])
            raise CollectiveError(
                f"{self._sender} planned {theirs[0]} buckets of {theirs[1]} bytes where this rank "
                f"planned {len(plan.buckets)} of {plan.nbytes}: the ranks' plans differ; nothing "
                "was copied"
            )

    def reached(self, read: int) -> bool:
        """Whether the reader has said the first ``read`` buckets are in the page cache (one
        look, no wait)."""
        return int(self._words[0]) >= read

    def publish(self, read: int) -> None:
        """The first ``read`` buckets of the plan are in the page cache."""
        self._words[0] = read

    def fail(self, message: str) -> None:
        """The reader failed: every rank waiting raises ``message`` as a :class:`ReaderError`."""
        import torch

        data = message.encode()[: self.NBYTES - self._TEXT]
        start = self._TEXT
        self._bytes[start : start + len(data)] = torch.frombuffer(
            bytearray(data), dtype=torch.uint8
        )
        self._words[1] = len(data)

    def wait(self, read: int, board: Board) -> None:
        """Until the first ``read`` buckets are in the page cache (watching the board).

        Polled every 50 microseconds at first, then less often, up to every 2 ms
        (:func:`~megastart.distributed.polled_locally`): a rank waits here only when it is
        ahead of the reader.
        """

        def reached() -> bool:
            if int(self._words[0]) >= read:
                return True
            failed = int(self._words[1])
            if failed:
                start = self._TEXT
                text = bytes(self._bytes[start : start + failed].numpy()).decode(errors="replace")
                raise ReaderError(text)
            return False

        board.wait(
            polled_locally(reached),
            f"{self._sender} to read bucket {read} of the plan",
            peer=True,
        )


def _fingerprint(plan: Plan) -> int:
    """A plan's buckets and bytes in one non-zero word (ints hash alike in every process)."""
    return (hash((len(plan.buckets), plan.nbytes)) & (2**62 - 1)) | 2**62
