"""The reading roles (:mod:`megastart.loader.stream.roles`): the reader of a reader group,
and with striped readers every node leader, each reading its buckets once, ahead, in a
background thread, and sending each to the other nodes that need it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from megastart.distributed import CollectiveError
from megastart.loader.checkpoint import TensorReader
from megastart.loader.settings import Rank0LoaderSettings
from megastart.loader.stream.crossing import receive, send, staging_buffers
from megastart.loader.stream.frontier import Frontier
from megastart.loader.stream.pagecache import Window
from megastart.loader.stream.prefetch import READ_PART_BYTES, Prefetcher, fill
from megastart.loader.stream.progress import Progress
from megastart.loader.stream.sources import InUse, Payload, Source
from megastart.loader.stream.stream import BUFFERS
from megastart.loader.stream.transport import Channel

if TYPE_CHECKING:
    import torch

    from megastart.loader.stream.stream import Stream


def read(stream: Stream, settings: Rank0LoaderSettings) -> tuple[int, int]:
    reader = TensorReader(stream.meta)
    progress = Progress(stream.plan.nbytes, enabled=settings.progress)
    leaders = stream.route.leaders
    staging = staging_buffers(stream)
    in_use: deque[InUse] = deque()
    sent = 0
    frontier = stream.frontier()
    with _reader_buffers(stream) as buffers:
        fetch = partial(_fetch, stream, reader, buffers, frontier)
        # From the page cache alone, nothing bounds the read-ahead: it holds no memory.
        ahead = len(stream.plan.buckets) if stream.route.page_cache and leaders is None else BUFFERS
        prefetch = Prefetcher(reader, stream.plan, fetch, ahead, board=stream.route.board)
        try:
            for index, bucket in enumerate(stream.plan.buckets):
                buffer, source = _next_read(stream, prefetch, in_use, frontier, leaders)
                used = InUse()
                copied = None
                if leaders is not None and isinstance(source, Window):  # no other node needs it
                    used.sends.append(leaders.announce(bucket.nbytes, 0))
                elif leaders is not None:
                    assert isinstance(source, Payload)
                    work, copied, crossed = send(stream, leaders, index, source, staging)
                    used.sends.append(work)
                    sent += crossed
                used.done = stream.announce(index, buffer, bucket.nbytes)
                used.release = partial(prefetch.release, buffer, copied)
                stream.apply(index, source)
                if isinstance(source, Window):
                    source.release()
                del source
                progress.advance(bucket.nbytes)
                stream.hold(in_use, used)
            stream.settle(in_use)
            reader.check_unchanged()  # the bytes sent were one version of the checkpoint
        finally:
            prefetch.close()
    return reader.bytes_read, sent


def _fetch(
    stream: Stream,
    reader: TensorReader,
    buffers: list[torch.Tensor],
    frontier: Frontier | None,
    index: int,
    buffer: int,
    pool: Executor,
) -> Source:
    """The reader's read of bucket ``index`` (in its read-ahead thread): into the page cache
    when only this node needs it and takes it from there, else into ``buffers[buffer]``; then
    the node's ranks may take it from the page cache (``frontier``)."""
    bucket = stream.plan.buckets[index]
    source: Source
    if stream.route.page_cache and len(stream.route.leaders_for(bucket.positions)) == 1:
        populated = Window(stream.mappings, bucket.slots)
        populated.populate(reader, pool, READ_PART_BYTES)
        populated.release()  # in the page cache now, however far ahead this thread reads
        source = Window(stream.mappings, stream.mine(bucket))
    else:
        source = _filled(stream, reader, buffers, index, buffer, pool)
    if frontier is not None:
        frontier.publish(index + 1)
    return source


def read_share(stream: Stream, settings: Rank0LoaderSettings) -> tuple[int, int]:
    """A node leader with striped readers: read this node's share of the buckets (ahead, in a
    background thread, into the second half of the node's buffers) and send each to the other
    nodes that need it; receive the other readers' buckets its node needs into the first
    half. Every leader hears every bucket's header, from that bucket's reader, so a reader's
    failure reaches every node."""
    route = stream.route
    leaders = route.leaders
    assert leaders is not None
    buckets = stream.plan.buckets
    share = [i for i, bucket in enumerate(buckets) if bucket.reader == route.position]
    reader = TensorReader(stream.meta)
    # The first leader shows the whole stream's progress: it hears every bucket's header.
    progress = Progress(stream.plan.nbytes, enabled=settings.progress and route.position == 0)
    staging = staging_buffers(stream)
    in_use: deque[InUse] = deque()
    sent = 0
    with stream.buffers() as buffers:
        received, reads = buffers[:BUFFERS], buffers[BUFFERS:]
        free = deque(range(BUFFERS))
        fetch = partial(_filled, stream, reader, reads)
        prefetch = Prefetcher(reader, stream.plan, fetch, BUFFERS, board=route.board, indices=share)
        try:
            for index, bucket in enumerate(buckets):
                progress.advance(bucket.nbytes)
                if bucket.reader != route.position:
                    used = receive(
                        stream,
                        leaders.sent_by(route.group[bucket.reader]),
                        index,
                        received,
                        free,
                        staging,
                    )
                    if used is None:
                        continue
                else:
                    channel = leaders.sent_by(route.board.rank)
                    buffer, source = _next_read(stream, prefetch, in_use, None, channel)
                    work, copied, crossed = send(stream, channel, index, source, staging)
                    sent += crossed
                    used = InUse(sends=[work], release=partial(prefetch.release, buffer, copied))
                    used.done = stream.announce(index, BUFFERS + buffer, bucket.nbytes)
                    stream.apply(index, source)
                    del source
                stream.hold(in_use, used)
            stream.settle(in_use)
            if share:  # the bytes sent were one version of the checkpoint
                reader.check_unchanged()
        finally:
            prefetch.close()
    return reader.bytes_read, sent


def _next_read(
    stream: Stream,
    prefetch: Prefetcher[Any],
    in_use: deque[InUse],
    frontier: Frontier | None,
    leaders: Channel | None,
) -> tuple[int, Any]:
    """The reader's next bucket from its read-ahead, and every peer's wait starts again; a read
    error goes to the node (``frontier`` or its header) and to the other leaders (``leaders``,
    from this reader) once what was announced is delivered, and is raised."""
    try:
        fetched = prefetch.next()
    except CollectiveError:  # a stall or a peer's failure: on the board already
        raise
    except BaseException as e:
        for used in in_use:
            stream.deliver(used)
        message = f"reader rank {stream.route.board.rank} failed: {type(e).__name__}: {e}"
        stream.fail(message, frontier, leaders=leaders)
        raise
    stream.route.board.advance()
    return fetched


def _filled(
    stream: Stream,
    reader: TensorReader,
    buffers: list[torch.Tensor],
    index: int,
    buffer: int,
    pool: Executor,
) -> Payload:
    """Bucket ``index`` read into ``buffers[buffer]`` (in the read-ahead thread)."""
    bucket = stream.plan.buckets[index]
    payload = buffers[buffer][: bucket.nbytes]
    fill(reader, bucket, payload, pool)
    return Payload(payload)


@contextmanager
def _reader_buffers(stream: Stream) -> Iterator[list[torch.Tensor]]:
    """The reader's bucket buffers: its node's shared ones, or with the page cache private
    ones for the buckets other nodes need (none on a single node)."""
    import torch

    if not stream.route.page_cache:
        with stream.buffers() as buffers:
            yield buffers
        return
    size = stream.plan.max_bucket_bytes if stream.route.leaders is not None else 0
    pin = stream.route.device.type == "cuda" and size > 0
    yield [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(BUFFERS)]
