"""Striped readers (``reader=striped``): every node leader reads a share of the buckets.

One client of a parallel file system reads at a few GB/s, the file system serves
all nodes together at tens of times that: with one reader, a job's cold load takes
as long as one client needs for the whole checkpoint. Striped, each bucket is still
read once, by the leader of a node that needs it, and crosses from there to the
other nodes that need it; the job's read bandwidth is the sum of its readers'.
Plain data in, plain data out, the same on every rank.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from megastart.loader.plan.buckets import Bucket, Plan
from megastart.loader.plan.nodes import Nodes


def stripe(plan: Plan, nodes: Nodes) -> Plan:
    """``plan`` with each bucket's reader chosen, in the order the stream takes them.

    A bucket's reader is the leader of one of the nodes that need it (so no node
    receives what it does not need), the one with the fewest bytes to read so far:
    the shares are as even as the nodes' needs allow. The stream then takes the
    receiver sets' buckets in turn, weighted by their bytes, each set's in plan order
    (file order; an FP8 weight's scales still come before it): consecutive buckets come
    from different readers wherever the plan has several, and each reader reads its
    next buckets while the others' cross.
    """
    load = dict.fromkeys(nodes.leaders, 0)
    queues: dict[tuple[int, ...], list[Bucket]] = {}
    for bucket in plan.buckets:
        reader = min(nodes.leaders_reached(bucket.positions), key=load.__getitem__)
        load[reader] += bucket.nbytes
        queues.setdefault(bucket.positions, []).append(replace(bucket, reader=reader))
    return Plan(tuple(_interleaved(list(queues.values()))))


def _interleaved(queues: list[list[Bucket]]) -> list[Bucket]:
    """Every queue's buckets in its own order, next always from the queue that has sent the
    smallest fraction of its bytes (ties: the first queue)."""
    totals = [max(sum(b.nbytes for b in queue), 1) for queue in queues]
    heap = [(0.0, i, 0, 0) for i in range(len(queues))]  # (fraction sent, queue, next, bytes sent)
    order = []
    while heap:
        _, i, next_, sent = heapq.heappop(heap)
        bucket = queues[i][next_]
        order.append(bucket)
        if next_ + 1 < len(queues[i]):
            sent += bucket.nbytes
            heapq.heappush(heap, (sent / totals[i], i, next_ + 1, sent))
    return order
