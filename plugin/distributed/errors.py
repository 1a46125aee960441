"""The collective errors: raised on every rank, naming the rank that failed and why."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

from megastart.errors import CollectiveError

if TYPE_CHECKING:
    pass


class PeerFailed(CollectiveError):
    """This rank stopped because another rank announced its failure on the :class:`Board`."""


class Stalled(CollectiveError):
    """A wait took longer than ``timeout_s``; the message names what was waited for."""


class LeaderGone(CollectiveError):
    """A rank found its node's leader gone: the process ended (killed, or died without a word)."""


class FailedBefore(CollectiveError):
    """A megastart call was made again in a process where it had failed (:class:`Sticky`)."""


def describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, CollectiveError):
        return str(error)
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    if where:
        frame = where[0]
        text += f" [{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}]"
    return text
