"""What ``megastart bench loader`` measures, as typed records (the ``--json`` output is their
``asdict``), and the targets it reports against them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

TARGETS = {
    "bytes_read_vs_checkpoint": "megastart's bytes read = the checkpoint's size",
    "transient_below_every_rank_full": "megastart's transient node memory >= 8x below every_rank_full's",
    "transient_vs_mmap_slices": "megastart's transient node memory <= {bound}x mmap_slices' "
    "(page-locked staging included)",
    "wall_vs_mmap_slices": "megastart's wall time <= {bound}x mmap_slices'",
    "wall_vs_storage": "megastart's wall time <= {bound}x the storage limit (one reader)",
    "link_share": "megastart's rate into one GPU >= {bound}x the link's (checkpoint bytes / "
    "wall / page-locked host-to-device rate)",
    "striped_vs_global": "megastart[striped]'s wall time <= {bound}x megastart[global]'s",
    "striped_bytes_read": "megastart[striped]'s bytes read = the checkpoint's size",
    "transient_in_buckets": "megastart's transient node memory <= {bound} buckets "
    "(rank0_loader.bucket_mb), where the bridge's grows with the tensors it caches",
}

WARM_VS_MMAP_SLICES = {"cuda": 1.0, "cpu": 1.0, "cpu, many cores": 1.2}
"""Warm: the wall time against ``mmap_slices``' (issue #40). With CPU parameters on a node of
many cores, ``mmap_slices`` takes tens of milliseconds and the load's fixed agreement
phases count: 1.2x there."""
MANY_CORES = 8
"""A machine of more cores than this is a GPU node, for :data:`WARM_VS_MMAP_SLICES`."""
COLD_VS_STORAGE = 1.05
"""Cold, on a GPU node (CUDA parameters, or more than :data:`MANY_CORES` cores): the wall time
against the storage limit the benchmark measures (one reader). On a small machine the
cold target is ``mmap_slices``' time."""
TRANSIENT_VS_MMAP_SLICES = 0.25
"""Transient node memory against ``mmap_slices``', page-locked staging included."""
TRANSIENT_BUCKETS = 4.0
"""Transient node memory in buckets, at most: the loader keeps about three in flight."""
LINK_SHARE = 0.6
"""Warm, one rank on one GPU: checkpoint bytes / wall / the link's rate, at least."""


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

    def record(self) -> dict[str, Any]:
        """The layout as the JSON holds it (with the data-parallel size)."""
        return asdict(self) | {"dp": self.dp}


@dataclass(kw_only=True, slots=True)
class Sampling:
    """How the node's PSS was sampled during a load."""

    samples: int
    mean_period_ms: float
    cpu_share: float
    """The sampling thread's share of one core."""


@dataclass(kw_only=True, slots=True)
class MemoryFigures:
    """One load measured for memory (and what it read and sent)."""

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
    sampler: Sampling


@dataclass(kw_only=True, slots=True)
class StrategyResult(MemoryFigures):
    implementation: str
    wall_s: float
    wall_s_runs: list[float]
    checksums: list[str]
    weights_match_megastart: bool = True


@dataclass(kw_only=True, slots=True)
class Limits:
    """This machine's limits, measured next to the strategies (the best of several)."""

    read_gbps: float
    """One reader's read throughput of the checkpoint's files, in this condition."""
    broadcast_gbps: float
    read_s: float
    """The checkpoint's size at ``read_gbps``."""
    broadcast_s: float
    broadcast_probe_bytes: int
    measurements: int
    page_cache_read_gbps: float
    host_to_device_gbps: float = 0.0
    nccl_broadcast_gbps: float = 0.0
    """NCCL between the node leaders (``--transport nccl``; 0.0 otherwise)."""
    nccl_broadcast_s: float = 0.0
    """The checkpoint's size at ``nccl_broadcast_gbps``."""
    """With CUDA parameters: page-locked host memory into one GPU, best of several (the
    link's rate; 0.0 without CUDA)."""


@dataclass(kw_only=True, slots=True)
class Machine:
    cpus: int | None
    platform: str
    load_average_at_start: float
    load_average_at_end: float = 0.0


@dataclass(kw_only=True, slots=True)
class Target:
    value: float
    target: str
    met: bool
    what: str


@dataclass(kw_only=True, slots=True)
class ConditionResult:
    """Every strategy in one page-cache condition, with the limits and the targets."""

    page_cache: str
    architecture: str | None
    layout: Layout
    device: str
    ranks_per_node: int
    checkpoint: str
    checkpoint_bytes: int
    checkpoint_tensors: int
    checkpoint_files: int
    machine: Machine
    megastart_settings: dict[str, Any]
    read_gbps: float | None = None
    """Each process's cap on its reads of the files (``--read-gbps``; ``None``: none)."""
    strategies: dict[str, StrategyResult] = field(default_factory=dict)
    limits: Limits | None = None
    targets: dict[str, Target] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The ``--json`` form."""
        return asdict(self) | {"layout": self.layout.record()}


STRIPED_VS_GLOBAL = 0.35
"""The striped readers' wall time against the global reader's, on several nodes."""


def strategy_reader(name: str) -> tuple[str, str]:
    """A strategy's name and its reader setting: ``megastart[node]`` -> ``("megastart", "node")``
    (``bench loader --readers``), any other -> ``(name, "")``."""
    base, _, reader = name.partition("[")
    return base, reader.removesuffix("]")


def megastart_rows(strategies: dict[str, Any]) -> list[str]:
    """The rows of megastart's default route: ``megastart``, or one ``megastart[reader]`` per
    ``--readers`` setting."""
    return [name for name in strategies if strategy_reader(name)[0] == "megastart"]


def megastart_row(strategies: dict[str, Any]) -> str:
    """The row the others are compared with: the first of :func:`megastart_rows`."""
    return megastart_rows(strategies)[0]


def targets(run: ConditionResult) -> dict[str, Target]:
    """megastart's figures against the other strategies' and the limits (reported, not
    asserted)."""
    strategies = run.strategies
    ours = strategies[megastart_row(strategies)]
    ratios: dict[str, tuple[float, str, float]] = {
        "bytes_read_vs_checkpoint": (ours.bytes_read / run.checkpoint_bytes, "==", 1.0),
    }
    limits = run.limits
    warm = run.page_cache == "warm"
    if "every_rank_full" in strategies:
        below = strategies["every_rank_full"].transient_bytes / max(ours.transient_bytes, 1)
        ratios["transient_below_every_rank_full"] = (below, ">=", 8.0)
    mmap_slices = strategies.get("mmap_slices")
    if mmap_slices is not None:
        versus = ours.transient_bytes / max(mmap_slices.transient_bytes, 1)
        ratios["transient_vs_mmap_slices"] = (versus, "<=", TRANSIENT_VS_MMAP_SLICES)
        many = run.device == "cpu" and (run.machine.cpus or 0) > MANY_CORES
        bound = WARM_VS_MMAP_SLICES["cpu, many cores" if many else run.device] if warm else 1.0
        ratios["wall_vs_mmap_slices"] = (ours.wall_s / mmap_slices.wall_s, "<=", bound)
    gpu_node = run.device == "cuda" or (run.machine.cpus or 0) > MANY_CORES
    if not warm and limits is not None and gpu_node:
        ratios["wall_vs_storage"] = (ours.wall_s / limits.read_s, "<=", COLD_VS_STORAGE)
    if warm and run.device == "cuda" and run.layout.ranks == 1 and limits is not None:
        share = link_share(run, ours.wall_s)
        ratios["link_share"] = (share, ">=", LINK_SHARE)
    striped, one = strategies.get("megastart[striped]"), strategies.get("megastart[global]")
    if striped is not None and one is not None and run.ranks_per_node < run.layout.ranks:
        ratios["striped_vs_global"] = (striped.wall_s / one.wall_s, "<=", STRIPED_VS_GLOBAL)
        ratios["striped_bytes_read"] = (striped.bytes_read / run.checkpoint_bytes, "==", 1.0)
    if "bridge" in strategies:
        buckets = ours.transient_bytes / bucket_bytes(run)
        ratios["transient_in_buckets"] = (buckets, "<=", TRANSIENT_BUCKETS)
    out = {}
    for key, (value, op, bound) in ratios.items():
        met = {
            "==": abs(value - bound) < 0.01,
            "<=": value <= bound,
            ">=": value >= bound,
        }[op]
        what = TARGETS[key].format(bound=f"{bound:g}")
        out[key] = Target(value=value, target=f"{op} {bound:g}", met=met, what=what)
    return out


def bucket_bytes(run: ConditionResult) -> float:
    """megastart's bucket in this run, in bytes (``--bucket-mb``, else the loader's default)."""
    from megastart.loader.settings import Rank0LoaderSettings

    mb = (
        run.megastart_settings.get("bucket_mb")
        or Rank0LoaderSettings.__dataclass_fields__["bucket_mb"].default
    )
    return float(mb) * 2**20


def link_share(run: ConditionResult, wall_s: float) -> float:
    """A load's rate into the GPU as a share of the link's: checkpoint bytes / ``wall_s`` /
    the page-locked host-to-device rate measured in the same run (0.0 without one)."""
    limits = run.limits
    if limits is None or not limits.host_to_device_gbps:
        return 0.0
    return run.checkpoint_bytes / wall_s / 1e9 / limits.host_to_device_gbps
