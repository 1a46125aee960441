"""The stream phase: the reader sends every bucket, each rank copies its shards into its parameters.

One :class:`Stream` per rank and load. The reader (the first rank of its
reader group) reads buckets ahead in a background thread (``transport``'s
:class:`~megastart.loader.transport.Prefetcher`), broadcasts each to the ranks
that need it, :data:`~megastart.loader.transport.IN_FLIGHT` at a time, and
applies it to its own parameters while the next travels; a receiver posts its
receives the same way and applies each bucket once it has arrived. What a rank
applies is decided by its needs: the transform of each HF tensor into the
parameter slice this rank holds, recorded in the coverage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from megastart.distributed import CollectiveError
from megastart.loader.checkpoint import CheckpointMeta, TensorReader
from megastart.loader.plan import Need, Plan
from megastart.loader.progress import Progress
from megastart.loader.settings import Rank0LoaderSettings
from megastart.loader.transforms import TRANSFORMS, Shard
from megastart.loader.transport import IN_FLIGHT, Channel, Prefetcher, ReaderError, slot_view
from megastart.loader.verify import Coverage

if TYPE_CHECKING:
    import torch


class Stream:
    """One rank's side of the stream: send (reader) or receive, then copy shards into parameters."""

    def __init__(
        self,
        plan: Plan,
        needs: list[Need],
        tensors: dict[tuple[int, str], torch.Tensor],
        shard: Shard,
        coverage: Coverage,
        channel: Channel,
        group: list[int],
    ) -> None:
        self.plan = plan
        self.tensors = tensors
        self.shard = shard
        self.coverage = coverage
        self.channel = channel
        self.ranks = [tuple(group[i] for i in bucket.ranks) for bucket in plan.buckets]
        """Global ranks each bucket is broadcast to (the reader first)."""
        self.consumers: dict[str, list[tuple[Need, int]]] = {}
        """HF tensor name -> this rank's needs that take it, and as which input."""
        for need in needs:
            for index, name in enumerate(need.hf):
                self.consumers.setdefault(name, []).append((need, index))

    def run_reader(self, meta: CheckpointMeta, settings: Rank0LoaderSettings) -> tuple[int, int]:
        """Read, broadcast and apply every bucket; returns (bytes read, bytes broadcast)."""
        import torch

        device = self.channel.device
        on_cuda = device.type == "cuda"
        reader = TensorReader(meta)
        # On CPU gloo sends from the host buffer itself, so each one in flight holds one;
        # on CUDA a host buffer is free once copied to its staging buffer on the GPU.
        prefetch = Prefetcher(
            reader,
            self.plan,
            buffers=2 if on_cuda else IN_FLIGHT + 1,
            pin=on_cuda,
            board=self.channel.board,
        )
        progress = Progress(self.plan.nbytes, enabled=settings.progress)
        staging = [
            torch.empty(
                self.plan.max_bucket_bytes if on_cuda else 0, dtype=torch.uint8, device=device
            )
            for _ in range(IN_FLIGHT)
        ]
        in_flight: deque[tuple[Any, Callable[[], None]]] = deque()
        sent = 0
        try:
            for index, bucket in enumerate(self.plan.buckets):
                try:
                    host = prefetch.next()
                except CollectiveError:  # a stall or a peer's failure: on the board already
                    raise
                except BaseException as e:
                    while in_flight:  # what was announced is delivered before the error
                        self._finish(*in_flight.popleft())
                    self.channel.send_error(
                        f"reader rank {self.channel.src} failed: {type(e).__name__}: {e}"
                    )
                    raise
                payload = host[: bucket.nbytes]
                if on_cuda:
                    payload = staging[index % IN_FLIGHT][: bucket.nbytes]
                    payload.copy_(host[: bucket.nbytes], non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record()  # the host buffer may be refilled once this has passed
                    prefetch.release(host, copied)
                    done = _nothing
                else:
                    done = partial(prefetch.release, host)
                in_flight.append((self.channel.send(payload, self.ranks[index]), done))
                sent += bucket.nbytes if len(self.ranks[index]) > 1 else 0
                self._apply(index, payload)
                progress.advance(bucket.nbytes)
                if len(in_flight) == IN_FLIGHT:
                    self._finish(*in_flight.popleft())
            while in_flight:
                self._finish(*in_flight.popleft())
            self._drain()
        finally:
            prefetch.close()
        return reader.bytes_read, sent

    def run_receiver(self) -> tuple[int, int]:
        """Receive this rank's buckets, ``IN_FLIGHT`` at a time, applying each once it has arrived."""
        import torch

        buffers = [
            torch.empty(self.plan.max_bucket_bytes, dtype=torch.uint8, device=self.channel.device)
            for _ in range(IN_FLIGHT)
        ]
        in_flight: deque[tuple[Any, Callable[[], None]]] = deque()
        received = 0
        try:
            for index, ranks in enumerate(self.ranks):
                nbytes = self.plan.buckets[index].nbytes
                started = self.channel.receive(buffers[received % IN_FLIGHT], ranks, nbytes)
                if started is None:
                    continue
                payload, work = started
                received += 1
                in_flight.append((work, partial(self._apply, index, payload)))
                if len(in_flight) == IN_FLIGHT:
                    self._finish(*in_flight.popleft())
        except ReaderError:
            while in_flight:  # the reader sent these before its error: take them off the wire
                self.channel.wait(in_flight.popleft()[0], "a bucket sent before the error")
            raise
        while in_flight:
            self._finish(*in_flight.popleft())
        self._drain()
        return 0, 0

    def _finish(self, work: Any, then: Callable[[], None]) -> None:
        """Wait for one broadcast in flight (bounded, watching the board), then run ``then``."""
        if work is not None:
            self.channel.wait(work, "a bucket's broadcast")
        then()

    def _drain(self) -> None:
        """Wait for the queued copies and broadcasts: the loader's groups are destroyed next."""
        import torch

        if self.channel.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _apply(self, index: int, payload: torch.Tensor) -> None:
        import torch

        with torch.no_grad():
            for slot in self.plan.buckets[index].slots:
                for need, input_index in self.consumers.get(slot.name, ()):
                    param = self.tensors[(need.param.chunk, need.param.local_name)]
                    for first, stop, piece in TRANSFORMS[need.transform].blocks(
                        input_index,
                        slot_view(payload, slot),
                        slot.rows,
                        need.param.shape,
                        self.shard,
                    ):
                        param.data[first:stop].copy_(piece)
                        self.coverage.record(need.param, first, stop)


def _nothing() -> None:
    pass
