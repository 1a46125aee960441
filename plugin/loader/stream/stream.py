"""The stream phase on one rank: what its roles share (:mod:`megastart.loader.stream.roles`).

Every rank applies a bucket (the transform of each HF tensor into the slice
of each of its parameters that this rank holds, recorded in the coverage)
from its node's shared memory or the page cache: into CPU parameters with one
copy; into CUDA parameters with one host-to-device copy per rank, from the
page-locked buffer or through page-locked chunks filled on a few threads
(:mod:`megastart.loader.stream.copier`), so a node's GPUs fill in parallel over
their own links. A buffer is refilled
once every local rank has reported it read; :data:`IN_FLIGHT` buckets are in
use at once, and one more buffer is being filled.

Every wait of a rank on another (a header, a broadcast, a buffer's reports,
the reader's read-ahead) looks at the load's
:class:`~megastart.distributed.Board` between slices: a failure anywhere
stops it at once, and a stall is named after ``timeout_s``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from megastart.loader.checkpoint import CheckpointMeta
from megastart.loader.mapping.dequantise import BlockScaled
from megastart.loader.mapping.needs import Need
from megastart.loader.mapping.transforms import TRANSFORMS, Rows, Shard
from megastart.loader.mapping.unpack import Packed
from megastart.loader.plan.buckets import Bucket, Plan, Slot
from megastart.loader.plan.verify import Coverage
from megastart.loader.stream.copier import Copier
from megastart.loader.stream.frontier import Frontier
from megastart.loader.stream.landing import Landing
from megastart.loader.stream.mappings import FileMappings
from megastart.loader.stream.node import node_segment
from megastart.loader.stream.route import Route
from megastart.loader.stream.shm import Segment
from megastart.loader.stream.sources import InUse, Source
from megastart.loader.stream.straight import consumers_of, goes_straight
from megastart.loader.stream.transport import IN_FLIGHT, Channel

if TYPE_CHECKING:
    import torch

BUFFERS = IN_FLIGHT + 1
"""Bucket-sized buffers per node: :data:`IN_FLIGHT` in use, one being filled."""


class Stream:
    """One rank's side of the stream of one load."""

    def __init__(
        self,
        meta: CheckpointMeta,
        plan: Plan,
        needs: list[Need],
        tensors: dict[tuple[int, str], torch.Tensor],
        shard: Shard,
        coverage: Coverage,
        route: Route,
        copier: Copier,
    ) -> None:
        self.meta = meta
        self.plan = plan
        self.tensors = tensors
        self.shard = shard
        self.coverage = coverage
        self.route = route
        self.copier = copier
        self.consumers = consumers_of(needs)
        """HF tensor name -> this rank's needs that take it, and as which input."""
        self.scales: dict[str, torch.Tensor] = {}
        """Scales received so far, by name (each arrives before its weight)."""
        self._rows_left: dict[str, int] = {}
        """Per scales held, the rows of their weight not yet applied here."""
        self.local = route.local_buckets(plan)
        """The buckets announced inside this rank's node, in order."""
        self._announced = 0
        """How many of :attr:`local` the leader has announced."""
        self.mappings = FileMappings(meta)
        """The checkpoint's files, mapped once for the load (the page-cache route)."""
        self.landing: Landing | None = None  # where slots land to be cut on the device (roles)

    def mine(self, bucket: Bucket) -> list[Slot]:
        """The slots of ``bucket`` this rank copies from."""
        return [slot for slot in bucket.slots if slot.name in self.consumers]

    def straight_slots(self, bucket: Bucket) -> list[Slot]:
        """The slots of ``bucket`` this rank copies a piece of straight out of the registered page
        cache (:func:`~megastart.loader.stream.straight.goes_straight`): the only ones whose blocks are worth registering."""
        return [
            slot
            for slot in self.mine(bucket)
            if goes_straight(slot, self.meta, self.consumers[slot.name], self.tensors, self.shard)
        ]

    def announce(self, index: int, buffer: int, nbytes: int) -> Any:
        """Tell the node's other ranks that bucket ``index`` is in ``buffer``, if one needs it;
        returns the report of their having read it, in flight (``None`` if none needs it)."""
        import torch

        local = self.route.local
        if (
            local is None
            or self._announced == len(self.local)
            or self.local[self._announced] != index
        ):
            return None
        local.announce(nbytes, buffer)  # in order before the report, which is waited for
        self._announced += 1
        assert self.route.done is not None  # a node with a local channel has one
        return self.route.done.all_reduce(torch.zeros(1))

    def deliver(self, used: InUse) -> None:
        """Wait until a bucket's broadcasts to other nodes are done (watching the board)."""
        for work in used.sends:
            if work is not None:
                assert self.route.leaders is not None
                self.route.leaders.wait(work, "a bucket's broadcast")

    def finish(self, used: InUse) -> None:
        """Wait until no rank reads a bucket's buffer any more (watching the board); free the buffer."""
        self.deliver(used)
        if used.done is not None:
            self.reported(used.done)
        if used.release is not None:
            used.release()

    def hold(self, in_use: deque[InUse], used: InUse) -> None:
        """Keep ``used`` in flight, finishing the oldest once :data:`IN_FLIGHT` are."""
        in_use.append(used)
        if len(in_use) == IN_FLIGHT:
            self.finish(in_use.popleft())

    def settle(self, in_use: deque[InUse]) -> None:
        """Finish every bucket still in flight, then :meth:`drain`."""
        while in_use:
            self.finish(in_use.popleft())
        self.drain()

    def reported(self, work: Any, what: str = "copied their slices of a bucket") -> None:
        """Wait for the node's ranks' report over :attr:`Route.done` (watching the board)."""
        members = self.route.members
        self.route.board.wait_work(work, f"the reports of node ranks {members} that they {what}")

    def fail(
        self, message: str, frontier: Frontier | None = None, *, leaders: Channel | None = None
    ) -> None:
        """Pass a reader's failure on: to the other leaders (from the reader, over ``leaders``),
        and to this node's ranks while they still wait for an announcement (or poll the
        ``frontier``)."""
        if leaders is not None:
            leaders.send_error(message)
        if frontier is not None:
            frontier.fail(message)
        elif self.route.local is not None and self._announced < len(self.local):
            self.route.local.send_error(message)

    @contextmanager
    def buffers(self) -> Iterator[list[torch.Tensor]]:
        """The node's bucket buffers: a shared segment for a node of several ranks, private
        memory otherwise."""
        import torch

        size = self.plan.max_bucket_bytes
        pin = self.route.device.type == "cuda"
        count = self.buffer_count
        if self.route.local is None:
            yield [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
            return
        with self.segment(count * size) as segment:
            if pin:
                segment.pin(self.copier.driver)
            assert segment.tensor is not None
            # The leader's buffer size: a rank whose plan differs learns it from the first header.
            size = segment.nbytes // count
            yield [segment.tensor[i * size : (i + 1) * size] for i in range(count)]

    @property
    def buffer_count(self) -> int:
        """The node's bucket buffers: :data:`BUFFERS`, and as many again for a striped reader's
        read-ahead (its reads and the buckets it receives take turns in separate buffers, so
        neither waits for the other's)."""
        return 2 * BUFFERS if self.route.striped else BUFFERS

    def frontier(self) -> Frontier | None:
        """How far the reader has read into the page cache, shared by its node's ranks on their
        page (``None`` where no other rank polls it: the shared-memory route, a node of one
        rank); the others check their plan against the reader's first."""
        if not self.route.page_cache or len(self.route.node) == 1:
            return None
        assert self.route.page is not None  # a node of several ranks has one
        frontier = Frontier(self.route.page.spare, f"the reader (rank {self.route.group[0]})")
        if self.route.position == 0:
            frontier.plan(self.plan)
        else:
            frontier.check(self.plan, self.route.board)
        return frontier

    def segment(
        self, nbytes: int, fill: Callable[[Segment], None] | None = None
    ) -> AbstractContextManager[Segment]:
        """The node's shared segment of ``nbytes`` (see :func:`~megastart.loader.stream.node.node_segment`)."""
        route = self.route
        assert route.page is not None  # a node of several ranks has one
        return node_segment(route.board, route.page, route.members, nbytes=nbytes, fill=fill)

    def drain(self) -> None:
        """Wait for the queued copies and broadcasts: the loader's groups are destroyed next."""
        import torch

        if self.route.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def apply(self, index: int, source: Source, slots: list[Slot] | None = None) -> None:
        """Copy this rank's slices of bucket ``index`` (of ``slots`` of it: by default all)
        from ``source`` into its parameters (converting to their dtype); returns once the
        copies have read ``source`` (the buffer may be refilled then; copies into CUDA may
        still be in flight until the copier closes)."""
        import torch

        with torch.no_grad(), self.copier.batch():
            if self.landing is not None:  # cut on the parameters' device
                source = self.landing.land(slots or self.plan.buckets[index].slots, source)
            for slot in self.plan.buckets[index].slots if slots is None else slots:
                for need, input_index in self.consumers.get(slot.name, ()):
                    if input_index >= len(need.hf):  # a quantised weight's scales: kept for it
                        self._keep_scale(slot, source.view(slot))
                        continue
                    param = self.tensors[(need.param.chunk, need.param.local_name)]
                    held: Any = source.view(slot)
                    scale = need.scales[input_index] if need.scales else ""
                    if scale:
                        held = self._quantised(held, scale, param.dtype, slot.rows)
                    for first, stop, piece in TRANSFORMS[need.transform].blocks(
                        input_index, held, slot.rows, need.param.shape, self.shard
                    ):
                        target = param.data[first:stop]
                        if scale:
                            self.copier.copy(target, piece.dequantised(), False)
                        elif not source.read_into(target, piece):
                            self.copier.copy(target, piece, source.page_locked)
                        self.coverage.record(need.param, first, stop)
                self._release_scale(slot)

    def _quantised(self, held: torch.Tensor, scale: str, dtype: torch.dtype, rows: Rows) -> Any:
        """Rows ``rows`` of a quantised weight, held as stored, with their scales: dequantised
        piece by piece as the transform takes them."""
        quantisation = self.meta.quantisation
        assert quantisation is not None
        scales = self.scales[scale]
        if quantisation.packing:
            return Packed.whole(held, scales[rows.start : rows.stop], quantisation.packing)
        assert quantisation.weight_block is not None
        return BlockScaled(held, scales, quantisation.weight_block, dtype, rows.start)

    def _keep_scale(self, slot: Slot, rows: torch.Tensor) -> None:

        scale = self.scales.get(slot.name)
        if scale is None:
            shape = self.meta.tensors[slot.name].shape
            scale = self.scales[slot.name] = rows.new_empty(shape)
            quantisation = self.meta.quantisation
            weight = quantisation.weight_of(slot.name) if quantisation else None
            if weight is not None and self.meta.tensors[weight].shape:
                self._rows_left[slot.name] = self.meta.tensors[weight].shape[0]
        scale[slot.rows.start : slot.rows.stop] = rows

    def _release_scale(self, slot: Slot) -> None:
        """Forget a weight's scales once all of its rows were applied here."""
        quantisation = self.meta.quantisation
        if quantisation is None:
            return
        scale = quantisation.scale_of(slot.name, self.meta.tensors[slot.name].dtype)
        if scale in self._rows_left:
            self._rows_left[scale] -= slot.rows.stop - slot.rows.start
            if self._rows_left[scale] <= 0:
                del self._rows_left[scale], self.scales[scale]
