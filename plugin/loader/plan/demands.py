"""The mapping phase across ranks: each rank maps its parameters to the checkpoint and shares
its demands (:class:`RankDemands`); rank 0, which alone receives them all
(:class:`WorldDemands`), sends every rank the :class:`Summary` it needs of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

from megastart.distributed import CollectiveError, Outcome, disagreement, node_key
from megastart.distributed.world import training_device
from megastart.loader.checkpoint import CheckpointMeta
from megastart.loader.mapping.bridge import Untranslatable
from megastart.loader.mapping.mappings import MappingTable
from megastart.loader.mapping.model import UnsupportedArchitecture, local_needs, mapping_table
from megastart.loader.mapping.needs import Demand, Need, left_to_host
from megastart.loader.plan.buckets import demands_once, distinct, packed, unused_tensors
from megastart.loader.settings import PLUGIN, Rank0LoaderSettings

Phase = Callable[..., AbstractContextManager[Outcome]]
"""A load's phase: :func:`~megastart.distributed.all_or_none` bound to its control plane."""


class RankDemands(NamedTuple):
    """What one rank tells the others when planning."""

    node: tuple[str, int]
    """Its node (:func:`~megastart.distributed.node_key`)."""
    demands: bytes
    """The HF tensors each of its parameters takes, and the parameter's dtype
    (:func:`~megastart.loader.plan.buckets.packed`: replicas send the same bytes, unpacked once)."""
    device: str
    """The device type of its parameters (``"cuda"``, ``"cpu"``)."""
    left_to_host: list[str]
    """Its parameters the load leaves as the host initialised them (canonical names)."""
    page_cache: bool
    """Whether its kernel populates mappings on request (:func:`~megastart.loader.stream.mappings.supported`)."""
    settings: dict[str, Any]
    """Its ``rank0_loader`` settings (but ``progress``), which every rank's must equal."""
    untranslatable: str = ""
    """Why the host's bridge's mapping cannot be reproduced here (``""``: it can)."""


class Summary(NamedTuple):
    """What every rank needs of the ranks' :class:`RankDemands`, from rank 0 (which alone
    receives them all, :class:`WorldDemands`): not the world's demands (9-11 MB at 8,192
    ranks), which only the reader plans with, nor every rank's node (a rank takes its own
    node's from the reports it holds, and a node leader the reader group's nodes with its
    buckets, :func:`handed_out`): the same bytes whatever the world's size."""

    nodes: int
    """How many nodes the ranks are on."""
    readers: tuple[int, ...]
    """With ``reader=node``, each node's first rank (its reader), ascending; else ``()``."""
    devices: frozenset[str]
    """The device types of every rank's parameters."""
    left_to_host: tuple[str, ...]
    """Every rank's :attr:`RankDemands.left_to_host`, sorted, once each."""
    disagreement: str | None
    """Why the ranks' settings differ (``None``: they agree)."""
    untranslatable: str
    """The first rank's :attr:`RankDemands.untranslatable` that is not ``""``."""
    unused: tuple[str, ...]
    """Checkpoint tensors no rank uses (not read)."""
    tensors: int
    """The checkpoint tensors some rank demands (for the report)."""


class WorldDemands:
    """Every rank's demands on rank 0: summarised for the others (:meth:`summarise`, the
    planning phase's ``summarise``) and kept, unpacked once, for its own planning."""

    def __init__(
        self,
        meta: CheckpointMeta,
        table: MappingTable | None,
        *,
        value_model: bool,
        fix: str,
        node_readers: bool = False,
    ) -> None:
        self.meta = meta
        self.table = table
        self.value_model = value_model
        self.fix = fix
        self.node_readers = node_readers
        """Each node reads for itself (``reader=node``): the summary names their readers."""
        self.demands: list[list[Demand]] = []
        """Every rank's, once summarised here (on rank 0; on one node, every rank)."""

    def summarise(self, reports: list[RankDemands]) -> Summary:
        self.demands = demands_once([r.demands for r in reports], self.meta)
        table = self.table if self.table is not None else known_table(self.meta)
        unused = unused_tensors(self.demands, self.meta, table, value_model=self.value_model)
        distinct_names = {n for d in distinct(self.demands) for names, _ in d for n in names}
        first: dict[tuple[str, int], int] = {}  # each node's first rank
        for rank, report in enumerate(reports):
            first.setdefault(report.node, rank)
        return Summary(
            nodes=len(first),
            readers=tuple(sorted(first.values())) if self.node_readers else (),
            devices=frozenset(r.device for r in reports),
            left_to_host=tuple(sorted({name for r in reports for name in r.left_to_host})),
            disagreement=disagreement(PLUGIN, [r.settings for r in reports], fix=self.fix),
            untranslatable=min({r.untranslatable for r in reports} - {""}, default=""),
            unused=tuple(unused),
            tensors=len(distinct_names),
        )

    def of(self, group: Sequence[int], held: dict[int, RankDemands]) -> list[list[Demand]]:
        """The demands of ``group``'s ranks: from every rank's where summarised here, else from
        those held (a group of this rank's node)."""
        if self.demands:
            return [self.demands[r] for r in group]
        return demands_once([held[r].demands for r in group], self.meta)


def known_table(meta: CheckpointMeta) -> MappingTable:
    """The built-in table of the checkpoint's architecture (its ignored tensors), or none."""
    try:
        return mapping_table(meta)
    except UnsupportedArchitecture:
        return MappingTable(meta.architectures, ())


class Mapped(NamedTuple):
    """What the mapping phase leaves this rank: its own needs, and what every rank agreed on."""

    needs: list[Need]
    tensors: dict[str, Any]
    """Its parameters' tensors, by name."""
    shard: Any
    """Its place in the parallel layout (:class:`~megastart.loader.mapping.transforms.Shard`)."""
    device: Any
    summary: Summary
    held: dict[int, RankDemands]
    """Its node's reports (every rank's on rank 0)."""
    table: MappingTable
    world: WorldDemands


def map_ranks(
    chunks: list[Any],
    meta: CheckpointMeta,
    table: MappingTable | None,
    settings: Rank0LoaderSettings,
    phase: Phase,
    *,
    value_model: bool,
    bridge: Any,
    page_cache: bool,
) -> Mapped:
    """Every rank maps its parameters to the checkpoint, in one phase; the ranks' settings
    are agreed in its summary (one collective less before any bulk transfer).

    :param table: the built-in table; ``None`` where the host's ``bridge`` decides.
    :param page_cache: whether this rank's kernel populates mappings on request.
    :raises Untranslatable: on every rank, when some rank cannot reproduce the bridge's mapping.
    """
    agreed = {f: v for f, v in dataclasses.asdict(settings).items() if f != "progress"}
    world = WorldDemands(
        meta,
        table,
        value_model=value_model,
        node_readers=settings.reader == "node",
        fix="set the MEGASTART_RANK0_LOADER_* variables (or the megastart.rank0_loader config) "
        "the same on every rank",
    )
    mine = None
    what = f"{PLUGIN}: mapping this rank's parameters to the checkpoint"
    with phase(what, summarise=world.summarise) as planned:
        try:
            mine = local_needs(chunks, meta, table, value_model=value_model, bridge=bridge)
        except Untranslatable as e:  # the bridge loads, on every rank: agreed below
            planned.share(RankDemands(node_key(), b"", "", [], False, agreed, str(e)))
        else:
            params, tensors, _, needs = mine
            device = tensors[next(iter(tensors))].device if tensors else training_device()
            demands = packed([demand for need in needs for demand in need.demands()], meta)
            left = [p.name for p in left_to_host(params, needs)]
            planned.share(RankDemands(node_key(), demands, device.type, left, page_cache, agreed))
    summary: Summary = planned.summary
    if summary.disagreement is not None:
        raise CollectiveError(summary.disagreement)
    if summary.untranslatable or mine is None:
        raise Untranslatable(summary.untranslatable)
    _, tensors, shard, needs = mine
    # the bridge decided: what it leaves unread is only named, not refused
    known = table if table is not None else known_table(meta)
    return Mapped(needs, tensors, shard, device, summary, planned.held, known, world)
