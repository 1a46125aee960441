"""The load's planning phase across ranks: what each rank shares, what rank 0 tells every
rank of it (:class:`Summary`), the buckets the reader computes from it, each node's view of
them handed down from the reader, and what rank 0 says about them.

:mod:`megastart.loader.plan.buckets` is the plain-data core (demands in, buckets out); this module
puts it to a load's ranks, reader groups and settings, so that
:mod:`megastart.loader.api` reads as the phases alone.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, NamedTuple

from megastart.distributed import CollectiveError, Control, disagreement
from megastart.errors import PlanError, SettingsError
from megastart.loader.checkpoint import CheckpointMeta
from megastart.loader.mapping.mappings import VALUE_HEAD, MappingTable
from megastart.loader.mapping.model import UnsupportedArchitecture, mapping_table
from megastart.loader.mapping.needs import Demand
from megastart.loader.plan.buckets import (
    Bucket,
    Plan,
    Shipped,
    build_plan,
    demands_once,
    distinct,
    runs,
    unused_tensors,
)
from megastart.loader.plan.nodes import Nodes
from megastart.loader.plan.stripes import stripe
from megastart.loader.settings import PLUGIN, Rank0LoaderSettings

log = logging.getLogger("megastart")


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
    """Whether its kernel populates mappings on request (:func:`pagecache.supported`)."""
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


@dataclass(frozen=True, slots=True)
class Buckets:
    """This rank's view of the planned load."""

    plan: Plan
    """Its reader group's buckets."""
    readers: tuple[int, ...]
    """The global ranks that read."""
    unused: tuple[str, ...]
    """Checkpoint tensors no rank uses (not read)."""


def plan_buckets(
    demands: Sequence[Sequence[Demand]],
    meta: CheckpointMeta,
    settings: Rank0LoaderSettings,
    group: Sequence[int],
    nodes: Nodes,
    *,
    readers: tuple[int, ...],
    unused: tuple[str, ...],
    striped: bool,
    checkpoint: str,
    strict: bool,
) -> Buckets:
    """The buckets of this rank's reader group (``demands``: its ranks', in its order; ``nodes``:
    its nodes); raises :class:`PlanError` for tensors no rank uses (``unused``,
    :attr:`Summary.unused`) when ``strict``. ``readers``: every group's reader, unless
    ``striped``."""
    if unused and strict:
        raise PlanError(_unused_message(list(unused), checkpoint, strict=True))
    plan = build_plan(
        demands,
        meta,
        bucket_bytes=int(settings.bucket_mb * 2**20),
        to_reader=not striped,
    )
    if striped:
        plan = stripe(plan, nodes)
        readers = tuple(sorted({group[b.reader] for b in plan.buckets}))
    return Buckets(plan, readers, unused)


class Outline(NamedTuple):
    """What every rank of a reader group of several nodes learns of its reader's plan besides
    its node's buckets (:func:`handed_out`)."""

    sizes: tuple[int, ...]
    """Every bucket's bytes, in plan order (every leader hears every bucket's header)."""
    readers: tuple[int, ...]
    """Every bucket's reader, its position in the group."""
    reader_ranks: tuple[int, ...]
    """:attr:`Buckets.readers`."""


NODES = -1
"""The part of every node's view (:func:`node_views`) that holds the reader group's nodes
(pickled as runs, :meth:`~megastart.loader.plan.nodes.Nodes.__reduce__`): only a node's leader
takes it (:func:`handed_out`)."""


def node_views(plan: Plan, nodes: Nodes) -> dict[int, dict[int, bytes]]:
    """Per node (by its leader's position), the buckets its ranks need or its leader reads, by
    their index in ``plan``, each pickled once for every node (so the scatter copies bytes,
    it does not pickle a bucket per node; its receivers as runs, :class:`Shipped`): one
    object per distinct set of buckets (the nodes of one pipeline stage and expert-parallel
    rank share theirs), in one pass over the plan; and the group's ``nodes``
    (:data:`NODES`), for the leaders' routes."""
    indices: dict[int, list[int]] = {leader: [] for leader in nodes.leaders}
    reached: dict[int, tuple[int, ...]] = {}  # by the positions' id: one tuple per receiver set
    for index, bucket in enumerate(plan.buckets):
        leaders = reached.get(id(bucket.positions)) or reached.setdefault(
            id(bucket.positions), nodes.leaders_reached(bucket.positions)
        )
        for leader in {*leaders, nodes.leader_of[bucket.reader]}:
            indices[leader].append(index)
    compact: dict[int, tuple[int, ...] | None] = {}  # by the positions' id, as ``reached``

    def shipped(bucket: Bucket) -> bytes:
        key = id(bucket.positions)
        if key not in compact:
            its = runs(bucket.positions)
            compact[key] = its if len(its) < len(bucket.positions) else None
        return pickle.dumps(Shipped(bucket, compact[key]))

    pickled: dict[int, bytes] = {NODES: pickle.dumps(nodes)}
    views: dict[tuple[int, ...], dict[int, bytes]] = {}
    for its in indices.values():
        key = tuple(its)
        if key not in views:
            views[key] = {
                i: pickled.get(i) or pickled.setdefault(i, shipped(plan.buckets[i])) for i in its
            }
            views[key][NODES] = pickled[NODES]
    return {leader: views[tuple(its)] for leader, its in indices.items()}


def node_plan(outline: Outline, view: dict[int, bytes]) -> Plan:
    """The reader's plan as a node sees it: its own buckets whole, every other one a bucket of
    the same size and reader with no slots and no receivers (its header is heard, its bytes
    never reach this node)."""
    return Plan(
        tuple(
            pickle.loads(view[index]) if index in view else Bucket((), size, (), reader)
            for index, (size, reader) in enumerate(zip(outline.sizes, outline.readers, strict=True))
        )
    )


def handed_out(
    buckets: Buckets | None,
    group: Sequence[int],
    nodes: Nodes | None,
    control: Control,
    *,
    timeout_s: float,
) -> tuple[Plan, Outline, Nodes | None]:
    """This rank's plan in a reader group of several nodes: the reader's (``buckets``, on the
    reader, rank 0), or its node's view of it, handed down the control plane's tree
    (:meth:`~megastart.distributed.Control.scatter`): no other rank plans the group's buckets,
    and none receives another node's. With it the group's nodes (``nodes``, on the reader),
    on every node leader; ``None`` on the others, which need their own node alone.

    :raises megastart.distributed.CollectiveError: when the tree does not carry it within
        ``timeout_s`` (a rank died).
    """
    import torch.distributed as dist

    values = outline = None
    if buckets is not None:
        assert nodes is not None
        plan = buckets.plan
        values = {group[p]: view for p, view in node_views(plan, nodes).items()}
        sizes = tuple(b.nbytes for b in plan.buckets)
        outline = Outline(sizes, tuple(b.reader for b in plan.buckets), buckets.readers)
    try:  # the buckets are the parts: one a stage's nodes all need crosses each group once
        view = control.scatter(values, timeout_s=timeout_s, private={NODES})
        outline = control.broadcast(outline, timeout_s=timeout_s)
    except Exception as e:
        raise CollectiveError(
            f"{PLUGIN}: handing each node its buckets (rank {dist.get_rank()}): {e}"
        ) from e
    assert outline is not None
    if buckets is not None:
        return buckets.plan, outline, nodes
    theirs = view.pop(NODES, None)
    return node_plan(outline, view), outline, None if theirs is None else pickle.loads(theirs)


def announce(
    buckets: Buckets,
    left_by_all: Sequence[str],
    checkpoint: str,
    table: MappingTable,
    *,
    striped: bool,
    value_model: bool,
) -> None:
    """Rank 0's lines about the plan: tensors not read, parameters left to the host, readers."""
    if buckets.unused:
        log.warning(
            "megastart: %s", _unused_message(list(buckets.unused), checkpoint, strict=False)
        )
    heads = [n for n in left_by_all if value_model and n.startswith(VALUE_HEAD)]
    if heads:
        log.info(
            "megastart: value head %s keeps the host's initialisation: %r has no tensor of "
            "its shape for it (a weight is looked for in %s; a bias never is)",
            heads,
            checkpoint,
            ", ".join(table.value_head_sources),
        )
    if len(heads) < len(left_by_all):  # only the bridge's table leaves others
        log.info(
            "megastart: %s keep the host's initialisation: the host's Megatron-Bridge does not "
            "load them either (adapters, parameters none of its mappings names, an output "
            "layer tied to the embedding)",
            [n for n in left_by_all if n not in heads],
        )
    if striped:
        log.info(
            "megastart: %s striped over %d readers (%s), %.2f GB in %d buckets",
            PLUGIN,
            len(buckets.readers),
            _ranks_text(buckets.readers),
            buckets.plan.nbytes / 1e9,
            len(buckets.plan.buckets),
        )


def known_table(meta: CheckpointMeta) -> MappingTable:
    """The built-in table of the checkpoint's architecture (its ignored tensors), or none."""
    try:
        return mapping_table(meta)
    except UnsupportedArchitecture:
        return MappingTable(meta.architectures, ())


def transport_backend(transport: str, device_types: AbstractSet[str]) -> str:
    """The backend the buckets cross nodes on, for the ``transport`` setting."""
    if transport == "auto":
        return "nccl" if device_types == {"cuda"} else "gloo"
    if transport == "nccl" and device_types != {"cuda"}:
        raise SettingsError(
            f"rank0_loader.transport=nccl needs CUDA parameters on every rank, found {sorted(device_types)}; "
            "use transport=auto or gloo"
        )
    return transport


def _ranks_text(ranks: Sequence[int]) -> str:
    """``ranks`` for a log line: all of a few, the first and last of many."""
    shown = ", ".join(map(str, ranks[:4]))
    return f"ranks {shown}" + (f", ... {ranks[-1]}" if len(ranks) > 4 else "")


def _unused_message(unused: list[str], checkpoint: str, *, strict: bool) -> str:
    shown = ", ".join(repr(n) for n in unused[:5]) + (
        f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
    )
    if strict:
        return (
            f"checkpoint {checkpoint!r} holds {len(unused)} tensor(s) no Megatron parameter uses: {shown}; "
            "the model built is missing layers the checkpoint has, or set rank0_loader.strict=false"
        )
    return f"rank0_loader: {len(unused)} tensor(s) of {checkpoint!r} feed no parameter and were not read: {shown}"
