"""What a skipped HF load saved: one record per skip, the last one kept for this process
and written where ``megastart status`` finds it."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from dataclasses import asdict, dataclass

log = logging.getLogger("megastart")

STATUS_FILE = "megastart-last-restart.json"
"""Where rank 0 writes the last skip, in the system's temporary directory (``megastart status``
reads it back: the job's node, the status command's shell)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SkippedLoad:
    """An HF load a resume made unnecessary: it was never run."""

    host: str
    """The host whose load was skipped (``"areal"``, ``"verl"``, ...)."""

    checkpoint: str
    """The HF checkpoint directory that was not read."""

    resume: str
    """The checkpoint the resume restored every parameter from."""

    bytes_not_read: int
    """The checkpoint's weight files' size: what the HF load would have read (every reader of
    the job together, once; the hosts' own loaders read it once per reading rank)."""

    parameters: int
    """Sharded-state-dict keys of this rank's model that the resume restored (all of them)."""

    def summary(self) -> str:
        return (
            f"HF load skipped: {self.host} resumed from {self.resume!r}, which restored all "
            f"{self.parameters} of this rank's parameters; {self.bytes_not_read / 1e9:.2f} GB "
            f"of {self.checkpoint!r} not read"
        )


_lock = threading.Lock()
_last: SkippedLoad | None = None


def record_skip(skip: SkippedLoad, *, rank: int) -> None:
    """Keep ``skip`` as this process's last; rank 0 logs it and writes it for ``megastart status``."""
    global _last
    with _lock:
        _last = skip
    if rank != 0:
        return
    log.info("megastart: %s", skip.summary())
    try:
        with open(status_path(), "w") as out:
            json.dump(asdict(skip), out)
    except OSError as e:  # a report, not the load: say so and go on
        log.warning("megastart: could not write %s for megastart status: %s", status_path(), e)


def last_skipped() -> SkippedLoad | None:
    """The last HF load this process skipped (``None``: none)."""
    return _last


def status_path() -> str:
    return os.path.join(tempfile.gettempdir(), STATUS_FILE)


def read_status() -> SkippedLoad | None:
    """The last skip a job's rank 0 wrote on this machine (``None``: none, or unreadable)."""
    try:
        with open(status_path()) as f:
            return SkippedLoad(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None
