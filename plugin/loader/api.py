"""``load_hf_checkpoint``: the rank-0 loader's phases, run on every rank, each all-or-none.

1. metadata: rank 0 reads ``config.json`` and the safetensors headers, broadcasts them;
2. plan: every rank maps its parameters to HF tensors and checks shapes; the
   demands go up the control plane's tree to rank 0, which sends every rank a
   summary of them (:class:`~megastart.loader.plan.demands.Summary`), and the reader
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

import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from megastart.distributed import (
    PEER_GRACE_S,
    Board,
    Control,
    OwnGroups,
    Started,
    all_or_none,
    broadcast_or_raise,
    discard_control,
    discarding_control,
    kept_control,
)
from megastart.distributed.sticky import LATCH
from megastart.loader.checkpoint import CheckpointMeta, QuantisedCheckpoint, read_metadata
from megastart.loader.mapping.bridge import Untranslatable, dequantises
from megastart.loader.mapping.mappings import MappingTable
from megastart.loader.mapping.model import UnsupportedArchitecture, mapping_table
from megastart.loader.plan.demands import map_ranks
from megastart.loader.plan.planning import Planned, plan_here, reader_group
from megastart.loader.settings import PLUGIN, Rank0LoaderSettings, resolved
from megastart.loader.stream import mappings
from megastart.loader.stream.phase import stream_phase
from megastart.records import LoadReport

if TYPE_CHECKING:
    from megastart.records import EngineContext

log = logging.getLogger("megastart")


_sticky = LATCH
"""The process's latch: a failed load (or hook) is refused again by every later load."""


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
    """The phases, each all-or-none across ranks, each taking what the one before returned."""
    import torch.distributed as dist

    rank = dist.get_rank()
    control = kept_control(timeout_s=own.timeout_s)
    phase = partial(all_or_none, timeout_s=settings.timeout_s, control=control, board=board)
    meta, table = _metadata_phase(checkpoint, metadata, settings, control, bridge)
    mapped = map_ranks(
        chunks,
        meta,
        table,
        settings,
        phase,
        value_model=value_model,
        bridge=bridge,
        page_cache=mappings.supported(),
    )
    group = reader_group(rank, dist.get_world_size(), mapped, settings)
    planning = partial(
        plan_here,
        rank,
        mapped,
        group,
        meta,
        settings,
        control,
        timeout_s=own.timeout_s,
        checkpoint=checkpoint,
        value_model=value_model,
        strict=settings.strict and bridge is None,
    )
    cached = settings.reader_node == "page_cache" and meta.format == "safetensors"
    page_cache = [cached and mapped.held[r].page_cache for r in group.here]
    planned: Planned | Callable[[], Planned] = planning
    if not (mapped.summary.nodes == 1 and all(page_cache)):  # else planned in the stream phase
        with phase(f"{PLUGIN}: planning the buckets"):
            planned = planning()
    moved, planned = stream_phase(
        planned, mapped, group, meta, page_cache, settings, own, board, phase, checkpoint
    )
    return LoadReport(
        plugin=PLUGIN,
        checkpoint=checkpoint,
        bytes_read=sum(m.bytes_read for m in moved),
        bytes_broadcast=sum(m.bytes_broadcast for m in moved),
        seconds=time.perf_counter() - start,
        reader_ranks=planned.readers,
        tensors=mapped.summary.tensors,
        left_to_host=mapped.summary.left_to_host,
    )


def _metadata_phase(
    checkpoint: str,
    metadata: Callable[[], CheckpointMeta | None] | Started,
    settings: Rank0LoaderSettings,
    control: Control,
    bridge: Any,
) -> tuple[CheckpointMeta, MappingTable | None]:
    """Rank 0's metadata on every rank, and the built-in table that serves it (``None``: the
    host's ``bridge`` decides); a quantised checkpoint nothing here dequantises is refused."""
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
    return meta, table


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
