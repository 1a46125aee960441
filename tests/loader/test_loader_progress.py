"""The reader's progress: a bar with GB/s and ETA on a terminal, log lines otherwise."""

from __future__ import annotations

import io
import logging

import pytest

from megastart.loader.stream.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_a_bar_with_rate_and_eta() -> None:
    terminal = Terminal()
    progress = Progress(4 * 10**9, enabled=True, stream=terminal)
    progress.advance(10**9)
    progress.advance(3 * 10**9)
    text = terminal.getvalue()
    assert text.startswith("\r[")
    assert "4.00/4.00 GB" in text and "GB/s" in text and "ETA 0 s" in text
    assert text.endswith("\n")


def test_log_lines_when_not_on_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    pipe = io.StringIO()
    with caplog.at_level(logging.INFO, logger="megastart"):
        progress = Progress(2 * 10**9, enabled=True, stream=pipe, log_every_s=3600)
        progress.advance(10**9)  # first update logs, then at most once per log_every_s
        progress.advance(5 * 10**8)
        progress.advance(5 * 10**8)  # the end is always logged
    assert pipe.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "1.00/2.00 GB" in lines[0] and "2.00/2.00 GB" in lines[1] and "ETA" in lines[0]


def test_disabled_progress_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    terminal = Terminal()
    with caplog.at_level(logging.INFO, logger="megastart"):
        Progress(10, enabled=False, stream=terminal).advance(10)
    assert terminal.getvalue() == "" and not caplog.records
