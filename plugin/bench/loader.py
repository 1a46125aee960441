"""Load one random HF checkpoint into one Megatron layout with megastart's loader and
with the strategies users have today, in one run, on this machine:

  every_rank_full  every rank materialises the whole checkpoint, then copies its
                   slices (verl's legacy loader);
  stage_reader     tensor-parallel rank 0 of each pipeline stage reads the whole
                   stage, then scatters the TP shards (mbridge's default);
  mmap_slices      every rank mmaps the files and reads only its own slices
                   (AReaL's loader).

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
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

log = logging.getLogger("megastart")

HELP = "megastart's loader against every-rank, stage-reader and mmap-slice loading"

STRATEGIES = ("megastart", "megastart_shm", "every_rank_full", "stage_reader", "mmap_slices")

TARGETS = {
    "bytes_read_vs_checkpoint": "megastart's bytes read = the checkpoint's size",
    "transient_below_every_rank_full": "megastart's transient node memory >= 8x below every_rank_full's",
    "transient_vs_mmap_slices": "megastart's transient node memory <= mmap_slices'",
    "wall_vs_fastest": "megastart's wall time <= {bound}x the fastest strategy's",
}

WALL_VS_FASTEST = {"cold": 1.2, "warm": 1.5}
"""The wall-time target against the fastest strategy, per page-cache condition."""

BROADCAST_PROBE_BYTES = 256 * 2**20

PAGE_CACHE = {
    "cold": "dropped before every load and every read of the limits (POSIX_FADV_DONTNEED)",
    "warm": "the files read once before anything is measured, so they are cached throughout",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="world size (default: 4)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default: 2)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (MoE architectures)"
    )
    parser.add_argument("--arch", default="qwen2", help="model architecture (default: qwen2)")
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
        "--size-gb", type=float, default=1.0, help="checkpoint size to generate, in GB (default: 1)"
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="load this HF checkpoint instead of generating one (--arch/--size-gb ignored)",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated subset of {','.join(STRATEGIES)} (megastart is always run)",
    )
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=None,
        help="megastart's rank0_loader.bucket_mb (default: the loader's default)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed loads per strategy, after the one that measures memory; the fastest is reported",
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
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="write the generated checkpoint here and keep it (default: a temporary directory)",
    )


@dataclass(kw_only=True, slots=True)
class Layout:
    ranks: int
    tp: int
    pp: int
    vpp: int | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        if self.ranks % (self.tp * self.pp):
            raise ValueError(
                f"--ranks {self.ranks} is not a multiple of --tp {self.tp} x --pp {self.pp}"
            )
        if (self.ranks // self.pp) % (self.ep * self.tp):
            raise ValueError(
                f"--ep {self.ep} x --tp {self.tp} (experts are also split over TP) must divide the "
                f"ranks of one pipeline stage ({self.ranks // self.pp}): use --pp 1 or "
                f"--ranks {self.pp * self.ep * self.tp}"
            )

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        if self.vpp:
            parts.insert(2, f"VPP{self.vpp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        return f"{self.ranks} ranks = " + " x ".join(parts)


@dataclass(kw_only=True, slots=True)
class StrategyResult:
    implementation: str
    wall_s: float
    wall_s_runs: list[float]
    node_peak_bytes: int
    transient_bytes: int
    steady_bytes: int
    rank_peaks_transient_bytes: int
    """Sum over the ranks of (kernel peak RSS during the load - RSS after it): a bound
    that no sampling gap can miss, but that counts shared pages once per rank."""
    bytes_read: int
    bytes_between_nodes: int
    """What megastart's readers sent to other nodes (0 for the baselines, which read files)."""
    gpu_peak_extra_bytes: int
    """Sum over the ranks of the GPU memory the load allocated beyond the parameters (peak)."""
    checksums: list[str]
    weights_match_megastart: bool = True
    sampler: dict[str, float] = field(default_factory=dict)


def run(args: argparse.Namespace) -> int:
    layout = Layout(ranks=args.ranks, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep)
    if args.ranks_per_node is not None and (
        args.ranks_per_node < 1 or args.ranks % args.ranks_per_node
    ):
        raise SystemExit(f"--ranks-per-node {args.ranks_per_node} must divide --ranks {args.ranks}")
    chosen = _chosen_strategies(args.strategies)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
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
        )
    results = runs[0]
    for other in runs[1:]:
        results[other["page_cache"]] = other
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
        f"{name} ({r['page_cache']} page cache)"
        for r in runs
        for name, s in r["strategies"].items()
        if not s["weights_match_megastart"]
    ]
    if mismatched:
        print(f"\nweights differ from megastart's: {', '.join(mismatched)}")
    return 1 if mismatched else 0


def measure(
    checkpoint: Path,
    layout: Layout,
    strategies: tuple[str, ...],
    *,
    page_caches: tuple[str, ...] = ("warm",),
    bucket_mb: int | None = None,
    repeats: int = 1,
    sample_s: float = 0.02,
    timeout_s: float = 600.0,
    device: str = "cpu",
    ranks_per_node: int | None = None,
) -> list[dict[str, Any]]:
    """Run the limits and every strategy, once per page-cache condition; the results as
    plain data, one dict per condition (the ``--json`` output)."""
    from megastart.bench import limits
    from megastart.bench.strategies import checkpoint_files
    from megastart.loader.checkpoint import read_metadata

    meta = read_metadata(checkpoint, allow_pickle=False)
    files = checkpoint_files(meta)
    checkpoint_bytes = sum(os.path.getsize(f) for f in files)
    # Every strategy starts from the same state: the files cached, or dropped before each load.
    # The first read caches them (with --checkpoint they may come off the storage); the
    # second is the page cache's speed, which the cold runs' warning compares against.
    limits.read_throughput(files)
    cached_read = limits.read_throughput(files)
    before_read: dict[str, Callable[[], None]] = {
        condition: partial(limits.drop_from_page_cache, files)
        if condition == "cold"
        else _keep_cached
        for condition in page_caches
    }
    probe = min(BROADCAST_PROBE_BYTES, checkpoint_bytes)
    options = {"transport": "gloo", "progress": False, "timeout_s": timeout_s}
    if bucket_mb is not None:
        options["bucket_mb"] = bucket_mb
    results = {
        condition: {
            "page_cache": condition,
            "architecture": meta.architectures[0] if meta.architectures else None,
            "layout": asdict(layout) | {"dp": layout.dp},
            "device": device,
            "ranks_per_node": ranks_per_node or layout.ranks,
            "checkpoint": str(checkpoint),
            "checkpoint_bytes": checkpoint_bytes,
            "checkpoint_tensors": len(meta.tensors),
            "checkpoint_files": len(files),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "load_average_at_start": os.getloadavg()[0],
            },
            "megastart_settings": options,
            "strategies": {},
        }
        for condition in page_caches
    }
    # The limits are measured next to every strategy (reads here, broadcasts in its world)
    # and the best kept: the machine is shared, and a limit is what it can do at best.
    reads: dict[str, list[tuple[int, float]]] = {condition: [] for condition in page_caches}
    broadcasts: list[float] = []

    def measure_reads(condition: str) -> None:
        for _ in range(3):
            before_read[condition]()
            reads[condition].append(limits.read_throughput(files))

    for name in strategies:
        measured, broadcast_s = _measure_strategy(
            name,
            checkpoint,
            layout,
            options,
            before_load=before_read,
            reads=measure_reads,
            probe_bytes=probe,
            repeats=repeats,
            sample_s=sample_s,
            timeout_s=timeout_s,
            device=device,
            ranks_per_node=ranks_per_node or layout.ranks,
        )
        broadcasts.append(broadcast_s)
        for condition, result in measured.items():
            log.info(
                "%s, page cache %s: %.2f s, node peak %.2f GB, transient %.2f GB",
                name,
                condition,
                result.wall_s,
                result.node_peak_bytes / 1e9,
                result.transient_bytes / 1e9,
            )
            results[condition]["strategies"][name] = asdict(result)
    broadcast_s = min(broadcasts)
    for condition, run in results.items():
        read_bytes, read_s = min(reads[condition], key=lambda r: r[1])
        run["limits"] = {
            "read_gbps": read_bytes / read_s / 1e9,
            "broadcast_gbps": probe / broadcast_s / 1e9,
            "read_s": checkpoint_bytes / (read_bytes / read_s),
            "broadcast_s": checkpoint_bytes / (probe / broadcast_s),
            "broadcast_probe_bytes": probe,
            "measurements": len(reads[condition]),
            "page_cache_read_gbps": cached_read[0] / cached_read[1] / 1e9,
        }
        run["machine"]["load_average_at_end"] = os.getloadavg()[0]
        reference = run["strategies"]["megastart"]["checksums"]
        for result in run["strategies"].values():
            result["weights_match_megastart"] = result["checksums"] == reference
        run["targets"] = _targets(run)
    return [results[condition] for condition in page_caches]


def _measure_strategy(
    name: str,
    checkpoint: Path,
    layout: Layout,
    options: dict[str, Any],
    *,
    before_load: dict[str, Callable[[], None]],
    reads: Callable[[str], None],
    probe_bytes: int,
    repeats: int,
    sample_s: float,
    timeout_s: float,
    device: str,
    ranks_per_node: int,
) -> tuple[dict[str, StrategyResult], float]:
    """One strategy in a fresh world, so no strategy inherits another's heap or state.

    Per page-cache condition (the keys of ``before_load``, which runs before each
    load: dropping the page cache, or nothing): ``reads(condition)`` measures
    the read limit next to it; the first load measures memory, with the sampler
    reading every rank's full PSS as often as it can; then ``repeats`` loads
    into the same model measure time, with no sampler competing for the CPU,
    and the fastest is reported (the one other processes on the machine
    disturbed least). The conditions share the world: starting one costs more
    than all of a small checkpoint's loads. Also returns the fastest of three
    gloo broadcasts of ``probe_bytes`` in this world, in seconds.
    """
    from megastart.bench import limits, strategies
    from megastart.harness.launch import RankPool

    measured = {}
    nodes = partial(_local_rank, ranks_per_node)
    with RankPool(layout.ranks, timeout_s=timeout_s, env=nodes) as pool:
        pids = pool.run(os.getpid)
        broadcast_s = max(pool.run(limits.broadcast_throughput, probe_bytes))
        pool.run(strategies.build_model, str(checkpoint), asdict(layout), device)
        for condition, before in before_load.items():
            reads(condition)
            memory = _measure_memory(pool, pids, name, str(checkpoint), options, sample_s, before)
            walls = []
            for _ in range(repeats):
                pool.run(strategies.settle)
                before()
                per_rank = pool.run(strategies.load, name, str(checkpoint), options)
                walls.append(max(r["wall_s"] for r in per_rank))
            measured[condition] = StrategyResult(
                implementation=strategies.IMPLEMENTATIONS[name],
                wall_s=min(walls),
                wall_s_runs=walls,
                checksums=pool.run(strategies.checksum),
                **memory,
            )
        pool.run(strategies.teardown)
    return measured, broadcast_s


def _measure_memory(
    pool: Any,
    pids: list[int],
    name: str,
    checkpoint: str,
    options: dict[str, Any],
    sample_s: float,
    before_load: Callable[[], None],
) -> dict[str, Any]:
    """One load with the node's PSS sampled throughout and the ranks' kernel peak RSS."""
    from megastart.bench import strategies
    from megastart.bench.memory import (
        PssSampler,
        node_pss_bytes,
        peak_rss_bytes,
        reset_peak_rss,
        rss_bytes,
    )

    pool.run(strategies.settle)
    before_load()
    for pid in pids:
        reset_peak_rss(pid)
    with PssSampler(pids, period_s=sample_s, file_every=1) as sampler:
        per_rank = pool.run(strategies.load, name, checkpoint, options)
    rank_peaks = [peak_rss_bytes(pid) for pid in pids]
    pool.run(strategies.settle)
    steady = node_pss_bytes(pids)
    rank_transient = sum(peak - rss_bytes(pid) for peak, pid in zip(rank_peaks, pids, strict=True))
    return {
        "node_peak_bytes": sampler.peak_bytes,
        "transient_bytes": max(sampler.peak_bytes - steady, 0),
        "steady_bytes": steady,
        "rank_peaks_transient_bytes": max(rank_transient, 0),
        "bytes_read": sum(r["bytes_read"] for r in per_rank),
        "bytes_between_nodes": sum(r["bytes_between_nodes"] for r in per_rank),
        "gpu_peak_extra_bytes": sum(r["gpu_peak_extra_bytes"] for r in per_rank),
        "sampler": {
            "samples": sampler.samples,
            "mean_period_ms": sampler.mean_period_s * 1e3,
            "cpu_share": sampler.cpu_share,
        },
    }


def _local_rank(ranks_per_node: int, rank: int) -> dict[str, str]:
    """A rank's environment on simulated nodes of ``ranks_per_node`` consecutive ranks."""
    return {"LOCAL_RANK": str(rank % ranks_per_node), "LOCAL_WORLD_SIZE": str(ranks_per_node)}


def _keep_cached() -> None:
    """``before_load`` of the warm runs: the files stay in the page cache."""


def _targets(results: dict[str, Any]) -> dict[str, Any]:
    strategies = results["strategies"]
    ours = strategies["megastart"]
    fastest = min(s["wall_s"] for s in strategies.values())
    wall_bound = WALL_VS_FASTEST[results["page_cache"]]
    ratios: dict[str, tuple[float, str, float]] = {
        "bytes_read_vs_checkpoint": (ours["bytes_read"] / results["checkpoint_bytes"], "==", 1.0),
        "wall_vs_fastest": (ours["wall_s"] / fastest, "<=", wall_bound),
    }
    if "every_rank_full" in strategies:
        below = strategies["every_rank_full"]["transient_bytes"] / max(ours["transient_bytes"], 1)
        ratios["transient_below_every_rank_full"] = (below, ">=", 8.0)
    if "mmap_slices" in strategies:
        versus = ours["transient_bytes"] / max(strategies["mmap_slices"]["transient_bytes"], 1)
        ratios["transient_vs_mmap_slices"] = (versus, "<=", 1.0)
    out = {}
    for key, (value, op, bound) in ratios.items():
        met = {
            "==": abs(value - bound) < 0.01,
            "<=": value <= bound,
            ">=": value >= bound,
        }[op]
        what = TARGETS[key].format(bound=f"{bound:g}")
        out[key] = {"value": value, "target": f"{op} {bound:g}", "met": met, "what": what}
    return out


def render(results: dict[str, Any]) -> str:
    """The human-readable report: one table, the limits, the targets, how it was measured."""
    gb = 1e9
    layout = Layout(**{k: v for k, v in results["layout"].items() if k != "dp"})
    lim = results["limits"]
    strategies = results["strategies"]
    ours = strategies["megastart"]
    cold = results["page_cache"] == "cold"
    cuda = results["device"] == "cuda"
    nodes = layout.ranks // results["ranks_per_node"]
    where = (
        f"{nodes} simulated nodes of {results['ranks_per_node']} ranks" if nodes > 1 else "one node"
    )
    lines = [
        f"megastart bench loader, page cache {results['page_cache']} "
        f"({PAGE_CACHE[results['page_cache']]}) — {results['architecture']}, "
        f"{results['checkpoint_bytes'] / gb:.2f} GB checkpoint "
        f"({results['checkpoint_tensors']} tensors in {results['checkpoint_files']} files), "
        f"{layout.describe()} on {where}, {'CUDA' if cuda else 'CPU'} parameters, "
        f"{results['machine']['cpus']} CPU cores "
        f"(load average {results['machine']['load_average_at_start']:.1f} at the start, "
        f"{results['machine']['load_average_at_end']:.1f} at the end)",
        "",
        f"{'strategy':<16} {'wall s':>7} {'x ms':>6} {'node peak GB':>13} {'transient GB':>13} "
        f"{'x ms':>6} {'rank peaks GB':>14} {'read GB':>8} {'x ckpt':>7}"
        + (f" {'GPU extra GB':>13}" if cuda else "")
        + "  weights = megastart",
    ]
    for name, s in strategies.items():
        lines.append(
            f"{name:<16} {s['wall_s']:>7.2f} {s['wall_s'] / ours['wall_s']:>6.2f} "
            f"{s['node_peak_bytes'] / gb:>13.2f} {s['transient_bytes'] / gb:>13.3f} "
            f"{s['transient_bytes'] / max(ours['transient_bytes'], 1):>6.1f} "
            f"{s['rank_peaks_transient_bytes'] / gb:>14.3f} "
            f"{s['bytes_read'] / gb:>8.2f} {s['bytes_read'] / results['checkpoint_bytes']:>7.2f}"
            + (f" {s['gpu_peak_extra_bytes'] / gb:>13.3f}" if cuda else "")
            + f"  {'yes' if s['weights_match_megastart'] else 'NO'} ({len(s['checksums'])} ranks)"
        )
    if nodes > 1:
        lines += [
            "",
            f"megastart sent {ours['bytes_between_nodes'] / gb:.3f} GB between the nodes "
            f"({ours['bytes_between_nodes'] / results['checkpoint_bytes']:.2f}x the checkpoint): "
            "each bucket once to each other node that needs it.",
        ]
    lines += [
        "",
        "x ms: ratio to megastart's figure. Limits measured in this run (the best of "
        f"{lim['measurements']} reads and {lim['measurements']} broadcasts, taken next to the"
        " strategies): one reader "
        f"reads the files {'off the storage ' if cold else ''}at {lim['read_gbps']:.2f} GB/s "
        f"({lim['read_s']:.2f} s for the checkpoint; from the page cache "
        f"{lim['page_cache_read_gbps']:.2f} GB/s);"
        f" gloo broadcasts {lim['broadcast_probe_bytes'] / 2**20:.0f} MiB to {layout.ranks} ranks at "
        f"{lim['broadcast_gbps']:.2f} GB/s "
        f"({lim['broadcast_s']:.2f} s for the checkpoint).",
        "",
        "targets (reported, not asserted):",
    ]
    if cold and lim["read_gbps"] > 0.5 * lim["page_cache_read_gbps"]:
        lines[-2:-2] = [
            "",
            "WARNING: reads after dropping the page cache ran at more than half the speed of "
            "cached ones: this file system may ignore POSIX_FADV_DONTNEED (tmpfs does), so the "
            "'cold' figures may be warm ones; put the checkpoint on a disk (--workdir).",
        ]
    for target in results["targets"].values():
        lines.append(
            f"  {'met    ' if target['met'] else 'NOT met'}  {target['value']:7.3f} {target['target']:<7} "
            f"{target['what']}"
        )
    lines += ["", "implementations:"]
    lines += [f"  {name:<16} {s['implementation']}" for name, s in strategies.items()]
    samplers = [s["sampler"] for s in strategies.values()]
    lines += [
        "",
        "how it was measured:",
        "  wall s       each rank times its load between a barrier before and one after; the slowest"
        " rank's time; the fastest of --repeats loads (all in the JSON's wall_s_runs), which run"
        " after the load that measures memory, with no sampler running;",
        "  node peak    the highest sum over the ranks of PSS (/proc/<pid>/smaps_rollup), sampled by"
        " a thread of the benchmark every "
        f"{min(s['mean_period_ms'] for s in samplers):.0f}-{max(s['mean_period_ms'] for s in samplers):.0f} ms"
        " (the kernel walks the page tables for each read; the thread used"
        f" {max(s['cpu_share'] for s in samplers):.0%} of a core at most), during one load;",
        "  transient    node peak minus the node's PSS after the load, once every rank ran"
        " gc.collect() and malloc_trim(0);",
        "  rank peaks   sum over the ranks of the kernel's peak RSS during the load (VmHWM, reset"
        " before it) minus RSS after it: no sampling gap can hide a peak from it, but it counts"
        " pages the ranks share once per rank and adds peaks that need not coincide;",
        "  GPU extra    (--device cuda) sum over the ranks of torch.cuda.max_memory_allocated during"
        " the load minus the allocation before it;",
        "  bytes read   bytes copied out of the checkpoint files, counted in each strategy's read"
        " path (megastart: its LoadReport.bytes_read), summed over the ranks."
        " /proc/<pid>/io is not used: read_bytes misses what the page cache served (on one node"
        " the ranks share it), rchar misses mmap reads and counts gloo's socket traffic.",
    ]
    return "\n".join(lines)


def _chosen_strategies(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"--strategies: unknown {unknown}; choose from {', '.join(STRATEGIES)}")
    return tuple(n for n in STRATEGIES if n == "megastart" or n in names)


def _make_checkpoint(arch: str, size_gb: float, directory: Path) -> Path:
    from megastart.harness.checkpoints import make_checkpoint, scaled_config

    start = time.perf_counter()
    path = directory / f"{arch}-{size_gb:g}gb"
    make_checkpoint(scaled_config(arch, int(size_gb * 1e9)), path)
    log.info(
        "generated a %g GB %s checkpoint in %.1f s", size_gb, arch, time.perf_counter() - start
    )
    return path
