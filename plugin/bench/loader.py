"""Load one random HF checkpoint into one Megatron layout with megastart's loader and
with the strategies users have today, in one run, on this machine:

  every_rank_full  every rank materialises the whole checkpoint, then copies its
                   slices (verl's legacy loader);
  stage_reader     tensor-parallel rank 0 of each pipeline stage reads the whole
                   stage, then scatters the TP shards (mbridge's default);
  mmap_slices      every rank mmaps the files and reads only its own slices
                   (AReaL's loader).

and, asked for, Megatron-Bridge's own load (``bridge``), e.g. on a checkpoint with packed
experts (``--arch qwen3_moe_packed``), where it caches whole fused tensors.

For each: wall seconds, node peak memory (sum over the ranks of their PSS,
sampled every 20 ms), transient memory (peak minus the steady state after the
load), and bytes read from the checkpoint files. Also the physical limits of
this machine: one reader's read throughput and gloo's broadcast throughput.
Every strategy's weights are checked against megastart's (a checksum per rank).

Each strategy runs twice over, by default: with the checkpoint dropped from the
page cache before every load (``cold``: how a job start meets a checkpoint it
has not read yet, so the storage is on the critical path of every strategy),
and with it cached (``warm``: a restart on the same node, where reading costs a
memory copy).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from megastart.bench.baselines import BASELINES
from megastart.bench.loader_measure import measure
from megastart.bench.loader_report import render
from megastart.bench.loader_results import Layout

log = logging.getLogger("megastart")

HELP = "megastart's loader against every-rank, stage-reader and mmap-slice loading"

STRATEGIES = ("megastart", "megastart_shm", "every_rank_full", "stage_reader", "mmap_slices")
OPTIONAL_STRATEGIES = ("megastart_registry", "megastart_registered", "megastart_staged", "bridge")
"""Strategies run only when asked for: ``megastart_registry`` and ``bridge`` (Megatron-Bridge's
own load) need Megatron-Bridge; ``megastart_registered`` and ``megastart_staged`` differ from
``megastart`` only with ``--device cuda``."""
BY_BRIDGE = ("megastart_registry", "bridge")
PACKED_ARCH = "qwen3_moe_packed"
"""``--arch``: Qwen3-MoE with its routed experts packed per layer, as Qwen3.5-MoE and
Qwen3-VL-MoE ship them (:mod:`megastart.bench.packed`); megastart maps it through
Megatron-Bridge's registry, so only ``megastart`` and ``bridge`` run on it."""
KNOWN_STRATEGIES = STRATEGIES + OPTIONAL_STRATEGIES
READERS = ("global", "node", "striped", "auto")
"""The ``rank0_loader.reader`` settings ``--readers`` takes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _layout_arguments(parser.add_argument_group("layout"))
    _checkpoint_arguments(parser.add_argument_group("checkpoint"))
    _strategy_arguments(parser.add_argument_group("strategies"))
    _measurement_arguments(parser.add_argument_group("measurement"))


def _layout_arguments(parser: argparse._ActionsContainer) -> None:
    """The layout: ranks, parallelism, devices, simulated nodes."""
    parser.add_argument("--ranks", type=int, default=4, help="world size (default: 4)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default: 2)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (MoE architectures)"
    )
    parser.add_argument(
        "--arch",
        default="qwen2",
        help=f"model architecture (default: qwen2); {PACKED_ARCH}: Qwen3-MoE with packed experts "
        "(gate_up_proj [E, 2I, H] and down_proj [E, H, I] per layer), for --strategies bridge",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the parameters live (default: cpu); cuda: rank r uses GPU r modulo the GPUs "
        "visible, so several ranks may share one (no NCCL inside a node: the loader does not need it)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="simulate nodes of this many consecutive ranks through LOCAL_RANK (default: one node)",
    )
    parser.add_argument(
        "--transport",
        choices=("gloo", "nccl"),
        default="gloo",
        help="megastart's rank0_loader.transport between node leaders (default: gloo); nccl "
        "needs --device cuda, and each node leader a GPU of its own (--ranks-per-node 1: each "
        "GPU a simulated node); adds the limit of an NCCL broadcast between the leaders",
    )


def _checkpoint_arguments(parser: argparse._ActionsContainer) -> None:
    """The checkpoint."""
    parser.add_argument(
        "--size-gb", type=float, default=1.0, help="checkpoint size to generate, in GB (default: 1)"
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="load this HF checkpoint instead of generating one (--arch/--size-gb ignored)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="write the generated checkpoint here and keep it (default: a temporary directory)",
    )


def _strategy_arguments(parser: argparse._ActionsContainer) -> None:
    """What is compared."""
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated subset of {','.join(KNOWN_STRATEGIES)} "
        "(megastart is always run; megastart_registry maps through Megatron-Bridge's registry; "
        "bridge is Megatron-Bridge's own load_hf_weights; "
        "megastart_registered copies into CUDA out of the page cache registered with CUDA)",
    )
    parser.add_argument(
        "--readers",
        default=None,
        help="run megastart once per rank0_loader.reader setting in this comma-separated list "
        f"of {','.join(READERS)}, as rows megastart[global], ... (default: once, as 'megastart', "
        "with reader=global)",
    )
    parser.add_argument(
        "--read-gbps",
        type=float,
        default=None,
        help="cap each process's reads of the checkpoint files at this many GB/s, as a parallel "
        "file system caps each client (default: no cap); with --ranks-per-node, shows what "
        "several readers gain",
    )
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=None,
        help="megastart's rank0_loader.bucket_mb (default: the loader's default)",
    )


def _measurement_arguments(parser: argparse._ActionsContainer) -> None:
    """How it is measured and reported."""
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed loads per strategy, after the one that measures memory; the median is reported",
    )
    parser.add_argument(
        "--page-cache",
        choices=("cold", "warm", "both"),
        default="both",
        help="cold: drop the checkpoint from the page cache before every load (a job start); "
        "warm: keep it cached (a restart on the same node); both (default): cold, then warm. "
        "The JSON's top level is the first; with both, its 'warm' key holds the second",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results to FILE")
    parser.add_argument(
        "--sample-ms", type=float, default=20.0, help="PSS sampling period (default: 20)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=600.0, help="bound on every distributed step"
    )


def run(args: argparse.Namespace) -> int:
    layout = Layout(ranks=args.ranks, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep)
    if args.ranks_per_node is not None and (
        args.ranks_per_node < 1 or args.ranks % args.ranks_per_node
    ):
        raise SystemExit(f"--ranks-per-node {args.ranks_per_node} must divide --ranks {args.ranks}")
    chosen = _chosen_strategies(args.strategies, args.readers)
    _check_bridge(chosen, packed=args.checkpoint is None and args.arch == PACKED_ARCH)
    if args.read_gbps is not None and not args.read_gbps > 0:
        raise SystemExit(f"--read-gbps must be a positive number of GB/s, got {args.read_gbps}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.transport == "nccl":
        _check_nccl(args.device, args.ranks, args.ranks_per_node or args.ranks)
    conditions = ("cold", "warm") if args.page_cache == "both" else (args.page_cache,)
    with tempfile.TemporaryDirectory(prefix="megastart-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        checkpoint = args.checkpoint or _make_checkpoint(args.arch, args.size_gb, workdir)
        runs = measure(
            checkpoint,
            layout,
            chosen,
            page_caches=conditions,
            bucket_mb=args.bucket_mb,
            repeats=args.repeats,
            sample_s=args.sample_ms / 1e3,
            timeout_s=args.timeout_s,
            device=args.device,
            ranks_per_node=args.ranks_per_node,
            read_gbps=args.read_gbps,
            transport=args.transport,
        )
    results = runs[0].record()
    for other in runs[1:]:
        results[other.page_cache] = other.record()
    results["arguments"] = {
        key: str(value) if isinstance(value, Path) else value
        for key, value in vars(args).items()
        if not callable(value)
    }
    print("\n\n".join(render(r) for r in runs))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    mismatched = [
        f"{name} ({r.page_cache} page cache)"
        for r in runs
        for name, s in r.strategies.items()
        if not s.weights_match_megastart
    ]
    if mismatched:
        print(f"\nweights differ from megastart's: {', '.join(mismatched)}")
    return 1 if mismatched else 0


def _chosen_strategies(text: str, readers: str | None) -> tuple[str, ...]:
    """The strategies to run, in the report's order; ``megastart`` once per reader of
    ``readers`` (as ``megastart[reader]``) if given."""
    names = _names(text)
    unknown = sorted(set(names) - set(KNOWN_STRATEGIES))
    if unknown:
        raise SystemExit(
            f"--strategies: unknown {unknown}; choose from {', '.join(KNOWN_STRATEGIES)}"
        )
    ours: tuple[str, ...] = ("megastart",)
    if readers is not None:
        chosen = _names(readers)
        wrong = sorted(set(chosen) - set(READERS)) or ([] if chosen else ["(none)"])
        if wrong:
            raise SystemExit(f"--readers: unknown {wrong}; choose from {', '.join(READERS)}")
        ours = tuple(f"megastart[{r}]" for r in dict.fromkeys(chosen))
    return ours + tuple(n for n in KNOWN_STRATEGIES if n != "megastart" and n in names)


def _check_bridge(chosen: tuple[str, ...], *, packed: bool) -> None:
    """Refuse, before any rank starts, what cannot run: Megatron-Bridge's strategies where it
    is not installed, the baselines on packed experts (they map with the built-in tables)."""
    from importlib.util import find_spec

    if packed:
        baselines = [n for n in chosen if n in BASELINES]
        if baselines:
            raise SystemExit(
                f"--arch {PACKED_ARCH}: {', '.join(baselines)} map with megastart's built-in "
                f"tables, which read one tensor per expert; choose from megastart,bridge"
            )
    if (packed or set(chosen) & set(BY_BRIDGE)) and find_spec("megatron.bridge") is None:
        wanted = "--arch " + PACKED_ARCH if packed else ", ".join(set(chosen) & set(BY_BRIDGE))
        raise SystemExit(
            f"{wanted} needs Megatron-Bridge, which is not installed here "
            "(pip install megatron-bridge)"
        )


def _check_nccl(device: str, ranks: int, ranks_per_node: int) -> None:
    """Refuse ``--transport nccl`` where it cannot run, before any rank starts: NCCL needs CUDA
    parameters, and refuses two ranks of one group on one GPU."""
    import torch

    if device != "cuda":
        raise SystemExit("--transport nccl needs --device cuda (NCCL carries CUDA tensors)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise SystemExit(
            "--transport nccl needs CUDA, and this machine has none "
            f"(torch {torch.__version__}: torch.cuda.is_available() is False); use --transport gloo"
        )
    leaders = range(0, ranks, ranks_per_node)
    if len({rank % gpus for rank in leaders}) < len(leaders):
        raise SystemExit(
            f"--transport nccl: the {len(leaders)} node leaders (ranks {list(leaders)}) would "
            f"share the {gpus} GPU(s) here (rank r uses GPU r % {gpus}), and NCCL refuses two "
            "ranks of a group on one GPU; use --ranks-per-node 1 with at most one rank per GPU"
        )


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _make_checkpoint(arch: str, size_gb: float, directory: Path) -> Path:
    from megastart.harness.checkpoints import make_checkpoint, scaled_config

    start = time.perf_counter()
    from megastart.bench.packed import pack_experts

    path = directory / f"{arch}-{size_gb:g}gb"
    packed = arch == PACKED_ARCH
    make_checkpoint(scaled_config("qwen3_moe" if packed else arch, int(size_gb * 1e9)), path)
    if packed:
        pack_experts(path)
    log.info(
        "generated a %g GB %s checkpoint in %.1f s", size_gb, arch, time.perf_counter() - start
    )
    return path
