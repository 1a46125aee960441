"""Loads that meet a fault on one rank (a failing or stalled read, a rank that dies or
never comes, a receiver out of memory, a rank with another plan): what each rank runs in
the loader's failure tests, module-level so RankPool can pickle them by reference."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any

import torch

from support.loader_ranks import (
    Attempt,
    attempt,
    build,
    host_group_works,
    load_expecting_error,
    megatron,
    settings,
    simulated_nodes,
    timed_load,
)


@contextmanager
def reader_storage_fails(good_reads: int, failure: Any, rank: int = 0):
    """On ``rank``, ``failure(entry)`` runs instead of (a raise) or before (a stall) every read
    of the storage after ``good_reads``: into a buffer (``read_exact``) or into the page cache
    (``pagecache.populate``), whichever route the load takes. The checkpoint's files leave the
    page cache as the reader starts: on the page cache's route it reads only what is not
    resident, and the metadata's read-ahead brings small files back."""
    import torch.distributed as dist

    from megastart.bench.limits import drop_from_page_cache
    from megastart.loader.checkpoint import reader as checkpoint_module
    from megastart.loader.stream import pagecache, roles

    originals = checkpoint_module.read_exact, pagecache.populate, roles.read
    calls = [0]

    def wrap(original: Any) -> Any:
        def read(*args: Any) -> None:
            calls[0] += 1
            if calls[0] > good_reads:
                failure(next(a for a in args if isinstance(a, checkpoint_module.TensorEntry)))
            original(*args)

        return read

    def dropped_first(stream: Any, *args: Any) -> Any:
        meta = stream.meta
        files = sorted({os.path.join(meta.directory, e.file) for e in meta.tensors.values()})
        for file in files:  # written back first: dirty pages stay
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        drop_from_page_cache(files)
        return originals[2](stream, *args)

    if dist.get_rank() == rank:
        checkpoint_module.read_exact, pagecache.populate = map(wrap, originals[:2])
        roles.read = dropped_first
    try:
        yield
    finally:
        checkpoint_module.read_exact, pagecache.populate, roles.read = originals


def load_with_failing_reads(
    checkpoint: str,
    layout: dict[str, int],
    good_reads: int,
    ranks_per_node: int | None = None,
    overrides: dict[str, Any] | None = None,
    reader: int = 0,
) -> str:
    """Inject an I/O error into the file reads of rank ``reader`` after ``good_reads`` reads."""
    import torch.distributed as dist

    def fail(entry: Any) -> None:
        raise OSError(5, "Input/output error", entry.file)

    with reader_storage_fails(good_reads, fail, reader):
        with simulated_nodes(ranks_per_node or dist.get_world_size()):
            return load_expecting_error(checkpoint, layout, overrides or {})


def load_while_a_rank_dies(
    checkpoint: str,
    layout: dict[str, int],
    dying_rank: int,
    timeout_s: float,
    ranks_per_node: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> None:
    """``dying_rank`` exits in the middle of the stream, while it holds the second bucket it
    copies from (out of its node's shared memory, or its mapping of the files); the others
    must raise."""
    import torch.distributed as dist

    from megastart import load_hf_checkpoint
    from megastart.loader.stream import stream

    if dist.get_rank() == dying_rank:
        original = stream.Stream.apply
        applied = [0]

        def apply_then_die(self: Any, index: int, payload: Any, *slots: Any) -> None:
            if any(slot.name in self.consumers for slot in self.plan.buckets[index].slots):
                applied[0] += 1
                if applied[0] == 2:
                    os._exit(7)
            original(self, index, payload, *slots)

        stream.Stream.apply = apply_then_die  # type: ignore[method-assign]
    with simulated_nodes(ranks_per_node or dist.get_world_size()), megatron(layout):
        chunks = build(checkpoint)
        load_hf_checkpoint(
            chunks, checkpoint, settings=settings(timeout_s=timeout_s, **(overrides or {}))
        )


def load_unless_rank(checkpoint: str, layout: dict[str, int], absent: int, timeout_s: float) -> Any:
    """Rank ``absent`` does not come; the others load, then retry. After they gave up,
    ``absent`` loads too. Then the host makes a group over every rank."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from megastart import load_hf_checkpoint

    store = _get_default_store()
    with megatron(layout):
        chunks = build(checkpoint)

        def load() -> None:
            load_hf_checkpoint(chunks, checkpoint, settings=settings(timeout_s=timeout_s))

        if dist.get_rank() == absent:
            store.wait(["test/others-gave-up"])
            attempts = [attempt(load)]
        else:
            attempts = [attempt(load), attempt(load)]
            store.add("test/others-gave-up", 1)
        return attempts, host_group_works()


def load_with_failing_receiver(
    checkpoint: str, layout: dict[str, int], failing_rank: int, timeout_s: float
) -> Any:
    """``failing_rank`` runs out of memory applying its ninth bucket; then every rank
    retries, and the host makes a group. Also: how many parameters the failed load wrote."""
    import torch.distributed as dist

    from megastart import load_hf_checkpoint
    from megastart.loader.stream import stream

    original = stream.Stream.apply

    def apply_then_fail(self: Any, index: int, payload: Any, *slots: Any) -> None:
        if index == 8:
            raise MemoryError("out of host memory (injected)")
        original(self, index, payload, *slots)

    if dist.get_rank() == failing_rank:
        stream.Stream.apply = apply_then_fail  # type: ignore[method-assign]
    try:
        with megatron(layout):
            chunks = build(checkpoint)
            before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}

            def load() -> None:
                load_hf_checkpoint(chunks, checkpoint, settings=settings(timeout_s=timeout_s))

            attempts = [attempt(load), attempt(load)]
            written = sum(not torch.equal(p, before[n]) for n, p in chunks[0].named_parameters())
            return attempts, (written, len(before)), host_group_works()
    finally:
        stream.Stream.apply = original  # type: ignore[method-assign]


def load_with_stalled_read(
    checkpoint: str,
    layout: dict[str, int],
    good_reads: int,
    timeout_s: float,
    overrides: dict[str, Any] | None = None,
) -> Attempt:
    """The reader's storage stops answering after ``good_reads`` reads (for 3 * ``timeout_s``)."""
    from megastart import load_hf_checkpoint

    with reader_storage_fails(good_reads, lambda entry: time.sleep(3 * timeout_s)):
        with megatron(layout):
            chunks = build(checkpoint)
            return attempt(
                lambda: load_hf_checkpoint(
                    chunks, checkpoint, settings=settings(timeout_s=timeout_s, **(overrides or {}))
                )
            )


def load_with_slow_reads(
    checkpoint: str,
    layout: dict[str, int],
    ranks_per_node: int,
    seconds_per_read: float,
    timeout_s: float,
    overrides: dict[str, Any],
) -> Attempt:
    """Every read of the reader's storage takes ``seconds_per_read`` longer (slow storage)."""
    from megastart import load_hf_checkpoint

    with reader_storage_fails(0, lambda entry: time.sleep(seconds_per_read)):
        with simulated_nodes(ranks_per_node), megatron(layout):
            chunks = build(checkpoint)
            return attempt(
                lambda: load_hf_checkpoint(
                    chunks, checkpoint, settings=settings(timeout_s=timeout_s, **overrides)
                )
            )


def load_with_another_plan_on(
    checkpoint: str, layout: dict[str, int], rank: int, overrides: dict[str, Any]
) -> Attempt:
    """``rank`` plans buckets 8 times larger than the others (a bug the size check must catch)."""
    import torch.distributed as dist

    from megastart.loader.plan import planning

    original = planning.build_plan

    def larger_buckets(*args: Any, bucket_bytes: int, **kwargs: Any) -> Any:
        return original(*args, bucket_bytes=8 * bucket_bytes, **kwargs)

    if dist.get_rank() == rank:
        planning.build_plan = larger_buckets
    try:
        return timed_load(checkpoint, layout, overrides)
    finally:
        planning.build_plan = original
