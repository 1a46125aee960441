"""The ``megastart`` command."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Mapping
from importlib import import_module
from typing import Any

from megastart.errors import MegastartError

DESCRIPTION = """\
megastart keeps Megatron-core RL post-training jobs (verl, AReaL) from dying
while they start:

  rank0_loader  one reader per job touches the HF checkpoint files and streams
                each tensor to the ranks that need it (no host-RAM OOM when
                every rank of a node would load the model);
  comm_warmup   connects exactly the NCCL communicators the train step uses,
                right after a recover load, while GPU memory is light (no GPU
                OOM inside the first step after a restart).

Switch it on:      verl >= 0.9: installed = on (verl.plugins, at `import verl`)
                   any other host: AUTOWRAPT_BOOTSTRAP=megastart.bootstrap in the
                   workers' environment (README "Hosts": one line per host)
Switch it off:     verl: +megastart=off;  anywhere: MEGASTART_DISABLE=1
Block one plugin:  verl: +megastart=on megastart.blocklist=[comm_warmup]
                   anywhere: MEGASTART_BLOCKLIST=comm_warmup
`megastart status` shows how each installed host activates megastart.
"""

# subcommand -> module defining HELP, add_arguments(parser) and run(args) -> int
COMMANDS = {
    "status": "megastart.status",
    "architectures": "megastart.architectures",
    "bench": "megastart.bench",
    "demo": "megastart.demo.cli",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megastart",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error, not only its message"
    )
    parser.add_argument("--version", action="version", version=f"megastart {_version()}")
    add_subcommands(parser.add_subparsers(dest="command", metavar="COMMAND"), COMMANDS)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    if args.command is None:
        parser.print_help()
        return 0
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except MegastartError as e:
        if args.debug:
            raise
        print(f"megastart {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `megastart status | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0


def _plain(text: str) -> str:
    """A module docstring as a user reads it in ``--help``: without reST markup."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megastart")
    except PackageNotFoundError:
        return "unknown"


def add_subcommands(sub: Any, commands: Mapping[str, str], *, run_attr: str = "run") -> None:
    """Add one subparser per ``name -> module``; the module defines ``HELP``,
    ``add_arguments(parser)`` and ``run(args) -> int`` (stored as ``args.<run_attr>``)."""
    for name, module_name in commands.items():
        module = import_module(module_name)
        command = sub.add_parser(
            name,
            help=module.HELP,
            description=_plain(module.__doc__ or module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(**{run_attr: module.run})


if __name__ == "__main__":
    sys.exit(main())
