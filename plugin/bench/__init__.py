"""``megastart bench``: measure megastart against what users run today, on this machine.

Each benchmark prints its figures next to a baseline measured in the same run, and
writes them as JSON with --json. See docs/performance.md for the figures of each
release and the commands that made them.
"""

# Each benchmark is a module defining HELP, add_arguments(parser) and run(args) -> int,
# registered in BENCHMARKS; modules are imported when the command line is parsed, so
# they must not import torch at module level.

from __future__ import annotations

import argparse

HELP = "benchmarks: megastart against the strategies users have today"

# benchmark name -> module defining HELP, add_arguments(parser) and run(args) -> int
BENCHMARKS = {
    "loader": "megastart.bench.loader",
    "warmup": "megastart.bench.warmup",
    "startup": "megastart.bench.startup",
    "plan": "megastart.bench.plan",
    "control": "megastart.bench.control",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megastart.cli import add_subcommands

    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    add_subcommands(sub, BENCHMARKS, run_attr="benchmark_run")


def run(args: argparse.Namespace) -> int:
    return int(args.benchmark_run(args))
