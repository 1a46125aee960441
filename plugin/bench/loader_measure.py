"""How ``megastart bench loader`` measures: each strategy in a fresh world of ranks, per
page-cache condition, with the machine's limits measured next to it."""

from __future__ import annotations

import logging
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

from megastart.bench.loader_results import (
    ConditionResult,
    Layout,
    Limits,
    Machine,
    MemoryFigures,
    Sampling,
    StrategyResult,
    megastart_row,
    targets,
)

log = logging.getLogger("megastart")

BROADCAST_PROBE_BYTES = 256 * 2**20


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
    read_gbps: float | None = None,
    transport: str = "gloo",
) -> list[ConditionResult]:
    """Run the limits and every strategy, once per page-cache condition; one result per
    condition. ``read_gbps`` caps each process's reads of the files; ``transport`` is
    megastart's between node leaders (with ``nccl``, its broadcast limit is measured too)."""
    from megastart.bench.baselines import checkpoint_files
    from megastart.bench.packed import is_packed
    from megastart.loader.checkpoint import read_metadata

    meta = read_metadata(checkpoint, allow_pickle=False)
    files = checkpoint_files(meta)
    samples = _LimitSamples.start(files, page_caches)
    probe = min(BROADCAST_PROBE_BYTES, samples.checkpoint_bytes)
    options: dict[str, Any] = {"transport": transport, "progress": False, "timeout_s": timeout_s}
    if bucket_mb is not None:
        options["bucket_mb"] = bucket_mb
    ranks_per_node = ranks_per_node or layout.ranks
    results = {
        condition: _condition(
            condition,
            meta,
            checkpoint,
            layout,
            options,
            checkpoint_bytes=samples.checkpoint_bytes,
            files=len(files),
            device=device,
            ranks_per_node=ranks_per_node,
            read_gbps=read_gbps,
        )
        for condition in page_caches
    }
    for name in strategies:
        measured, *probes = _measure_strategy(
            name,
            checkpoint,
            layout,
            options,
            before_load=samples.before_read,
            reads=samples.measure_reads,
            probe_bytes=probe,
            repeats=repeats,
            sample_s=sample_s,
            timeout_s=timeout_s,
            device=device,
            ranks_per_node=ranks_per_node,
            read_gbps=read_gbps,
            packed=is_packed(meta.tensors),
        )
        samples.add(*probes)
        for condition, result in measured.items():
            _log(name, condition, result)
            results[condition].strategies[name] = result
    for condition, run in results.items():
        _conclude(run, samples.limits(condition, probe))
    return [results[condition] for condition in page_caches]


def _condition(
    condition: str,
    meta: Any,
    checkpoint: Path,
    layout: Layout,
    options: dict[str, Any],
    *,
    checkpoint_bytes: int,
    files: int,
    device: str,
    ranks_per_node: int,
    read_gbps: float | None,
) -> ConditionResult:
    """One page-cache condition's result, before any strategy ran."""
    return ConditionResult(
        page_cache=condition,
        architecture=meta.architectures[0] if meta.architectures else None,
        layout=layout,
        device=device,
        ranks_per_node=ranks_per_node,
        checkpoint=str(checkpoint),
        checkpoint_bytes=checkpoint_bytes,
        checkpoint_tensors=len(meta.tensors),
        checkpoint_files=files,
        machine=Machine(
            cpus=os.cpu_count(),
            platform=platform.platform(),
            load_average_at_start=os.getloadavg()[0],
        ),
        megastart_settings=options,
        read_gbps=read_gbps,
    )


@dataclass(kw_only=True, slots=True)
class _LimitSamples:
    """The limits, measured next to every strategy (reads here, broadcasts in its world):
    the machine is shared, and a limit is what it can do at best, so the best is kept."""

    files: list[str]
    checkpoint_bytes: int
    cached_read: tuple[int, float]
    """Bytes and seconds of one read of the files from the page cache."""
    reads: dict[str, list[tuple[int, float]]]
    """Per page-cache condition, bytes and seconds of each read of the files."""
    before_read: dict[str, Callable[[], None]]
    """Per page-cache condition, what runs before each load and read: cold drops the files."""
    broadcasts: list[float] = field(default_factory=list)
    links: list[float] = field(default_factory=list)
    nccl: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, files: list[str], page_caches: tuple[str, ...]) -> _LimitSamples:
        """Every strategy starts from the same state: the files cached, or dropped before each
        load. The first read caches them (with --checkpoint they may come off the storage);
        the second is the page cache's speed, which the cold runs' warning compares against."""
        from megastart.bench import limits

        limits.read_throughput(files)
        return cls(
            files=files,
            checkpoint_bytes=sum(os.path.getsize(f) for f in files),
            cached_read=limits.read_throughput(files),
            reads={condition: [] for condition in page_caches},
            before_read={
                condition: partial(limits.drop_from_page_cache, files)
                if condition == "cold"
                else _keep_cached
                for condition in page_caches
            },
        )

    def measure_reads(self, condition: str) -> None:
        """Three reads of the files in ``condition`` (cold: each after dropping them)."""
        from megastart.bench import limits

        for _ in range(3):
            self.before_read[condition]()
            self.reads[condition].append(limits.read_throughput(self.files))

    def add(self, broadcast_s: float, link_gbps: float, nccl_s: float) -> None:
        self.broadcasts.append(broadcast_s)
        self.links.append(link_gbps)
        self.nccl += [nccl_s] if nccl_s > 0 else []

    def limits(self, condition: str, probe: int) -> Limits:
        read_bytes, read_s = min(self.reads[condition], key=lambda r: r[1])
        broadcast_s, nccl, size = min(self.broadcasts), self.nccl, self.checkpoint_bytes
        return Limits(
            read_gbps=read_bytes / read_s / 1e9,
            broadcast_gbps=probe / broadcast_s / 1e9,
            read_s=size / (read_bytes / read_s),
            broadcast_s=size / (probe / broadcast_s),
            broadcast_probe_bytes=probe,
            measurements=len(self.reads[condition]),
            page_cache_read_gbps=self.cached_read[0] / self.cached_read[1] / 1e9,
            host_to_device_gbps=max(self.links),
            nccl_broadcast_gbps=probe / min(nccl) / 1e9 if nccl else 0.0,
            nccl_broadcast_s=size * min(nccl) / probe if nccl else 0.0,
        )


def _log(name: str, condition: str, result: StrategyResult) -> None:
    log.info(
        "%s, page cache %s: %.2f s, node peak %.2f GB, transient %.2f GB",
        name,
        condition,
        result.wall_s,
        result.node_peak_bytes / 1e9,
        result.transient_bytes / 1e9,
    )


def _conclude(run: ConditionResult, limits: Limits) -> None:
    """A condition's limits, load at the end, weights compared with megastart's, targets."""
    run.limits = limits
    run.machine.load_average_at_end = os.getloadavg()[0]
    reference = run.strategies[megastart_row(run.strategies)].checksums
    for result in run.strategies.values():
        result.weights_match_megastart = result.checksums == reference
    run.targets = targets(run)


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
    read_gbps: float | None,
    packed: bool,
) -> tuple[dict[str, StrategyResult], float, float, float]:
    """One strategy in a fresh world, so no strategy inherits another's heap or state.

    Per page-cache condition (the keys of ``before_load``, which runs before each
    load: dropping the page cache, or nothing): ``reads(condition)`` measures
    the read limit next to it; the first load measures memory, with the sampler
    reading every rank's full PSS as often as it can; then ``repeats`` loads
    into the same model measure time, with no sampler competing for the CPU,
    and their median is reported (the machine is shared: the median is what a
    load takes, the fastest what it takes undisturbed; the JSON has every run).
    The conditions share the world: starting one costs more than all of a small
    checkpoint's loads. Also returns the fastest of three gloo broadcasts of
    ``probe_bytes`` in this world, in seconds, and with CUDA parameters the link's
    rate (page-locked memory into rank 0's GPU, GB/s; else 0.0), and with
    ``options["transport"] == "nccl"`` the fastest of three NCCL broadcasts of
    ``probe_bytes`` between the node leaders, in seconds (else 0.0).
    """
    from megastart.bench import limits, strategies
    from megastart.harness.launch import RankPool

    measured = {}
    nodes = partial(_local_rank, ranks_per_node)
    with RankPool(layout.ranks, timeout_s=timeout_s, env=nodes) as pool:
        pids = pool.run(os.getpid)
        broadcast_s = max(pool.run(limits.broadcast_throughput, probe_bytes))
        nccl_s = (
            max(pool.run(limits.leader_broadcast_throughput, probe_bytes, ranks_per_node))
            if options["transport"] == "nccl"
            else 0.0
        )
        pool.run(strategies.build_model, str(checkpoint), asdict(layout), device)
        link_gbps = (
            max(pool.run(limits.host_to_device_throughput, probe_bytes))
            if device == "cuda"
            else 0.0
        )
        for condition, before in before_load.items():
            reads(condition)
            load = partial(strategies.load, name, str(checkpoint), options, read_gbps)
            memory = _measure_memory(pool, pids, load, sample_s, before)
            walls = []
            for _ in range(repeats):
                pool.run(strategies.settle)
                before()
                per_rank = pool.run(load)
                walls.append(max(r["wall_s"] for r in per_rank))
            measured[condition] = StrategyResult(
                implementation=strategies.implementation(name, packed=packed),
                wall_s=statistics.median(walls),
                wall_s_runs=walls,
                checksums=pool.run(strategies.checksum),
                **{f.name: getattr(memory, f.name) for f in fields(memory)},
            )
        pool.run(strategies.teardown)
    return measured, broadcast_s, link_gbps, nccl_s


def _measure_memory(
    pool: Any,
    pids: list[int],
    load: Callable[[], dict[str, Any]],
    sample_s: float,
    before_load: Callable[[], None],
) -> MemoryFigures:
    """One ``load`` (a rank function) with the node's PSS sampled throughout and the ranks'
    kernel peak RSS."""
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
        per_rank = pool.run(load)
    rank_peaks = [peak_rss_bytes(pid) for pid in pids]
    pool.run(strategies.settle)
    steady = node_pss_bytes(pids)
    rank_transient = sum(peak - rss_bytes(pid) for peak, pid in zip(rank_peaks, pids, strict=True))
    return MemoryFigures(
        node_peak_bytes=sampler.peak_bytes,
        transient_bytes=max(sampler.peak_bytes - steady, 0),
        steady_bytes=steady,
        rank_peaks_transient_bytes=max(rank_transient, 0),
        bytes_read=sum(r["bytes_read"] for r in per_rank),
        bytes_between_nodes=sum(r["bytes_between_nodes"] for r in per_rank),
        gpu_peak_extra_bytes=sum(r["gpu_peak_extra_bytes"] for r in per_rank),
        sampler=Sampling(
            samples=sampler.samples,
            mean_period_ms=sampler.mean_period_s * 1e3,
            cpu_share=sampler.cpu_share,
        ),
    )


def _local_rank(ranks_per_node: int, rank: int) -> dict[str, str]:
    """A rank's environment on simulated nodes of ``ranks_per_node`` consecutive ranks."""
    return {"LOCAL_RANK": str(rank % ranks_per_node), "LOCAL_WORLD_SIZE": str(ranks_per_node)}


def _keep_cached() -> None:
    """``before_load`` of the warm runs: the files stay in the page cache."""
