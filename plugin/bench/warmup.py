"""What NCCL allocates inside the first training step, with and without megastart's warmup.

For one Megatron GPTModel layout on this machine's GPUs, each variant runs in
fresh processes (fresh communicators, its own NCCL environment):

  lazy              no warmup: communicators are created and connected inside
                    the first step, at its peak memory (today's default);
  megastart         megastart.warmup_communicators() before the step;
  allreduce1        a 1-element all-reduce per group (AReaL's and ms-swift's
                    warmup today);
  runtime_connect0  the same with NCCL_RUNTIME_CONNECT=0 (NCCL connects every
                    algorithm and protocol when it creates a communicator).

Per rank: device memory taken outside PyTorch's allocator during the warmup,
during the first step and the second step, and what stays after them
(persistent), plus the warmup's and the first step's seconds. Every variant
runs with NCCL_NVLS_ENABLE=0 and CUDA_MODULE_LOADING=EAGER.

Needs at least 2 NVIDIA GPUs (NCCL refuses two ranks on one GPU). Run it as

  megastart bench warmup --tp 2 --pp 2 --json warmup.json   (torchrun on every visible GPU)
  torchrun --nproc-per-node 4 -m megastart.bench.warmup --tp 2 --pp 2 --json warmup.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from megastart.bench.warmup_worker import (
    COMMON_ENV,
    VARIANT_ENV,
    VARIANTS,
    add_layout_arguments,
)

HELP = "NCCL memory in the first train step: megastart's warmup vs none, 1-element all-reduce, NCCL_RUNTIME_CONNECT=0"

NOISE_BYTES = 2 * 2**20
"""Free-memory readings move in 2 MiB pages: differences below this count as zero."""

TARGETS = {
    "no_nccl_in_first_step": "megastart: no NCCL allocation inside the first step (on every rank)",
    "persistent_not_above_lazy": "megastart: persistent NCCL memory <= the lazy first step's (every rank)",
}

_LAYOUT_FLAGS = ("tp", "pp", "ep", "experts", "layers_per_stage", "hidden", "heads", "vocab", "seq_len", "micro_batches")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layout_arguments(parser)
    parser.add_argument(
        "--nproc", type=int, default=None, help="GPUs to use (default: all visible)"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--timeout-s", type=float, default=900.0, help="bound on each variant (default: 900)"
    )


def run(args: argparse.Namespace) -> int:
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        print(f"megastart bench warmup: unknown variants {sorted(unknown)}; valid: {VARIANTS}", file=sys.stderr)  # fmt: skip
        return 2
    if "LOCAL_RANK" in os.environ:
        return _orchestrate(args)
    return _launch(args)


def _launch(args: argparse.Namespace) -> int:
    """Not under torchrun: check the GPUs, then run this module under torchrun."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(
            f"megastart bench warmup needs at least 2 NVIDIA GPUs and found {gpus}: NCCL "
            "refuses two ranks on one GPU, and one rank has no communicator to warm. "
            "Run it on a machine with 2 or more GPUs.",
            file=sys.stderr,
        )
        return 2
    nproc = args.nproc or gpus
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "megastart.bench.warmup", *_forwarded(args), "--variants", args.variants,
        "--timeout-s", str(args.timeout_s),
    ]  # fmt: skip
    if args.json is not None:
        command += ["--json", str(args.json.resolve())]
    return subprocess.run(command, check=False).returncode


def _orchestrate(args: argparse.Namespace) -> int:
    """Under torchrun: on each rank, one fresh worker process per variant, in turn;
    rank 0 collects every rank's results from the store and reports."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        print("megastart bench warmup needs at least 2 ranks (GPUs); got 1", file=sys.stderr)
        return 2
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        # torchrun's agent hosts the store, unless told not to (then rank 0 does)
        is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    variants = args.variants.split(",")
    for variant in variants:
        env = {**os.environ, **COMMON_ENV, **VARIANT_ENV.get(variant, {})}
        command = [
            sys.executable, "-m", "megastart.bench.warmup_worker", "--variant", variant,
            "--prefix", _prefix(variant), *_forwarded(args),
        ]  # fmt: skip
        done = subprocess.run(command, env=env, timeout=args.timeout_s, check=False)
        if done.returncode != 0:
            print(f"rank {rank}: variant {variant} failed (exit code {done.returncode})", file=sys.stderr)  # fmt: skip
            return done.returncode
    if rank != 0:
        return 0
    results = {
        variant: [json.loads(store.get(f"{_prefix(variant)}/result/{r}")) for r in range(world)]
        for variant in variants
    }
    report = summarize(args, world, results)
    print(render(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def summarize(
    args: argparse.Namespace, world: int, results: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Per variant the per-rank figures and their maximum; ratios to ``lazy``; targets."""
    import torch

    keys = ("warmup_s", "first_step_s", "warmup_nccl_bytes", "first_step_nccl_bytes",
            "second_step_nccl_bytes", "persistent_nccl_bytes")  # fmt: skip
    variants: dict[str, dict[str, Any]] = {
        name: {"ranks": ranks, "max": {key: max(r[key] for r in ranks) for key in keys}}
        for name, ranks in results.items()
    }
    report: dict[str, Any] = {
        "layout": {flag: getattr(args, flag) for flag in _LAYOUT_FLAGS}
        | {"distributed_optimizer": args.distributed_optimizer, "world_size": world},
        "environment": {
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "gpu": torch.cuda.get_device_name(0),
            **COMMON_ENV,
        },
        "variants": variants,
    }
    if "lazy" in variants:
        lazy = variants["lazy"]["max"]
        report["ratios_to_lazy"] = {
            name: {
                key: (v["max"][key] / lazy[key] if lazy[key] > 0 else None)
                for key in ("first_step_nccl_bytes", "persistent_nccl_bytes")
            }
            for name, v in variants.items()
        }
    if "megastart" in variants:
        ranks = variants["megastart"]["ranks"]
        lazy_ranks = variants.get("lazy", {}).get("ranks")
        report["targets"] = {
            "no_nccl_in_first_step": all(r["first_step_nccl_bytes"] < NOISE_BYTES for r in ranks),
            "persistent_not_above_lazy": None if lazy_ranks is None else all(
                ours["persistent_nccl_bytes"] <= theirs["persistent_nccl_bytes"] + NOISE_BYTES
                for ours, theirs in zip(ranks, lazy_ranks, strict=True)
            ),
        }  # fmt: skip
    return report


def render(report: dict[str, Any]) -> str:
    """The figures as a table (maximum over ranks), then ratios and targets."""
    mib = 2**20
    lines = [
        f"layout: {report['layout']}",
        f"environment: {report['environment']}",
        f"{'variant':<18}{'warmup s':>10}{'warmup NCCL MiB':>17}{'1st step NCCL MiB':>19}"
        f"{'2nd step MiB':>14}{'persistent MiB':>16}{'1st step s':>12}",
    ]
    for name, v in report["variants"].items():
        m = v["max"]
        lines.append(
            f"{name:<18}{m['warmup_s']:>10.2f}{m['warmup_nccl_bytes'] / mib:>17.1f}"
            f"{m['first_step_nccl_bytes'] / mib:>19.1f}{m['second_step_nccl_bytes'] / mib:>14.1f}"
            f"{m['persistent_nccl_bytes'] / mib:>16.1f}{m['first_step_s']:>12.2f}"
        )
    for name, ratios in report.get("ratios_to_lazy", {}).items():
        shown = {k: "n/a" if r is None else f"{r:.2f}" for k, r in ratios.items()}
        lines.append(f"ratio to lazy, {name}: {shown}")
    for key, ok in report.get("targets", {}).items():
        lines.append(
            f"target {key}: {TARGETS[key]}: {'met' if ok else 'NOT met' if ok is False else 'n/a'}"
        )
    return "\n".join(lines)


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The layout options as command-line flags, for torchrun and the workers."""
    flags = [f"--{flag.replace('_', '-')}={getattr(args, flag)}" for flag in _LAYOUT_FLAGS]
    return [
        *flags,
        "--distributed-optimizer" if args.distributed_optimizer else "--no-distributed-optimizer",
    ]


def _prefix(variant: str) -> str:
    return f"megastart-bench-warmup/{variant}"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megastart.bench.warmup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
