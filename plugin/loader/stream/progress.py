"""Progress of the stream on the reader: a bar on a terminal, log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("megastart")


class Progress:
    """Bytes sent, GB/s and ETA; redrawn at most 10 times a second, logged every ``log_every_s``."""

    def __init__(
        self,
        total_bytes: int,
        *,
        enabled: bool,
        stream: TextIO | None = None,
        log_every_s: float = 10.0,
    ) -> None:
        self.total = total_bytes
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.log_every_s = log_every_s
        self._start = time.perf_counter()
        self._last = float("-inf")  # the first update shows at once

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        now = time.perf_counter()
        finished = self.done >= self.total
        if now - self._last >= (0.1 if self.tty else self.log_every_s) or finished:
            self._last = now
            self._show(now - self._start, finished)

    def _show(self, elapsed: float, finished: bool) -> None:
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        text = (
            f"rank0_loader: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB, "
            f"{rate / 1e9:.2f} GB/s, ETA {eta:.0f} s"
        )
        if not self.tty:
            log.info("megastart: %s", text)
            return
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
        if finished:
            self.stream.write("\n")
        self.stream.flush()
