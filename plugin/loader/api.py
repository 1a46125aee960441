"""``load_hf_checkpoint``: the rank-0 loader's phases, run on every rank, each all-or-none.

1. metadata: rank 0 reads ``config.json`` and the safetensors headers, broadcasts them;
2. plan: every rank maps its parameters to HF tensors and checks shapes; the
   demands go up the control plane's tree to rank 0, which sends every rank a
   summary of them (:class:`~megastart.loader.plan.planning.Summary`), and the reader
   plans the buckets; on several nodes each node takes its view of them from the
   reader, down the tree (:func:`~megastart.loader.plan.planning.handed_out`);
3. stream: each reader reads its group's buckets once; each crosses to every
   other node that needs it once, and every rank copies its shards out of the
   page cache (the reader's node) or its node's shared memory;
4. verify: every element of every local parameter was written exactly once.

Before any of them the ranks check in (a rank that never calls is named); they
agree on their settings in the plan's summary (one collective less). A failure in
any phase, on any rank, is raised on every rank (``all_or_none``), within
``timeout_s`` and a fraction of a second:
the failing rank announces it on the load's ``Board`` and every wait looks
there. A process whose load failed refuses the next one (``Sticky``): its
peers and groups are in an unknown state. What a failed load leaves in the
parameters: see :func:`load_hf_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from megastart.distributed import (
    PEER_GRACE_S,
    Board,
    CollectiveError,
    OwnGroups,
    Started,
    all_or_none,
    broadcast_or_raise,
    discard_control,
    discarding_control,
    kept_control,
    node_key,
)
from megastart.distributed.sticky import LATCH
from megastart.distributed.world import training_device
from megastart.loader.checkpoint import (
    CheckpointMeta,
    QuantisedCheckpoint,
    as_seen_here,
    read_metadata,
)
from megastart.loader.mapping.bridge import Untranslatable, dequantises
from megastart.loader.mapping.model import UnsupportedArchitecture, local_needs, mapping_table
from megastart.loader.mapping.needs import left_to_host
from megastart.loader.plan.buckets import Plan, packed
from megastart.loader.plan.nodes import Nodes
from megastart.loader.plan.planning import (
    RankDemands,
    Summary,
    WorldDemands,
    announce,
    handed_out,
    known_table,
    plan_buckets,
    transport_backend,
)
from megastart.loader.plan.verify import Coverage
from megastart.loader.settings import PLUGIN, Rank0LoaderSettings, resolved
from megastart.loader.stream import pagecache, roles
from megastart.loader.stream.copier import Copier
from megastart.loader.stream.node import node_board
from megastart.loader.stream.route import open_route
from megastart.loader.stream.staging import copy_threads
from megastart.loader.stream.stream import Stream
from megastart.records import LoadReport

if TYPE_CHECKING:
    from megastart.records import EngineContext

log = logging.getLogger("megastart")


_sticky = LATCH
"""The process's latch: a failed load (or hook) is refused again by every later load."""


class Streamed(NamedTuple):
    """What one rank moved in the stream phase."""

    bytes_read: int
    bytes_broadcast: int


def load_for_engine(engine: EngineContext, checkpoint: str) -> LoadReport | None:
    """``on_model_load`` of the ``rank0_loader`` plugin: ``None`` (one line on rank 0) if no
    table fits, or if the checkpoint is quantised and the host's own loader dequantises it."""
    # Resolved inside the load otherwise, so that an error doing it reaches every rank.
    settings = engine.settings.section(PLUGIN) if engine.settings is not None else None
    try:
        return load_hf_checkpoint(
            engine.model_chunks,
            checkpoint,
            settings=settings,
            value_model=engine.value_model,
            bridge=engine.hf_bridge,
        )
    # Both decided on every rank from the same metadata, before any transfer.
    except (UnsupportedArchitecture, Untranslatable) as e:
        if _rank() == 0:
            log.warning(
                "megastart: rank0_loader does not handle this checkpoint: %s; the host's loader runs",
                e,
            )
        return None
    except QuantisedCheckpoint as e:
        if e.method not in engine.host_dequantises:
            if _rank() == 0:
                log.error("megastart: rank0_loader refuses the load on every rank: %s", e)
            raise
        if _rank() == 0:
            log.warning(
                "megastart: rank0_loader leaves %r whole to %s's own loader, which dequantises "
                "%s checkpoints (rank0_loader does not)",
                checkpoint,
                engine.host,
                e.method,
            )
        return None


def load_hf_checkpoint(
    model_chunks: Sequence[Any],
    checkpoint_dir: str,
    *,
    settings: Rank0LoaderSettings | None = None,
    value_model: bool = False,
    bridge: Any = None,
) -> LoadReport:
    """Load an HF checkpoint into this rank's Megatron-core model chunks, reading it once.

    Collective: every rank of the default process group calls it together. The
    parallel layout comes from ``megatron.core.parallel_state``.

    :param model_chunks: this rank's ``GPTModel`` chunks, one per virtual pipeline
        stage (unwrapped from DDP / Float16Module).
    :param checkpoint_dir: the directory with ``config.json`` and ``*.safetensors``.
    :param settings: the ``rank0_loader`` settings; by default the resolved ones.
    :param value_model: the chunks are a value model (critic, reward model): the last
        stage's ``output_layer`` is a one-output head. It is read from the checkpoint's
        reward head of its shape (``score.weight``, ...) if there is one, and otherwise
        left as the host initialised it and named in the report's ``left_to_host``.
    :param bridge: the host's Megatron-Bridge bridge (``AutoBridge`` or a model bridge)
        whose ``load_hf_weights`` this load replaces: its ``mapping_registry()`` decides
        which tensors fill which parameter (:mod:`megastart.loader.mapping.bridge`), and what it
        leaves alone stays as the host initialised it.
    :returns: what was read and sent, and how long it took (same figures on every rank).
    :raises megastart.distributed.CollectiveError: on every rank, when any rank
        failed, stalled, or did not call it within ``timeout_s``; the message
        names the failing rank and its error. A failure in the stream phase
        leaves the parameters partly written: those whose buckets arrived hold
        the checkpoint's values, the others what they held before. Do not use
        the model; restart the process.
    :raises megastart.distributed.FailedBefore: at once, when a load already
        failed in this process.
    :raises UnsupportedArchitecture: on every rank, when no mapping table serves
        the checkpoint's ``architectures``.
    :raises megastart.loader.checkpoint.QuantisedCheckpoint: on every rank, when the
        checkpoint is quantised (its weights would be cast without their scales).
    """
    with (
        _sticky.guard(
            PLUGIN, passes=(UnsupportedArchitecture, Untranslatable, QuantisedCheckpoint)
        ),
        discarding_control(),  # every rank's load fails with this one
    ):
        board = Board(PLUGIN)
        with board.announcing():
            settings = settings or resolved()
            start = time.perf_counter()
            # rank 0 reads the metadata while the ranks check in (its errors are sent after)
            read = partial(_metadata, str(checkpoint_dir), settings.allow_pickle, bridge)
            metadata = Started(read) if board.rank == 0 else read
            board.check_in(settings.timeout_s)
            # The board bounds every wait by timeout_s and names it; gloo's own
            # timeout, unnamed, must not come first.
            with OwnGroups(timeout_s=settings.timeout_s + 2 * PEER_GRACE_S) as own:
                return _load(
                    list(model_chunks),
                    str(checkpoint_dir),
                    metadata,
                    settings,
                    own,
                    board,
                    start,
                    value_model,
                    bridge,
                )


def _metadata(checkpoint: str, allow_pickle: bool, bridge: Any) -> CheckpointMeta | None:
    """The checkpoint's metadata; ``None`` where the load replaces a bridge's and the source is
    not a directory here (the bridge reads it from wherever it is)."""
    if bridge is not None and not os.path.isdir(checkpoint):
        return None
    return read_metadata(checkpoint, allow_pickle=allow_pickle)


def reset_state() -> None:
    """Forget a failed load: only for a process that rebuilt its process groups (tests, demos)."""
    _sticky.reset()
    discard_control()


def _load(
    chunks: list[Any],
    checkpoint: str,
    metadata: Callable[[], CheckpointMeta | None] | Started,
    settings: Rank0LoaderSettings,
    own: OwnGroups,
    board: Board,
    start: float,
    value_model: bool,
    bridge: Any,
) -> LoadReport:
    import torch.distributed as dist

    rank = dist.get_rank()
    control = kept_control(timeout_s=own.timeout_s)
    # agreed in the demands' summary below: one collective less before any bulk transfer
    agreed = {f: v for f, v in dataclasses.asdict(settings).items() if f != "progress"}
    phase = partial(all_or_none, timeout_s=settings.timeout_s, control=control, board=board)

    meta: CheckpointMeta | None = broadcast_or_raise(
        f"{PLUGIN}: reading the metadata of {checkpoint!r}",
        metadata,
        timeout_s=settings.timeout_s,
        control=control,
    )
    if meta is None:
        raise Untranslatable(
            f"the source {checkpoint!r} is not a local checkpoint directory (weights in memory, "
            "or a hub id not downloaded): the host's Megatron-Bridge loads it"
        )
    table = None if bridge is not None else mapping_table(meta)
    quantisation = meta.quantisation
    if quantisation is not None and not dequantises(quantisation, bridge):
        # never cast without the scales, whatever strict says
        raise quantisation.refusal(checkpoint)

    world = WorldDemands(
        meta,
        table,
        value_model=value_model,
        node_readers=settings.reader == "node",
        fix="set the MEGASTART_RANK0_LOADER_* variables (or the megastart.rank0_loader config) "
        "the same on every rank",
    )
    with phase(
        f"{PLUGIN}: mapping this rank's parameters to the checkpoint", summarise=world.summarise
    ) as planned:
        try:
            params, tensors, shard, needs = local_needs(
                chunks, meta, table, value_model=value_model, bridge=bridge
            )
        except Untranslatable as e:  # the bridge loads, on every rank: agreed below
            planned.share(RankDemands(node_key(), b"", "", [], False, agreed, str(e)))
        else:
            device = tensors[next(iter(tensors))].device if tensors else training_device()
            demands = packed([demand for need in needs for demand in need.demands()], meta)
            left = [p.name for p in left_to_host(params, needs)]
            planned.share(
                RankDemands(node_key(), demands, device.type, left, pagecache.supported(), agreed)
            )
    summary: Summary = planned.summary
    held: dict[int, RankDemands] = planned.held  # its node's (every rank's on rank 0)
    if summary.disagreement is not None:
        raise CollectiveError(summary.disagreement)
    if summary.untranslatable:
        raise Untranslatable(summary.untranslatable)
    if table is None:  # the bridge decided: what it leaves unread is only named, not refused
        table = known_table(meta)
    here = tuple(r for r, theirs in held.items() if theirs.node == held[rank].node)  # its node
    if settings.reader == "node":
        group: Sequence[int] = here
    else:
        group = range(dist.get_world_size())
    striped = settings.reader in ("striped", "auto") and summary.nodes > 1
    # a group of several nodes: its reader plans, and each node takes its buckets from it
    handed = len(here) < len(group)
    node = tuple(group.index(r) for r in here)

    left_by_all = summary.left_to_host
    known = table

    def plan_here() -> tuple[Plan, tuple[int, ...], str, Nodes | None]:
        """This rank's plan, its group's reader ranks, the transport's backend, and the group's
        nodes where this rank needs them: planned here, or, in a group of several nodes, by
        its reader alone and handed down to each node."""
        backend = transport_backend(settings.transport, summary.devices)
        buckets = nodes = None
        if not handed or rank == group[0]:  # its reports: its node's, or every rank's on rank 0
            nodes = Nodes.of([held[r].node for r in group])
            buckets = plan_buckets(
                world.of(group, held),
                meta,
                settings,
                group,
                nodes,
                readers=summary.readers if settings.reader == "node" else (0,),
                unused=summary.unused,
                striped=striped,
                checkpoint=checkpoint,
                strict=settings.strict and bridge is None,
            )
        if handed:
            plan, outline, nodes = handed_out(
                buckets, group, nodes, control, timeout_s=own.timeout_s
            )
            readers = outline.reader_ranks
        else:
            assert buckets is not None
            plan, readers = buckets.plan, buckets.readers
        if rank == 0 and buckets is not None:
            announce(
                buckets, left_by_all, checkpoint, known, striped=striped, value_model=value_model
            )
        return plan, readers, backend, nodes

    cached = settings.reader_node == "page_cache" and meta.format == "safetensors"
    page_cache = [cached and held[r].page_cache for r in here]
    # One node taking its slices out of the page cache makes no process group (where a rank
    # that failed to plan would leave the others waiting, unnamed): it plans inside the
    # stream's phase, a failure stops the others at the board, and the planning phase's
    # verdict (a collective) goes.
    ahead = None
    if not (summary.nodes == 1 and all(page_cache)):
        with phase(f"{PLUGIN}: planning the buckets"):
            ahead = plan_here()
    coverage = Coverage()
    with (
        phase(f"{PLUGIN}: streaming {checkpoint!r} and verifying the coverage") as loaded,
        node_board(board, here, nodes=summary.nodes) as page,
    ):
        plan, readers, backend, nodes = ahead or plan_here()
        route = open_route(
            group,
            node,
            nodes,
            plan.receiver_sets,
            own,
            page_cache=page_cache,
            backend=backend,
            device=device,
            board=board,
            page=page,
            striped=striped,
        )
        if route.opens_files and 0 not in here:  # another node may mount them apart
            meta = dataclasses.replace(meta, shards=as_seen_here(meta.directory, meta.shards))
        with Copier(device, copy_threads(len(route.node))) as copier:
            stream = Stream(meta, plan, needs, tensors, shard, coverage, route, copier)
            read, sent = roles.run(stream, settings)
        coverage.check([n.param for n in needs])  # every parameter but those left to the host
        loaded.share(Streamed(read, sent))
        # A rank done early waits here, as long as the readers read; the verdict's gather
        # below is bounded by timeout_s from its start, which a long read would outlast.
        board.barrier("every rank to finish the stream")
    moved: list[Streamed] = loaded.shared
    return LoadReport(
        plugin=PLUGIN,
        checkpoint=checkpoint,
        bytes_read=sum(m.bytes_read for m in moved),
        bytes_broadcast=sum(m.bytes_broadcast for m in moved),
        seconds=time.perf_counter() - start,
        reader_ranks=readers,
        tensors=summary.tensors,
        left_to_host=left_by_all,
    )


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
