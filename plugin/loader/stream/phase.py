"""The stream phase across a load's ranks: each rank opens its route, runs its roles, and
proves its parameters covered; then every rank waits for the slowest reader."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from megastart.distributed import Board, OwnGroups
from megastart.loader.checkpoint import CheckpointMeta, as_seen_here
from megastart.loader.plan.demands import Mapped, Phase
from megastart.loader.plan.planning import Planned, ReaderGroup
from megastart.loader.plan.verify import Coverage
from megastart.loader.settings import PLUGIN, Rank0LoaderSettings
from megastart.loader.stream import roles
from megastart.loader.stream.copier import Copier
from megastart.loader.stream.node import node_board
from megastart.loader.stream.route import open_route
from megastart.loader.stream.staging import copy_threads
from megastart.loader.stream.stream import Stream


class Streamed(NamedTuple):
    """What one rank moved in the stream phase."""

    bytes_read: int
    bytes_broadcast: int


def stream_phase(
    planned: Planned | Callable[[], Planned],
    mapped: Mapped,
    group: ReaderGroup,
    meta: CheckpointMeta,
    page_cache: Sequence[bool],
    settings: Rank0LoaderSettings,
    own: OwnGroups,
    board: Board,
    phase: Phase,
    checkpoint: str,
) -> tuple[list[Streamed], Planned]:
    """Stream the plan into this rank's parameters, in one phase; every rank's
    :class:`Streamed`, in rank order, and the plan it streamed by.

    :param planned: the plan, or how to make it inside the phase (one node taking its slices
        out of the page cache makes no process group, where a rank that failed to plan would
        leave the others waiting unnamed: it plans here, and a failure stops the others at
        the board).
    :param page_cache: per rank of this rank's node, whether it takes its slices out of the
        page cache.
    """
    what = f"{PLUGIN}: streaming {checkpoint!r} and verifying the coverage"
    with (
        phase(what) as loaded,
        node_board(board, group.here, nodes=mapped.summary.nodes) as page,
    ):
        if callable(planned):
            planned = planned()
        loaded.share(
            Streamed(*_stream(planned, mapped, group, meta, page_cache, own, board, page, settings))
        )
        # A rank done early waits here, as long as the readers read; the verdict's gather
        # below is bounded by timeout_s from its start, which a long read would outlast.
        board.barrier("every rank to finish the stream")
    return loaded.shared, planned


def _stream(
    planned: Planned,
    mapped: Mapped,
    group: ReaderGroup,
    meta: CheckpointMeta,
    page_cache: Sequence[bool],
    own: OwnGroups,
    board: Board,
    page: Any,
    settings: Rank0LoaderSettings,
) -> tuple[int, int]:
    """This rank's part of the stream: the bytes it read and broadcast."""
    route = open_route(
        group.ranks,
        group.node,
        planned.nodes,
        planned.plan.receiver_sets,
        own,
        page_cache=page_cache,
        backend=planned.backend,
        device=mapped.device,
        board=board,
        page=page,
        striped=group.striped,
    )
    if route.opens_files and 0 not in group.here:  # another node may mount them apart
        meta = dataclasses.replace(meta, shards=as_seen_here(meta.directory, meta.shards))
    coverage = Coverage()
    with Copier(mapped.device, copy_threads(len(route.node))) as copier:
        stream = Stream(
            meta, planned.plan, mapped.needs, mapped.tensors, mapped.shard, coverage, route, copier
        )
        moved = roles.run(stream, settings)
    coverage.check([n.param for n in mapped.needs])  # every parameter but those left to the host
    return moved
