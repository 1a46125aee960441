"""Buckets crossing between nodes: a reader's broadcast to the other nodes' leaders, a
leader's receive into its node's shared buffers (:func:`relay`), through GPU staging buffers
where NCCL carries them."""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

from megastart.loader.stream.sources import InUse, Payload
from megastart.loader.stream.transport import IN_FLIGHT, Channel, ReaderError

if TYPE_CHECKING:
    import torch

    from megastart.loader.stream.stream import Stream


def relay(stream: Stream) -> tuple[int, int]:
    """Another node's leader: receive its node's buckets into the shared buffers, announce them."""
    leaders = stream.route.leaders
    assert leaders is not None
    staging = staging_buffers(stream)
    in_use: deque[InUse] = deque()
    with stream.buffers() as buffers:
        free = deque(range(len(buffers)))
        for index in range(len(stream.plan.buckets)):
            used = receive(stream, leaders, index, buffers, free, staging)
            if used is None:
                continue
            stream.hold(in_use, used)
        stream.settle(in_use)
    return 0, 0


def send(
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


def receive(
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


def staging_buffers(stream: Stream) -> list[torch.Tensor]:
    """GPU buffers for NCCL between node leaders (none for gloo, or a single node)."""
    import torch

    leaders = stream.route.leaders
    if leaders is None or leaders.device.type != "cuda":
        return []
    size = stream.plan.max_bucket_bytes
    return [torch.empty(size, dtype=torch.uint8, device=leaders.device) for _ in range(IN_FLIGHT)]
