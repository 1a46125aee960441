"""What ``megastart bench loader`` measures, as typed records (the ``--json`` output is their
``asdict``), and the targets it reports against them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

TARGETS = {
    "bytes_read_vs_checkpoint": "megastart's bytes read = the checkpoint's size",
    "transient_below_every_rank_full": "megastart's transient node memory >= 8x below every_rank_full's",
    "transient_vs_mmap_slices": "megastart's transient node memory <= mmap_slices'",
    "wall_vs_fastest": "megastart's wall time <= {bound}x the fastest strategy's",
    "striped_vs_global": "megastart[striped]'s wall time <= {bound}x megastart[global]'s",
    "striped_bytes_read": "megastart[striped]'s bytes read = the checkpoint's size",
}

WALL_VS_FASTEST = {"cold": 1.2, "warm": 1.5}
"""The wall-time target against the fastest strategy, per page-cache condition."""


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
    """megastart's figures against the other strategies' (reported, not asserted)."""
    strategies = run.strategies
    ours = strategies[megastart_row(strategies)]
    fastest = min(s.wall_s for s in strategies.values())
    wall_bound = WALL_VS_FASTEST[run.page_cache]
    ratios: dict[str, tuple[float, str, float]] = {
        "bytes_read_vs_checkpoint": (ours.bytes_read / run.checkpoint_bytes, "==", 1.0),
        "wall_vs_fastest": (ours.wall_s / fastest, "<=", wall_bound),
    }
    if "every_rank_full" in strategies:
        below = strategies["every_rank_full"].transient_bytes / max(ours.transient_bytes, 1)
        ratios["transient_below_every_rank_full"] = (below, ">=", 8.0)
    if "mmap_slices" in strategies:
        versus = ours.transient_bytes / max(strategies["mmap_slices"].transient_bytes, 1)
        ratios["transient_vs_mmap_slices"] = (versus, "<=", 1.0)
    striped, one = strategies.get("megastart[striped]"), strategies.get("megastart[global]")
    if striped is not None and one is not None and run.ranks_per_node < run.layout.ranks:
        ratios["striped_vs_global"] = (striped.wall_s / one.wall_s, "<=", STRIPED_VS_GLOBAL)
        ratios["striped_bytes_read"] = (striped.bytes_read / run.checkpoint_bytes, "==", 1.0)
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
