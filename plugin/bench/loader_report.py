"""The report of ``megastart bench loader``: one table per page-cache condition, the limits
measured next to it, the targets, and how each figure was measured."""

from __future__ import annotations

from megastart.bench.loader_results import (
    ConditionResult,
    bucket_bytes,
    link_share,
    megastart_row,
    megastart_rows,
)

PAGE_CACHE = {
    "cold": "dropped before every load and every read of the limits (POSIX_FADV_DONTNEED)",
    "warm": "the files read once before anything is measured, so they are cached throughout",
}


def render(run: ConditionResult) -> str:
    """The human-readable report: one table, the limits, the targets, how it was measured."""
    return "\n".join(
        [
            *_table(run),
            *_traffic(run),
            *_limits(run),
            *_targets(run),
            *_implementations(run),
            *_how_measured(run),
        ]
    )


def _table(run: ConditionResult) -> list[str]:
    """The heading and one row per strategy."""
    gb = 1e9
    layout = run.layout
    strategies = run.strategies
    ours = strategies[megastart_row(strategies)]
    cuda = run.device == "cuda"
    nodes = layout.ranks // run.ranks_per_node
    where = f"{nodes} simulated nodes of {run.ranks_per_node} ranks" if nodes > 1 else "one node"
    lines = [
        f"megastart bench loader, page cache {run.page_cache} "
        f"({PAGE_CACHE[run.page_cache]}) — {run.architecture}, "
        f"{run.checkpoint_bytes / gb:.2f} GB checkpoint "
        f"({run.checkpoint_tensors} tensors in {run.checkpoint_files} files), "
        f"{layout.describe()} on {where}, {'CUDA' if cuda else 'CPU'} parameters, "
        f"{run.machine.cpus} CPU cores "
        f"(load average {run.machine.load_average_at_start:.1f} at the start, "
        f"{run.machine.load_average_at_end:.1f} at the end)",
        "",
        f"{'strategy':<19} {'wall s':>7} {'x ms':>6} {'node peak GB':>13} {'transient GB':>13} "
        f"{'x ms':>6} {'rank peaks GB':>14} {'read GB':>8} {'x ckpt':>7}"
        + (f" {'GPU extra GB':>13} {'GB/s':>6} {'x link':>6}" if cuda else "")
        + "  weights = megastart",
    ]
    for name, s in strategies.items():
        lines.append(
            f"{name:<19} {s.wall_s:>7.2f} {s.wall_s / ours.wall_s:>6.2f} "
            f"{s.node_peak_bytes / gb:>13.2f} {s.transient_bytes / gb:>13.3f} "
            f"{s.transient_bytes / max(ours.transient_bytes, 1):>6.1f} "
            f"{s.rank_peaks_transient_bytes / gb:>14.3f} "
            f"{s.bytes_read / gb:>8.2f} {s.bytes_read / run.checkpoint_bytes:>7.2f}"
            + (
                f" {s.gpu_peak_extra_bytes / gb:>13.3f} {run.checkpoint_bytes / s.wall_s / gb:>6.1f}"
                f" {link_share(run, s.wall_s):>6.2f}"
                if cuda
                else ""
            )
            + f"  {'yes' if s.weights_match_megastart else 'NO'} ({len(s.checksums)} ranks)"
        )
    return lines


def _traffic(run: ConditionResult) -> list[str]:
    """What crossed between the simulated nodes, the bridge's memory, the capped reads."""
    gb = 1e9
    strategies = run.strategies
    reference = megastart_row(strategies)
    ours = strategies[reference]
    lines: list[str] = []
    if run.layout.ranks // run.ranks_per_node > 1:
        lines.append("")
        for name in megastart_rows(strategies):
            sent = strategies[name].bytes_between_nodes
            lines.append(
                f"{name} sent {sent / gb:.3f} GB between the nodes "
                f"({sent / run.checkpoint_bytes:.2f}x the checkpoint): "
                "each bucket once to each other node that needs it."
            )
    bridge = strategies.get("bridge")
    if bridge is not None:
        lines += [
            "",
            f"transient memory per node: bridge {bridge.transient_bytes / gb:.3f} GB, "
            f"{reference} {ours.transient_bytes / gb:.3f} GB "
            f"({ours.transient_bytes / bucket_bytes(run):.1f} buckets of "
            f"{bucket_bytes(run) / 2**20:g} MiB); the bridge's is "
            f"{bridge.transient_bytes / max(ours.transient_bytes, 1):.1f}x megastart's.",
        ]
    if run.read_gbps:
        lines += [
            "",
            f"--read-gbps {run.read_gbps:g}: every process's reads of the files were capped at "
            f"{run.read_gbps:g} GB/s, as a parallel file system caps each client (one reader "
            f"needs {run.checkpoint_bytes / gb / run.read_gbps:.2f} s for the checkpoint).",
        ]
    return lines


def _limits(run: ConditionResult) -> list[str]:
    """The limits measured in this run next to the strategies."""
    gb = 1e9
    layout = run.layout
    lim = run.limits
    assert lim is not None
    reference = megastart_row(run.strategies)
    cold = run.page_cache == "cold"
    lines: list[str] = []
    lines += [
        "",
        f"x ms: ratio to {reference}'s figure. Limits measured in this run (the best of "
        f"{lim.measurements} reads and {lim.measurements} broadcasts, taken next to the"
        " strategies): one reader "
        f"reads the files {'off the storage ' if cold else ''}at {lim.read_gbps:.2f} GB/s "
        f"({lim.read_s:.2f} s for the checkpoint; from the page cache "
        f"{lim.page_cache_read_gbps:.2f} GB/s);"
        f" gloo broadcasts {lim.broadcast_probe_bytes / 2**20:.0f} MiB to {layout.ranks} ranks at "
        f"{lim.broadcast_gbps:.2f} GB/s "
        f"({lim.broadcast_s:.2f} s for the checkpoint).",
    ]
    if lim.nccl_broadcast_gbps > 0:
        lines += [
            f"limit, NCCL between the {layout.ranks // run.ranks_per_node} node leaders (the "
            f"loader's --transport nccl): {lim.broadcast_probe_bytes / 2**20:.0f} MiB at "
            f"{lim.nccl_broadcast_gbps:.2f} GB/s, best of 3 ({lim.nccl_broadcast_s:.2f} s for "
            "the checkpoint).",
        ]
    if run.device == "cuda":
        lines += [
            "",
            f"limit, the link: page-locked host memory into the GPU at "
            f"{lim.host_to_device_gbps:.1f} GB/s, measured in this run (rank 0's GPU, "
            f"{lim.broadcast_probe_bytes / 2**20:.0f} MiB, best of 3): the checkpoint in "
            f"{run.checkpoint_bytes / gb / max(lim.host_to_device_gbps, 1e-9):.2f} s. GB/s: "
            "checkpoint bytes / wall; x link: that / the link's rate (every rank here shares "
            f"one GPU's link). megastart's page-locked staging: {staging_text(run)}.",
        ]
    return lines


def _targets(run: ConditionResult) -> list[str]:
    """Each target, met or not; first a warning where the cold figures may be warm ones."""
    lim = run.limits
    assert lim is not None
    lines: list[str] = []
    if run.page_cache == "cold" and lim.read_gbps > 0.5 * lim.page_cache_read_gbps:
        lines += [
            "",
            "WARNING: reads after dropping the page cache ran at more than half the speed of "
            "cached ones: this file system may ignore POSIX_FADV_DONTNEED (tmpfs does), so the "
            "'cold' figures may be warm ones; put the checkpoint on a disk (--workdir).",
        ]
    lines += ["", "targets (reported, not asserted):"]
    for target in run.targets.values():
        lines.append(
            f"  {'met    ' if target.met else 'NOT met'}  {target.value:7.3f} {target.target:<7} "
            f"{target.what}"
        )
    return lines


def _implementations(run: ConditionResult) -> list[str]:
    strategies = run.strategies
    return [
        "",
        "implementations:",
        *(f"  {n:<19} {s.implementation}" for n, s in strategies.items()),
    ]


def _how_measured(run: ConditionResult) -> list[str]:
    samplers = [s.sampler for s in run.strategies.values()]
    return [
        "",
        "how it was measured:",
        "  wall s       each rank times its load between a barrier before and one after; the slowest"
        " rank's time; the median of --repeats loads (all in the JSON's wall_s_runs), which run"
        " after the load that measures memory, with no sampler running;",
        "  node peak    the highest sum over the ranks of PSS (/proc/<pid>/smaps_rollup), sampled by"
        " a thread of the benchmark every "
        f"{min(s.mean_period_ms for s in samplers):.0f}-{max(s.mean_period_ms for s in samplers):.0f} ms"
        " (the kernel walks the page tables for each read; the thread used"
        f" {max(s.cpu_share for s in samplers):.0%} of a core at most), during one load;",
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


def staging_text(run: ConditionResult) -> str:
    """megastart's page-locked staging per rank and on the node, as this run's layout sizes it."""
    from megastart.loader.stream.staging import CHUNK_BYTES, chunk_count, copy_threads

    per_rank = chunk_count(copy_threads(run.ranks_per_node)) * CHUNK_BYTES
    return (
        f"{per_rank / 2**20:.0f} MiB per rank ({copy_threads(run.ranks_per_node)} fill threads), "
        f"{per_rank * run.layout.ranks / 1e9:.2f} GB on the node, counted in its transient memory"
    )
