"""The stream's roles on one rank (:mod:`megastart.loader.stream.route`), each a function of the
rank's :class:`~megastart.loader.stream.stream.Stream`:

* :func:`read`: the **reader** (first rank of its reader group, leader of its node)
  reads each bucket in a background thread
  (:class:`~megastart.loader.stream.transport.Prefetcher`): into the page cache when only
  its node needs it, and its node's ranks copy from their own mappings of the files
  (:mod:`megastart.loader.stream.pagecache`, ``reader_node=page_cache``); else into a
  buffer (with ``shared_memory``, one of its node's shared buffers), which it
  broadcasts to the other nodes' leaders that need it;
* :func:`relay`: a **leader** of another node receives the buckets its node needs
  straight into its node's shared buffers and announces them;
* :func:`read_share`: with striped readers (:mod:`megastart.loader.plan.stripes`), every
  **leader** reads its share of the buckets into its node's shared buffers and sends
  each to the other nodes that need it, and receives the rest its node needs, as
  :func:`relay` does;
* :func:`take`: every other rank waits for its node's announcements and copies its
  slices out of the shared buffer; :func:`take_cached`: on the reader's node with the
  page cache, out of its own mapping of the files once the reader has read the bucket.
"""

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
from megastart.loader.stream.pagecache import Frontier, Window
from megastart.loader.stream.progress import Progress
from megastart.loader.stream.stream import BUFFERS, InUse, Payload, Source
from megastart.loader.stream.transport import (
    IN_FLIGHT,
    READ_PART_BYTES,
    Channel,
    Prefetcher,
    ReaderError,
    fill,
)

if TYPE_CHECKING:
    import torch

    from megastart.loader.stream.stream import Stream


def run(stream: Stream, settings: Rank0LoaderSettings) -> tuple[int, int]:
    """Stream every bucket this rank takes part in, in its role; returns (bytes read, bytes
    sent between nodes)."""
    try:
        return _in_role(stream, settings)
    finally:
        if stream.landing is not None:
            stream.landing.close()
        stream.mappings.close()


def _in_role(stream: Stream, settings: Rank0LoaderSettings) -> tuple[int, int]:
    route = stream.route
    if route.page_cache and settings.cuda_copy == "registered":
        stream.copier.register_ahead(stream.mappings, stream.plan, stream.straight_slots)
    elif settings.cuda_copy == "preads" or (
        settings.cuda_copy == "auto" and route.device.type == "cuda"
    ):
        stream.landing = stream.copier.landing(
            stream.meta, stream.consumers, stream.tensors, stream.shard
        )
    if route.striped and route.leads:
        return read_share(stream, settings)
    if route.position == 0:
        return read(stream, settings)
    if route.leads:
        return relay(stream)
    if route.page_cache:
        return take_cached(stream)
    return take(stream)


def read(stream: Stream, settings: Rank0LoaderSettings) -> tuple[int, int]:
    reader = TensorReader(stream.meta)
    progress = Progress(stream.plan.nbytes, enabled=settings.progress)
    leaders = stream.route.leaders
    staging = _staging(stream)
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
                    work, copied, crossed = _send(stream, leaders, index, source, staging)
                    used.sends.append(work)
                    sent += crossed
                used.done = stream.announce(index, buffer, bucket.nbytes)
                used.release = partial(prefetch.release, buffer, copied)
                stream.apply(index, source)
                if isinstance(source, Window):
                    source.release()
                del source
                progress.advance(bucket.nbytes)
                in_use.append(used)
                if len(in_use) == IN_FLIGHT:
                    stream.finish(in_use.popleft())
            while in_use:
                stream.finish(in_use.popleft())
            stream.drain()
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


def relay(stream: Stream) -> tuple[int, int]:
    """Another node's leader: receive its node's buckets into the shared buffers, announce them."""
    leaders = stream.route.leaders
    assert leaders is not None
    staging = _staging(stream)
    in_use: deque[InUse] = deque()
    with stream.buffers() as buffers:
        free = deque(range(len(buffers)))
        for index in range(len(stream.plan.buckets)):
            used = _receive(stream, leaders, index, buffers, free, staging)
            if used is None:
                continue
            in_use.append(used)
            if len(in_use) == IN_FLIGHT:
                stream.finish(in_use.popleft())
        while in_use:
            stream.finish(in_use.popleft())
        stream.drain()
    return 0, 0


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
    staging = _staging(stream)
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
                    used = _receive(
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
                    work, copied, crossed = _send(stream, channel, index, source, staging)
                    sent += crossed
                    used = InUse(sends=[work], release=partial(prefetch.release, buffer, copied))
                    used.done = stream.announce(index, BUFFERS + buffer, bucket.nbytes)
                    stream.apply(index, source)
                    del source
                in_use.append(used)
                if len(in_use) == IN_FLIGHT:
                    stream.finish(in_use.popleft())
            while in_use:
                stream.finish(in_use.popleft())
            stream.drain()
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


def _send(
    stream: Stream, leaders: Channel, index: int, source: Payload, staging: list[torch.Tensor]
) -> tuple[Any, Any, int]:
    """Start the broadcast of bucket ``index`` to the other nodes that need it; returns the
    broadcast in flight, the CUDA event after which ``source`` may be refilled (``None``: once
    the broadcast is done), and the bytes that cross to other nodes."""
    import torch

    bucket = stream.plan.buckets[index]
    wire, copied = source.data, None
    if staging:  # NCCL between nodes: the buffer travels from the GPU
        wire = staging[index % IN_FLIGHT][: bucket.nbytes]
        wire.copy_(source.data, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    to = stream.route.leaders_for(bucket.positions)
    return leaders.send(wire, to), copied, bucket.nbytes * (len(to) - 1)


def _receive(
    stream: Stream,
    leaders: Channel,
    index: int,
    buffers: list[torch.Tensor],
    free: deque[int],
    staging: list[torch.Tensor],
) -> InUse | None:
    """Receive bucket ``index`` from ``leaders``' sender into a ``free`` buffer, announce it to
    the node and apply it (``None``: no rank of this node needs it)."""
    import torch

    bucket = stream.plan.buckets[index]
    to = stream.route.leaders_for(bucket.positions)
    target = staging[index % IN_FLIGHT] if staging else buffers[free[0]]
    try:
        started = leaders.receive(target, to, bucket.nbytes)
    except ReaderError as e:
        stream.fail(str(e))
        raise
    if started is None:
        return None
    buffer = free.popleft()
    payload, work = started
    leaders.wait(work, "a bucket's broadcast")
    if staging:
        buffers[buffer][: bucket.nbytes].copy_(payload)
        torch.cuda.current_stream().synchronize()
    done = stream.announce(index, buffer, bucket.nbytes)
    stream.apply(index, Payload(buffers[buffer][: bucket.nbytes]))
    return InUse(done=done, release=partial(free.append, buffer))


def take(stream: Stream) -> tuple[int, int]:
    """A rank that leads nothing: copy its slices out of each announced buffer."""
    import torch

    local, done = stream.route.local, stream.route.done
    assert local is not None and done is not None
    reported: deque[Any] = deque()
    with stream.buffers() as buffers:
        for index in stream.local:
            bucket = stream.plan.buckets[index]
            buffer = local.announced(bucket.nbytes, buffers[0].numel(), len(buffers))
            stream.apply(index, Payload(buffers[buffer][: bucket.nbytes]))
            reported.append(done.all_reduce(torch.zeros(1)))
            if len(reported) == IN_FLIGHT:
                stream.reported(reported.popleft())
        while reported:
            stream.reported(reported.popleft())
    return 0, 0


def take_cached(stream: Stream) -> tuple[int, int]:
    """A rank of the reader's node that reads no files: copy this rank's slices out of the
    load's mappings of the files, at once where their pages are in the page cache already
    (a warm load: every rank of the node copies in parallel, as per-rank slices would), and
    the others once the reader has read their bucket into it. A bucket the reader has read
    already is copied without asking the kernel."""
    frontier = stream.frontier()
    assert frontier is not None
    for index, bucket in enumerate(stream.plan.buckets):
        mine = stream.mine(bucket)
        if not mine:
            continue
        window = Window(stream.mappings, mine)
        # Behind the reader, its word says the pages are resident: no mincore of its own (a
        # warm 1 GB load's 54 per rank cost 22 ms of each rank's CPU on 2 quiet cores).
        read = frontier.reached(index + 1)
        cached, not_yet = (mine, []) if read else window.resident_slots(mine)
        if cached:
            stream.apply(index, window, cached)
        if not_yet:
            frontier.wait(index + 1, stream.route.board)
            stream.apply(index, window, not_yet)
        window.release()
    return 0, 0


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


def _staging(stream: Stream) -> list[torch.Tensor]:
    """GPU buffers for NCCL between node leaders (none for gloo, or a single node)."""
    import torch

    leaders = stream.route.leaders
    if leaders is None or leaders.device.type != "cuda":
        return []
    size = stream.plan.max_bucket_bytes
    return [torch.empty(size, dtype=torch.uint8, device=leaders.device) for _ in range(IN_FLIGHT)]
