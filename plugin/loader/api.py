"""``load_hf_checkpoint``: the rank-0 loader's phases, run on every rank, each all-or-none.

1. metadata: rank 0 reads ``config.json`` and the safetensors headers, broadcasts them;
2. plan: every rank maps its parameters to HF tensors and checks shapes; the
   demands are all-gathered and every rank computes the same buckets;
3. stream: each reader reads its group's buckets once; each crosses to every
   other node that needs it once, and every rank copies its shards out of the
   page cache (the reader's node) or its node's shared memory;
4. verify: every element of every local parameter was written exactly once.

Before any of them the ranks check in (a rank that never calls is named) and
agree on their settings. A failure in any phase, on any rank, is raised on
every rank (``all_or_none``), within ``timeout_s`` and a fraction of a second:
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
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from megastart.distributed import (
    PEER_GRACE_S,
    Board,
    OwnGroups,
    agree,
    all_or_none,
    broadcast_or_raise,
    discard_control,
    discarding_control,
    kept_control,
    node_key,
)
from megastart.distributed.sticky import LATCH
from megastart.errors import SettingsError
from megastart.loader import pagecache, roles
from megastart.loader.bridge import Untranslatable
from megastart.loader.checkpoint import (
    CheckpointMeta,
    QuantisedCheckpoint,
    as_seen_here,
    read_metadata,
)
from megastart.loader.copier import Copier, copy_threads
from megastart.loader.mappings import VALUE_HEAD, MappingTable
from megastart.loader.model import UnsupportedArchitecture, local_needs, mapping_table
from megastart.loader.node import node_board
from megastart.loader.plan import (
    PlanError,
    build_plan,
    demands_once,
    distinct,
    left_to_host,
    packed,
    receiver_sets,
    unused_tensors,
)
from megastart.loader.route import Nodes, open_route
from megastart.loader.settings import Rank0LoaderSettings
from megastart.loader.stream import Stream
from megastart.loader.stripes import stripe
from megastart.loader.transport import reader_groups
from megastart.loader.verify import Coverage
from megastart.records import LoadReport

if TYPE_CHECKING:
    import torch

    from megastart.records import EngineContext

log = logging.getLogger("megastart")

PLUGIN = "rank0_loader"

_sticky = LATCH
"""The process's latch: a failed load (or hook) is refused again by every later load."""


class RankDemands(NamedTuple):
    """What one rank tells the others when planning."""

    node: tuple[str, int]
    """Its node (:func:`~megastart.distributed.node_key`)."""
    demands: bytes
    """The HF tensors each of its parameters takes, and the parameter's dtype
    (:func:`~megastart.loader.plan.packed`: replicas send the same bytes, unpacked once)."""
    device: str
    """The device type of its parameters (``"cuda"``, ``"cpu"``)."""
    left_to_host: list[str]
    """Its parameters the load leaves as the host initialised them (canonical names)."""
    page_cache: bool
    """Whether its kernel populates mappings on request (:func:`pagecache.supported`)."""
    untranslatable: str = ""
    """Why the host's bridge's mapping cannot be reproduced here (``""``: it can)."""


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
        which tensors fill which parameter (:mod:`megastart.loader.bridge`), and what it
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
            settings = settings or _default_settings()
            start = time.perf_counter()
            board.check_in(settings.timeout_s)
            # The board bounds every wait by timeout_s and names it; gloo's own
            # timeout, unnamed, must not come first.
            with OwnGroups(timeout_s=settings.timeout_s + 2 * PEER_GRACE_S) as own:
                return _load(
                    list(model_chunks),
                    str(checkpoint_dir),
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


def _known_table(meta: CheckpointMeta) -> MappingTable:
    """The built-in table of the checkpoint's architecture (its ignored tensors), or none."""
    try:
        return mapping_table(meta)
    except UnsupportedArchitecture:
        return MappingTable(meta.architectures, ())


def reset_state() -> None:
    """Forget a failed load: only for a process that rebuilt its process groups (tests, demos)."""
    _sticky.reset()
    discard_control()


def _load(
    chunks: list[Any],
    checkpoint: str,
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
    agree(
        PLUGIN,
        {f: v for f, v in dataclasses.asdict(settings).items() if f != "progress"},
        control=control,
        timeout_s=own.timeout_s,
        fix="set the MEGASTART_RANK0_LOADER_* variables (or the megastart.rank0_loader config) "
        "the same on every rank",
    )
    phase = partial(all_or_none, timeout_s=settings.timeout_s, control=control, board=board)

    meta: CheckpointMeta | None = broadcast_or_raise(
        f"{PLUGIN}: reading the metadata of {checkpoint!r}",
        partial(_metadata, checkpoint, settings.allow_pickle, bridge),
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
    if quantisation is not None and quantisation.weight_block is None:
        # never cast without the scales, whatever strict says
        raise quantisation.refusal(checkpoint)

    with phase(f"{PLUGIN}: mapping this rank's parameters to the checkpoint") as planned:
        try:
            params, tensors, shard, needs = local_needs(
                chunks, meta, table, value_model=value_model, bridge=bridge
            )
        except Untranslatable as e:  # the bridge loads, on every rank: agreed below
            planned.share(RankDemands(node_key(), b"", "", [], False, str(e)))
        else:
            device = tensors[next(iter(tensors))].device if tensors else _cpu()
            demands = packed([demand for need in needs for demand in need.demands()], meta)
            left = [p.name for p in left_to_host(params, needs)]
            planned.share(
                RankDemands(node_key(), demands, device.type, left, pagecache.supported())
            )
    by_rank: list[RankDemands] = planned.shared
    untranslatable = sorted({r.untranslatable for r in by_rank} - {""})
    if untranslatable:
        raise Untranslatable(untranslatable[0])
    if table is None:  # the bridge decided: what it leaves unread is only named, not refused
        table = _known_table(meta)
    demands = demands_once([r.demands for r in by_rank], meta)
    nodes = [r.node for r in by_rank]
    groups = reader_groups(settings.reader, nodes)
    group = next(g for g in groups if rank in g)
    striped = settings.reader in ("striped", "auto") and len(set(nodes)) > 1

    with phase(f"{PLUGIN}: planning the buckets"):
        unused = unused_tensors(demands, meta, table, value_model=value_model)
        if unused and settings.strict and bridge is None:
            raise PlanError(_unused_message(unused, checkpoint, strict=True))
        plan = build_plan(
            [demands[r] for r in group],
            meta,
            bucket_bytes=int(settings.bucket_mb * 2**20),
            to_reader=not striped,
        )
        if striped:
            plan = stripe(plan, Nodes.of([nodes[r] for r in group]))
        sets = [  # another node's reader group (reader=node) has a plan this rank does not make
            plan.receiver_sets
            if members is group
            else receiver_sets([demands[r] for r in members], to_reader=not striped)
            for members in groups
        ]
        readers = (
            tuple(sorted({group[b.reader] for b in plan.buckets}))
            if striped
            else tuple(g[0] for g in groups)
        )
        backend = _backend(settings.transport, {r.device for r in by_rank})
    if unused and rank == 0:
        log.warning("megastart: %s", _unused_message(unused, checkpoint, strict=False))
    left_by_all = tuple(sorted({name for r in by_rank for name in r.left_to_host}))
    heads = [n for n in left_by_all if value_model and n.startswith(VALUE_HEAD)]
    if heads and rank == 0:
        log.info(
            "megastart: value head %s keeps the host's initialisation: %r has no tensor of "
            "its shape for it (a weight is looked for in %s; a bias never is)",
            heads,
            checkpoint,
            ", ".join(table.value_head_sources),
        )
    if len(heads) < len(left_by_all) and rank == 0:  # only the bridge's table leaves others
        log.info(
            "megastart: %s keep the host's initialisation: the host's Megatron-Bridge does not "
            "load them either (adapters, parameters none of its mappings names, an output "
            "layer tied to the embedding)",
            [n for n in left_by_all if n not in heads],
        )

    if striped and rank == 0:
        log.info(
            "megastart: %s striped over %d readers (%s), %.2f GB in %d buckets",
            PLUGIN,
            len(readers),
            _ranks_text(readers),
            plan.nbytes / 1e9,
            len(plan.buckets),
        )
    cached = settings.reader_node == "page_cache" and meta.format == "safetensors"
    coverage = Coverage()
    with (
        phase(f"{PLUGIN}: streaming {checkpoint!r} and verifying the coverage") as loaded,
        node_board(
            board, [r for r, key in enumerate(nodes) if key == nodes[rank]], nodes=len(set(nodes))
        ) as page,
    ):
        route = open_route(
            groups,
            nodes,
            sets,
            own,
            page_cache=[cached and r.page_cache for r in by_rank],
            backend=backend,
            device=device,
            board=board,
            page=page,
            striped=striped,
        )
        if route.opens_files and nodes[rank] != nodes[0]:  # another node may mount them apart
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
        tensors=len({name for d in distinct(demands) for names, _ in d for name in names}),
        left_to_host=left_by_all,
    )


def _ranks_text(ranks: Sequence[int]) -> str:
    """``ranks`` for a log line: all of a few, the first and last of many."""
    shown = ", ".join(map(str, ranks[:4]))
    return f"ranks {shown}" + (f", ... {ranks[-1]}" if len(ranks) > 4 else "")


def _backend(transport: str, device_types: set[str]) -> str:
    if transport == "auto":
        return "nccl" if device_types == {"cuda"} else "gloo"
    if transport == "nccl" and device_types != {"cuda"}:
        raise SettingsError(
            f"rank0_loader.transport=nccl needs CUDA parameters on every rank, found {sorted(device_types)}; "
            "use transport=auto or gloo"
        )
    return transport


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


def _default_settings() -> Rank0LoaderSettings:
    from megastart.manager import get_settings

    return get_settings().sections.get(PLUGIN) or Rank0LoaderSettings()


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
