"""The stream phase on one rank: read or receive each bucket once per node, copy this rank's shards.

Three roles (:mod:`megastart.loader.route`):

* the **reader** (first rank of its reader group, leader of its node) reads
  each bucket, in a background thread (:class:`~megastart.loader.transport.Prefetcher`):
  into the page cache when only its node needs it, and its node's ranks copy
  from their own mappings of the files (:mod:`megastart.loader.pagecache`,
  ``reader_node=page_cache``); else into a buffer (with ``shared_memory``, one
  of its node's shared slots), which it broadcasts to the other nodes' leaders
  that need it;
* a **leader** of another node receives the buckets its node needs straight
  into its node's shared slots and announces them;
* every other rank waits for its node's announcements and copies its slices
  out of the shared slot.

Every rank applies a bucket (the transform of each HF tensor into the slice
of each of its parameters that this rank holds, recorded in the coverage)
from its node's shared memory or the page cache: into CPU parameters with one
copy; into CUDA parameters with one host-to-device copy per rank, from the
page-locked slot or through page-locked chunks filled on a few threads
(:mod:`megastart.loader.copier`), so a node's GPUs fill in parallel over
their own links. A slot is refilled
once every local rank has reported it read; :data:`IN_FLIGHT` buckets are in
use at once, and one more slot is being filled.

Every wait of a rank on another (a header, a broadcast, a slot's reports,
the reader's read-ahead) looks at the load's
:class:`~megastart.distributed.Board` between slices: a failure anywhere
stops it at once, and a stall is named after ``timeout_s``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from megastart.distributed import CollectiveError
from megastart.loader.checkpoint import CheckpointMeta, TensorReader
from megastart.loader.copier import Copier
from megastart.loader.pagecache import Frontier, Window
from megastart.loader.plan import Bucket, Need, Plan, Slot
from megastart.loader.progress import Progress
from megastart.loader.route import Route
from megastart.loader.settings import Rank0LoaderSettings
from megastart.loader.shm import Segment
from megastart.loader.transforms import TRANSFORMS, Shard
from megastart.loader.transport import (
    IN_FLIGHT,
    READ_PART_BYTES,
    Prefetcher,
    ReaderError,
    fill,
    slot_view,
)
from megastart.loader.verify import Coverage

if TYPE_CHECKING:
    import torch

SLOTS = IN_FLIGHT + 1
"""Bucket-sized slots per node: :data:`IN_FLIGHT` in use, one being filled."""


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
        self.consumers: dict[str, list[tuple[Need, int]]] = {}
        """HF tensor name -> this rank's needs that take it, and as which input."""
        for need in needs:
            for index, name in enumerate(need.hf):
                self.consumers.setdefault(name, []).append((need, index))
        self.local = route.local_buckets(plan)
        """The buckets announced inside this rank's node, in order."""
        self._announced = 0
        """How many of :attr:`local` the leader has announced."""

    def run(self, settings: Rank0LoaderSettings) -> tuple[int, int]:
        """Stream every bucket this rank takes part in; returns (bytes read, bytes sent between nodes)."""
        if self.route.position == 0:
            return self._read(settings)
        if self.route.leads:
            return self._relay()
        if self.route.page_cache:
            return self._take_cached()
        return self._take()

    def _read(self, settings: Rank0LoaderSettings) -> tuple[int, int]:
        import torch

        reader = TensorReader(self.meta)
        progress = Progress(self.plan.nbytes, enabled=settings.progress)
        leaders = self.route.leaders
        staging = self._staging()
        in_use: deque[_InUse] = deque()
        sent = 0
        with self._reader_slots() as slots, self._frontier() as frontier:
            fetch = partial(self._fetch, reader, slots, frontier)
            # From the page cache alone, nothing bounds the read-ahead: it holds no memory.
            ahead = len(self.plan.buckets) if self.route.page_cache and leaders is None else SLOTS
            prefetch = Prefetcher(reader, self.plan, fetch, ahead, board=self.route.board)
            try:
                for index, bucket in enumerate(self.plan.buckets):
                    try:
                        slot, source = prefetch.next()
                    except CollectiveError:  # a stall or a peer's failure: on the board already
                        raise
                    except BaseException as e:
                        for used in in_use:  # what was announced is delivered before the error
                            self._deliver(used)
                        self._fail(
                            f"reader rank {self.route.group[0]} failed: {type(e).__name__}: {e}",
                            frontier,
                        )
                        raise
                    self.route.board.advance()  # every peer's wait starts again
                    used = _InUse()
                    copied = None
                    if leaders is not None and isinstance(source, Window):  # no other node needs it
                        used.sends.append(leaders.announce(bucket.nbytes, 0))
                    elif leaders is not None:
                        wire = source.data
                        if staging:  # NCCL between nodes: the slot travels from the GPU
                            wire = staging[index % IN_FLIGHT][: bucket.nbytes]
                            wire.copy_(source.data, non_blocking=True)
                            copied = torch.cuda.Event()
                            copied.record()
                        to = self.route.leaders_for(bucket.ranks)
                        used.sends.append(leaders.send(wire, to))
                        sent += bucket.nbytes if len(to) > 1 else 0
                    used.done = self._announce(index, slot, bucket.nbytes)
                    used.release = partial(prefetch.release, slot, copied)
                    self._apply(index, source)
                    del source  # a bucket's mapping goes once it is applied
                    progress.advance(bucket.nbytes)
                    in_use.append(used)
                    if len(in_use) == IN_FLIGHT:
                        self._finish(in_use.popleft())
                while in_use:
                    self._finish(in_use.popleft())
                self._drain()
                reader.check_unchanged()  # the bytes sent were one version of the checkpoint
            finally:
                prefetch.close()
        return reader.bytes_read, sent

    def _fetch(
        self,
        reader: TensorReader,
        slots: list[torch.Tensor],
        frontier: Frontier | None,
        index: int,
        slot: int,
        pool: Executor,
    ) -> Source:
        """The reader's read of bucket ``index`` (in its read-ahead thread): into the page cache
        when only this node needs it and takes it from there, else into ``slots[slot]``; then
        the node's ranks may take it from the page cache (``frontier``)."""
        bucket = self.plan.buckets[index]
        source: Source
        if self.route.page_cache and len(self.route.leaders_for(bucket.ranks)) == 1:
            Window(reader.meta, bucket.slots).populate(reader, pool, READ_PART_BYTES)
            # Mapped again, unpopulated, for the reader's own slices: it holds no memory until
            # the reader copies them, however far ahead this thread reads.
            source = Window(reader.meta, self._mine(bucket))
        else:
            payload = slots[slot][: bucket.nbytes]
            fill(reader, bucket, payload, pool)
            source = Payload(payload)
        if frontier is not None:
            frontier.publish(index + 1)
        return source

    def _mine(self, bucket: Bucket) -> list[Slot]:
        """The slots of ``bucket`` this rank copies from."""
        return [slot for slot in bucket.slots if slot.name in self.consumers]

    def _relay(self) -> tuple[int, int]:
        """Another node's leader: receive its node's buckets into the shared slots, announce them."""
        import torch

        leaders = self.route.leaders
        assert leaders is not None
        staging = self._staging()
        in_use: deque[_InUse] = deque()
        with self._slots() as slots:
            free = deque(range(len(slots)))
            for index, bucket in enumerate(self.plan.buckets):
                to = self.route.leaders_for(bucket.ranks)
                target = staging[index % IN_FLIGHT] if staging else slots[free[0]]
                try:
                    started = leaders.receive(target, to, bucket.nbytes)
                except ReaderError as e:
                    self._fail(str(e))
                    raise
                if started is None:
                    continue
                slot = free.popleft()
                payload, work = started
                leaders.wait(work, "a bucket's broadcast")
                if staging:
                    slots[slot][: bucket.nbytes].copy_(payload)
                    torch.cuda.current_stream().synchronize()
                done = self._announce(index, slot, bucket.nbytes)
                self._apply(index, Payload(slots[slot][: bucket.nbytes]))
                in_use.append(_InUse(done=done, release=partial(free.append, slot)))
                if len(in_use) == IN_FLIGHT:
                    self._finish(in_use.popleft())
            while in_use:
                self._finish(in_use.popleft())
            self._drain()
        return 0, 0

    def _take(self) -> tuple[int, int]:
        """A rank that leads nothing: copy its slices out of each announced slot."""
        import torch
        import torch.distributed as dist

        local = self.route.local
        assert local is not None
        reported: deque[Any] = deque()
        with self._slots() as slots:
            for index in self.local:
                bucket = self.plan.buckets[index]
                slot = local.announced(bucket.nbytes, slots[0].numel(), len(slots))
                self._apply(index, Payload(slots[slot][: bucket.nbytes]))
                reported.append(
                    dist.all_reduce(torch.zeros(1), group=self.route.done, async_op=True)
                )
                if len(reported) == IN_FLIGHT:
                    self._reported(reported.popleft())
            while reported:
                self._reported(reported.popleft())
        return 0, 0

    def _take_cached(self) -> tuple[int, int]:
        """A rank of the reader's node that reads no files: once the reader has read a bucket
        into the page cache, copy this rank's slices out of its own mapping of the files."""
        with self._frontier() as frontier:
            assert frontier is not None
            for index, bucket in enumerate(self.plan.buckets):
                mine = self._mine(bucket)
                if mine:
                    frontier.wait(index + 1, self.route.board)
                    self._apply(index, Window(self.meta, mine))
        return 0, 0

    def _announce(self, index: int, slot: int, nbytes: int) -> Any:
        """Tell the node's other ranks that bucket ``index`` is in ``slot``, if one needs it;
        returns the report of their having read it, in flight (``None`` if none needs it)."""
        import torch
        import torch.distributed as dist

        local = self.route.local
        if (
            local is None
            or self._announced == len(self.local)
            or self.local[self._announced] != index
        ):
            return None
        local.announce(nbytes, slot)  # in order before the report, which is waited for
        self._announced += 1
        return dist.all_reduce(torch.zeros(1), group=self.route.done, async_op=True)

    def _deliver(self, used: _InUse) -> None:
        """Wait until a bucket's broadcasts to other nodes are done (watching the board)."""
        for work in used.sends:
            if work is not None:
                assert self.route.leaders is not None
                self.route.leaders.wait(work, "a bucket's broadcast")

    def _finish(self, used: _InUse) -> None:
        """Wait until no rank reads a bucket's slot any more (watching the board); free the slot."""
        self._deliver(used)
        if used.done is not None:
            self._reported(used.done)
        if used.release is not None:
            used.release()

    def _reported(self, work: Any, what: str = "copied their slices of a bucket") -> None:
        """Wait for the node's ranks' report over :attr:`Route.done` (watching the board)."""
        ranks = [self.route.group[p] for p in self.route.node]
        self.route.board.wait_work(work, f"the reports of node ranks {ranks} that they {what}")

    def _fail(self, message: str, frontier: Frontier | None = None) -> None:
        """Pass the reader's failure on: to the other leaders (the reader), and to this node's
        ranks while they still wait for an announcement (or poll the ``frontier``)."""
        if self.route.position == 0 and self.route.leaders is not None:
            self.route.leaders.send_error(message)
        if frontier is not None:
            frontier.fail(message)
        elif self.route.local is not None and self._announced < len(self.local):
            self.route.local.send_error(message)

    @contextmanager
    def _slots(self) -> Iterator[list[torch.Tensor]]:
        """The node's bucket slots: a shared segment for a node of several ranks, private
        memory otherwise."""
        import torch

        size = self.plan.max_bucket_bytes
        pin = self.route.device.type == "cuda"
        if self.route.local is None:
            yield [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(SLOTS)]
            return
        with self._shared(SLOTS * size) as segment:
            if pin:
                segment.pin()
            assert segment.tensor is not None
            # The leader's slot size: a rank whose plan differs learns it from the first header.
            size = segment.nbytes // SLOTS
            yield [segment.tensor[i * size : (i + 1) * size] for i in range(SLOTS)]

    @contextmanager
    def _frontier(self) -> Iterator[Frontier | None]:
        """How far the reader has read into the page cache, shared by its node's ranks
        (``None`` where no other rank polls it: the shared-memory route, a node of one rank)."""
        if not self.route.page_cache or len(self.route.node) == 1:
            yield None
            return
        reader = f"the reader (rank {self.route.group[0]})"
        with self._shared(Frontier.NBYTES, lambda s: Frontier(s, reader).plan(self.plan)) as shm:
            frontier = Frontier(shm, reader)
            if self.route.position != 0:
                frontier.check(self.plan)
            yield frontier

    @contextmanager
    def _shared(
        self, nbytes: int, fill: Callable[[Segment], None] | None = None
    ) -> Iterator[Segment]:
        """The node's shared segment: made by the leader (who ``fill`` s it before the others
        look), mapped by all, its name removed once all have mapped it, and unmapped when the
        block ends."""
        route = self.route
        leader = route.group[route.node[0]]
        segment = _open_segment(route, nbytes, fill)
        try:
            if route.leads:
                route.board.arrivals(
                    f"mapped/{leader}",
                    len(route.node) - 1,
                    f"node ranks {[route.group[p] for p in route.node]} to map the shared segment",
                )
                segment.unlink()
            else:
                route.board.arrive(f"mapped/{leader}")
            yield segment
        finally:
            if route.leads:
                segment.unlink()
            segment.close()

    @contextmanager
    def _reader_slots(self) -> Iterator[list[torch.Tensor]]:
        """The reader's bucket slots: its node's shared ones, or with the page cache private
        ones for the buckets other nodes need (none on a single node)."""
        import torch

        if not self.route.page_cache:
            with self._slots() as slots:
                yield slots
            return
        size = self.plan.max_bucket_bytes if self.route.leaders is not None else 0
        pin = self.route.device.type == "cuda" and size > 0
        yield [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(SLOTS)]

    def _staging(self) -> list[torch.Tensor]:
        """GPU buffers for NCCL between node leaders (none for gloo, or a single node)."""
        import torch

        leaders = self.route.leaders
        if leaders is None or leaders.device.type != "cuda":
            return []
        size = self.plan.max_bucket_bytes
        return [
            torch.empty(size, dtype=torch.uint8, device=leaders.device) for _ in range(IN_FLIGHT)
        ]

    def _drain(self) -> None:
        """Wait for the queued copies and broadcasts: the loader's groups are destroyed next."""
        import torch

        if self.route.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _apply(self, index: int, source: Source) -> None:
        """Copy this rank's slices of bucket ``index`` from ``source`` into its parameters
        (converting to their dtype); returns once the copies have read ``source`` (the slot
        may be refilled then; copies into CUDA may still be in flight until the copier
        closes)."""
        import torch

        with torch.no_grad(), self.copier.batch():
            for slot in self.plan.buckets[index].slots:
                for need, input_index in self.consumers.get(slot.name, ()):
                    param = self.tensors[(need.param.chunk, need.param.local_name)]
                    for first, stop, piece in TRANSFORMS[need.transform].blocks(
                        input_index,
                        source.view(slot),
                        slot.rows,
                        need.param.shape,
                        self.shard,
                    ):
                        self.copier.copy(param.data[first:stop], piece, source.page_locked)
                        self.coverage.record(need.param, first, stop)


class Source(Protocol):
    """Where a rank finds a bucket's slots: a buffer, or the files' pages (:class:`Window`)."""

    @property
    def page_locked(self) -> bool:
        """Whether the bytes are in memory registered with CUDA, with CUDA parameters."""
        ...

    def view(self, slot: Slot) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Payload:
    """A bucket's bytes in a buffer (a slot of shared memory, a received broadcast)."""

    data: torch.Tensor
    page_locked: ClassVar[bool] = True
    """With CUDA parameters, every slot of the loader is page-locked (:meth:`Stream._slots`)."""

    def view(self, slot: Slot) -> torch.Tensor:
        return slot_view(self.data, slot)


@dataclass(slots=True)
class _InUse:
    """A bucket some rank still reads: its broadcasts to other nodes, the node's report, its slot."""

    sends: list[Any] = field(default_factory=list)
    done: Any = None
    release: Callable[[], None] | None = None


def _open_segment(route: Route, nbytes: int, fill: Callable[[Segment], None] | None) -> Segment:
    """The leader makes the node's segment, ``fill`` s it and posts its name on the load's
    board; the node's other ranks map it whole (a leader that fails is announced there, and
    they stop)."""
    key = f"segment/{route.group[route.node[0]]}"
    if not route.leads:
        return Segment.open(route.board.read(key, "the name of the node's shared segment"))
    segment = Segment.create(nbytes)
    try:
        if fill is not None:
            fill(segment)
        route.board.post(key, segment.name)
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    return segment
