"""The stream's roles on one rank (:mod:`megastart.loader.stream.route`), each a function of the
rank's :class:`~megastart.loader.stream.stream.Stream`:

* :func:`~megastart.loader.stream.readers.read`: the **reader** (first rank of its reader group, leader of its node)
  reads each bucket in a background thread
  (:class:`~megastart.loader.stream.prefetch.Prefetcher`): into the page cache when only
  its node needs it, and its node's ranks copy from their own mappings of the files
  (:mod:`megastart.loader.stream.pagecache`, ``reader_node=page_cache``); else into a
  buffer (with ``shared_memory``, one of its node's shared buffers), which it
  broadcasts to the other nodes' leaders that need it;
* :func:`~megastart.loader.stream.crossing.relay`: a **leader** of another node receives the buckets its node needs
  straight into its node's shared buffers and announces them;
* :func:`~megastart.loader.stream.readers.read_share`: with striped readers (:mod:`megastart.loader.plan.stripes`), every
  **leader** reads its share of the buckets into its node's shared buffers and sends
  each to the other nodes that need it, and receives the rest its node needs, as
  :func:`relay` does;
* :func:`take`: every other rank waits for its node's announcements and copies its
  slices out of the shared buffer; :func:`take_cached`: on the reader's node with the
  page cache, out of its own mapping of the files once the reader has read the bucket.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from megastart.loader.settings import Rank0LoaderSettings
from megastart.loader.stream.crossing import relay
from megastart.loader.stream.pagecache import Window
from megastart.loader.stream.readers import read, read_share
from megastart.loader.stream.sources import Payload
from megastart.loader.stream.transport import IN_FLIGHT

if TYPE_CHECKING:
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
