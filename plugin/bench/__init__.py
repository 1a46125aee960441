"""``megastart bench``: measure megastart against what users run today, on this machine.

Each benchmark is a module defining ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``, registered in :data:`BENCHMARKS`; modules are imported
when the command line is parsed, so they must not import torch at module level.
"""

from __future__ import annotations

import argparse
from importlib import import_module

HELP = "benchmarks: megastart against the strategies users have today"

# benchmark name -> module defining HELP, add_arguments(parser) and run(args) -> int
BENCHMARKS = {
    "loader": "megastart.bench.loader",
    "warmup": "megastart.bench.warmup",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        module = import_module(module_name)
        command = sub.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(benchmark_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args.benchmark_run(args))
