"""The planning phase across ranks: this rank's reader group, the buckets its reader
computes from the ranks' demands (:mod:`megastart.loader.plan.demands`), and each node's
view of them handed down from the reader.

:mod:`megastart.loader.plan.buckets` is the plain-data core (demands in, buckets out); this
module puts it to a load's ranks, reader groups and settings.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import NamedTuple

from megastart.distributed import CollectiveError, Control
from megastart.errors import PlanError, SettingsError
from megastart.loader.checkpoint import CheckpointMeta
from megastart.loader.mapping.needs import Demand
from megastart.loader.plan.announce import announce, unused_message
from megastart.loader.plan.buckets import Bucket, Plan, Shipped, build_plan, runs
from megastart.loader.plan.demands import Mapped
from megastart.loader.plan.nodes import Nodes
from megastart.loader.plan.stripes import stripe
from megastart.loader.settings import PLUGIN, Rank0LoaderSettings


class ReaderGroup(NamedTuple):
    """This rank's reader group: the ranks one reader (or one stripe of readers) serves."""

    ranks: Sequence[int]
    """Its global ranks: every rank, or with ``reader=node`` this rank's node."""
    here: tuple[int, ...]
    """This rank's node's global ranks."""
    node: tuple[int, ...]
    """This rank's node's positions in :attr:`ranks`."""
    striped: bool
    """Every node leader reads a share of the buckets."""
    handed: bool
    """The group spans several nodes: its reader plans, and each node takes its view."""


def reader_group(
    rank: int, world_size: int, mapped: Mapped, settings: Rank0LoaderSettings
) -> ReaderGroup:
    """This rank's reader group, from its node's reports (:attr:`Mapped.held`)."""
    held = mapped.held
    here = tuple(r for r, theirs in held.items() if theirs.node == held[rank].node)
    ranks: Sequence[int] = here if settings.reader == "node" else range(world_size)
    striped = settings.reader in ("striped", "auto") and mapped.summary.nodes > 1
    node = tuple(ranks.index(r) for r in here)
    return ReaderGroup(ranks, here, node, striped, handed=len(here) < len(ranks))


class Planned(NamedTuple):
    """What the planning phase gives the stream on this rank."""

    plan: Plan
    """Its reader group's buckets, or its node's view of them."""
    readers: tuple[int, ...]
    """The group's reader ranks."""
    backend: str
    """The backend buckets cross nodes on."""
    nodes: Nodes | None
    """The group's nodes, where this rank routes by them (``None``: a member of a handed plan)."""


def plan_here(
    rank: int,
    mapped: Mapped,
    group: ReaderGroup,
    meta: CheckpointMeta,
    settings: Rank0LoaderSettings,
    control: Control,
    *,
    timeout_s: float,
    checkpoint: str,
    value_model: bool,
    strict: bool,
) -> Planned:
    """This rank's plan: planned here, or, in a group of several nodes, by its reader alone and
    handed down to each node (:func:`handed_out`); rank 0 says what the plan leaves out."""
    summary = mapped.summary
    backend = transport_backend(settings.transport, summary.devices)
    buckets = nodes = None
    if not group.handed or rank == group.ranks[0]:  # its node's reports, or every rank's
        nodes = Nodes.of([mapped.held[r].node for r in group.ranks])
        buckets = plan_buckets(
            mapped.world.of(group.ranks, mapped.held),
            meta,
            settings,
            group.ranks,
            nodes,
            readers=summary.readers if settings.reader == "node" else (0,),
            unused=summary.unused,
            striped=group.striped,
            checkpoint=checkpoint,
            strict=strict,
        )
    if group.handed:
        plan, outline, nodes = handed_out(buckets, group.ranks, nodes, control, timeout_s=timeout_s)
        readers = outline.reader_ranks
    else:
        assert buckets is not None
        plan, readers = buckets.plan, buckets.readers
    if rank == 0 and buckets is not None:
        announce(
            buckets,
            summary.left_to_host,
            checkpoint,
            mapped.table,
            striped=group.striped,
            value_model=value_model,
        )
    return Planned(plan, readers, backend, nodes)


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
        raise PlanError(unused_message(list(unused), checkpoint, strict=True))
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
