"""Run Python code in a fresh interpreter: plugin discovery, blocking and
post-import hooks are per-process state, so their tests need a process each."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


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
