"""Run Python code in a fresh interpreter: plugin discovery, blocking and
post-import hooks are per-process state, so their tests need a process each."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


def run_python(
    code: str, *, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with this interpreter; ``env`` adds to a copy of the
    environment from which every ``MEGASTART_*`` variable was removed."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEGASTART_")}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


@contextmanager
def started_with(env: Mapping[str, str | None]) -> Iterator[None]:
    """``env`` in this process's environment inside the block (``None``: unset), as it was
    afterwards. Processes started inside the block (a ``RankPool``'s spawned ranks) start with
    it: for variables read at interpreter start-up (``AUTOWRAPT_BOOTSTRAP``), which
    ``RankPool(env=...)`` sets too late."""
    saved = {name: os.environ.get(name) for name in env}
    _set(env)
    try:
        yield
    finally:
        _set(saved)


def _set(env: Mapping[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
