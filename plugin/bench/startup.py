"""What installing megastart costs a Python process: interpreter start-up and ``import verl``.

For each interpreter given, runs ``PYTHON -X importtime -c CODE`` ``--runs`` times
(best of them kept) with ``AUTOWRAPT_BOOTSTRAP`` unset and set to
``megastart.bootstrap``, and prints one JSON object: the sum of the top-level
cumulative import times (``importtime_ms``, what ``-X importtime`` attributes to
imports, ``site`` and its ``.pth`` files included), the wall and CPU (user + system)
time of the whole process (``wall_ms``, ``cpu_ms``: the steadier figure on a busy
machine) and, with ``--module NAME``, that module's cumulative import
time (``module_ms``: for ``megastart.autoload``, all that megastart adds to
``import verl``). ``--code`` changes what is run (default ``pass``); ``--env
NAME=VALUE`` adds a variable to every run. Standard library only::

    megastart bench startup /venv-without/bin/python /venv-with/bin/python
    megastart bench startup --code 'import verl' --module megastart.autoload VENV/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import time

BOOTSTRAP = {"unset": "", "set": "megastart.bootstrap"}
"""``AUTOWRAPT_BOOTSTRAP`` per case (autowrapt treats empty as unset)."""

_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def run_once(
    python: str, code: str, env: dict[str, str], module: str | None
) -> tuple[float, float, float | None, float]:
    """(top-level cumulative import time, wall time, ``module``'s cumulative import
    time or ``None`` if it was not imported, CPU time), in milliseconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [python, "-X", "importtime", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    total_us = 0
    module_us = None
    for line in proc.stderr.splitlines():
        match = _LINE.match(line)
        if match and len(match.group(3)) == 1:  # depth 0: one space after the bar
            total_us += int(match.group(2))
        if match and match.group(4) == module:
            module_us = int(match.group(2))
    module_ms = None if module_us is None else module_us / 1000
    return total_us / 1000, wall * 1000, module_ms, cpu * 1000


def measure(
    python: str, code: str, runs: int, extra: dict[str, str], module: str | None
) -> dict[str, dict]:
    out = {}
    for case, value in BOOTSTRAP.items():
        env = {**os.environ, **extra, "AUTOWRAPT_BOOTSTRAP": value}
        samples = [run_once(python, code, env, module) for _ in range(runs)]
        modules = [s[2] for s in samples if s[2] is not None]
        out[case] = {
            "importtime_ms": round(min(s[0] for s in samples), 2),
            "wall_ms": round(min(s[1] for s in samples), 1),
            "cpu_ms": round(min(s[3] for s in samples), 1),
            "module_ms": round(min(modules), 2) if modules else None,
        }
    return out


HELP = "what installing megastart costs interpreter start-up and `import verl`"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("python", nargs="+", help="interpreters to measure")
    parser.add_argument("--code", default="pass", help="what each run executes (default: pass)")
    parser.add_argument("--runs", type=int, default=10, help="runs per case; the best is kept")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="add to every run"
    )
    parser.add_argument("--module", help="also report this module's cumulative import time")


def run(args: argparse.Namespace) -> int:
    extra = dict(item.split("=", 1) for item in args.env)
    report = {
        "code": args.code,
        "runs": args.runs,
        "env": extra,
        "results": {
            python: measure(python, args.code, args.runs, extra, args.module)
            for python in args.python
        },
    }
    print(json.dumps(report, indent=2))
    return 0
