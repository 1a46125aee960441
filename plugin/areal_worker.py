"""AReaL worker entry point with megastart activated: ``python3 -m megastart.areal_worker``.

Single-controller mode: set it as the training workers' command
(``actor.scheduling_spec.0.cmd``); it runs AReaL's RPC server
(``areal.infra.rpc.rpc_server``) with the scheduler's arguments unchanged.
SPMD mode under torchrun: ``torchrun ... -m megastart.areal_worker train.py
--config ...`` runs the training script instead (first argument ending in ``.py``).

Importing ``megastart.autoload`` first only registers a post-import hook, so the
adapter attaches when AReaL imports its Megatron engine.
"""

from __future__ import annotations

import runpy
import sys

import megastart.autoload  # noqa: F401

RPC_SERVER = "areal.infra.rpc.rpc_server"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].endswith(".py"):
        script = sys.argv[1]
        sys.argv = sys.argv[1:]
        runpy.run_path(script, run_name="__main__")
    else:
        runpy.run_module(RPC_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
