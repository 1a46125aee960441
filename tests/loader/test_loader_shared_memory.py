"""rank0_loader's node-shared buckets: one segment per node, its name gone while in use, nothing
left in ``/dev/shm`` after a load, after a rank (reader, relay or copier) is killed mid-stream,
or after a leader died before removing its segment's name; a stalled read fails within timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.loader_faults import (
    load_while_a_rank_dies,
    load_with_failing_reads,
    load_with_slow_reads,
    load_with_stalled_read,
)
from support.loader_ranks import load_as_nodes, load_seeing_shared_segments

from megastart.distributed import PEER_GRACE_S
from megastart.harness.launch import RankFailure, RankPool
from megastart.loader.stream.shm import PREFIX, SHM_DIR, creator

TP2_PP2 = {"tp": 2, "pp": 2}
ROUTES = ("page_cache", "shared_memory")
"""``rank0_loader.reader_node``: how the reader's node takes its slices."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from megastart.harness.checkpoints import make_checkpoint

    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", directory, tie_word_embeddings=False)
    return str(directory)


def segments_of(pids: list[int]) -> list[str]:
    """Loader segments in ``/dev/shm`` made by any of ``pids``."""
    return sorted(
        p.name
        for p in SHM_DIR.glob(f"{PREFIX}*")
        if (made_by := creator(p.name)) is not None and made_by[1] in pids
    )


def test_each_node_shares_one_segment_whose_name_is_gone_while_it_is_used(
    rank_pools: Any, checkpoint: str
) -> None:
    """Shared memory on both nodes (``reader_node=shared_memory``): the bucket slots, beside
    the node's page of the board (``<page>``, then ``<page>-2``)."""
    pool = rank_pools[4]
    pids = pool.run(os.getpid)
    results = pool.run(
        load_seeing_shared_segments, checkpoint, TP2_PP2, 2, {"reader_node": "shared_memory"}
    )
    seen = [segments for segments, _, _ in results]
    for names in seen:
        page = min(names).removesuffix(" (deleted)")
        assert names == {f"{page} (deleted)", f"{page}-2 (deleted)"}, seen
    assert seen[0] == seen[1] != seen[2] == seen[3]  # nodes {0, 1} and {2, 3}
    assert all(name.endswith(" (deleted)") for names in seen for name in names)
    assert [files for _, files, _ in results][1:] == [set()] * 3  # only the reader reads files
    assert [after for _, _, after in results] == [set()] * 4  # unmapped after the load
    assert segments_of(pids) == []


def test_the_readers_node_copies_from_the_files_and_the_other_node_from_shared_memory(
    rank_pools: Any, checkpoint: str
) -> None:
    """The default route: the reader's node maps the checkpoint's files (and shares only the
    reader's progress, on its page of the board), the second node copies out of its shared
    bucket slots."""
    pool = rank_pools[4]
    pids = pool.run(os.getpid)
    results = pool.run(load_seeing_shared_segments, checkpoint, TP2_PP2, 2, {})
    # Each node's page of the board; beside it, on the second node only, the bucket slots.
    segments = [{n.removesuffix(" (deleted)") for n in names} for names, _, _ in results]
    files = [names for _, names, _ in results]
    assert segments[0] == segments[1] and len(segments[0]) == 1, segments
    assert segments[2] == segments[3] == {min(segments[2]), f"{min(segments[2])}-2"}, segments
    assert segments[0] != segments[2]
    assert files[0] and files[1], files  # pages of model-0000x-of-0000y.safetensors
    assert all(name.endswith(".safetensors") for name in files[0] | files[1])
    assert files[2] == files[3] == set()
    assert [after for _, _, after in results] == [set()] * 4
    assert segments_of(pids) == []


KILLED = [
    ("reader", "page_cache"),
    ("reader_node_rank", "page_cache"),
    ("reader", "shared_memory"),
    ("reader_node_rank", "shared_memory"),
    ("relay", "page_cache"),
    ("second_node_rank", "page_cache"),
]
"""Who dies, and the reader's node's route (it matters to ranks 0 and 1 only)."""
RANK_OF = {"reader": 0, "reader_node_rank": 1, "relay": 2, "second_node_rank": 3}


@pytest.mark.parametrize(("who", "reader_node"), KILLED, ids=[f"{w}-{r}" for w, r in KILLED])
def test_a_rank_killed_holding_a_shared_bucket_fails_every_rank_and_leaves_no_segment(
    checkpoint: str, who: str, reader_node: str
) -> None:
    """Two nodes of two ranks; one rank exits while it copies from its second bucket. The
    survivors name it about ``timeout_s + 2 * PEER_GRACE_S`` after the load's last progress:
    a short ``timeout_s`` keeps each case's wait short (the worlds' start is most of the rest)."""
    timeout_s = 2.0
    dying_rank = RANK_OF[who]
    overrides = {"reader_node": reader_node}
    # the pool waits this long for the survivors once it has seen the rank die
    grace_s = 3 * (timeout_s + 2 * PEER_GRACE_S)
    with RankPool(4, timeout_s=120, grace_s=grace_s) as pool:
        pids = pool.run(os.getpid)
        pool.run(load_as_nodes, checkpoint, TP2_PP2, 2, {})  # imports done: time the failure alone
        start = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            pool.run(
                load_while_a_rank_dies, checkpoint, TP2_PP2, dying_rank, timeout_s, 2, overrides
            )
        elapsed = time.monotonic() - start
        assert segments_of(pids) == []  # before the pool kills the survivors
    message = str(failure.value)
    assert f"ranks that died: {dying_rank} (exit code 7)" in message
    assert "CollectiveError: rank0_loader: streaming" in message
    assert elapsed < grace_s + 10


@pytest.mark.parametrize("reader_node", ROUTES)
def test_a_read_error_reaches_both_nodes_with_the_readers_message(
    rank_pools: Any, checkpoint: str, reader_node: str
) -> None:
    """The reader's I/O error crosses to the second node's leader, which passes it on; on the
    reader's node it reaches the ranks through the slots' headers or the reader's progress."""
    start = time.monotonic()
    messages = rank_pools[4].run(
        load_with_failing_reads, checkpoint, TP2_PP2, 5, 2, {"reader_node": reader_node}
    )
    assert time.monotonic() - start < 60
    assert len(set(messages)) == 1, messages
    assert "Input/output error" in messages[0]


@pytest.mark.parametrize("reader_node", ROUTES)
def test_a_stalled_read_fails_every_rank_within_timeout(checkpoint: str, reader_node: str) -> None:
    """One node of four ranks; the reader's third read hangs (its other read threads go on)."""
    timeout_s = 3.0
    with RankPool(4, timeout_s=120) as pool:
        pool.run(load_as_nodes, checkpoint, TP2_PP2, 4, {})  # imports done: time the failure alone
        start = time.monotonic()
        results = pool.run(
            load_with_stalled_read, checkpoint, TP2_PP2, 2, timeout_s, {"reader_node": reader_node}
        )
        elapsed = time.monotonic() - start
    messages = [message for _, message, _ in results]
    assert len(set(messages)) == 1, messages
    assert (
        f"rank 0 waited timeout_s={timeout_s:g} s for the reader's read of tensor '" in messages[0]
    )
    assert elapsed < 2 * timeout_s + 10


@pytest.mark.parametrize("reader_node", ROUTES)
def test_a_load_longer_than_timeout_s_succeeds_while_the_reader_reads(
    rank_pools: Any, checkpoint: str, reader_node: str
) -> None:
    """Slow storage: the load lasts several timeout_s. Two nodes of two ranks, one pipeline stage
    each: the second node waits long for its first bucket, the reader's node-mate finishes
    early and waits for the others; neither may take that for a stall. On the page cache's
    route the reader reads only what is not resident (with the kernel's read-around, about
    20 reads of this checkpoint): each read takes longer there."""
    timeout_s = 1.5
    per_read_s = {"page_cache": 0.6, "shared_memory": 0.35}[reader_node]
    results = rank_pools[4].run(
        load_with_slow_reads,
        checkpoint,
        TP2_PP2,
        2,
        per_read_s,
        timeout_s,
        {"reader_node": reader_node},
    )
    assert [outcome for outcome, _, _ in results] == ["loaded"] * 4, results
    assert min(seconds for _, _, seconds in results) > 2 * (timeout_s + PEER_GRACE_S)


def test_a_segment_left_by_a_dead_leader_is_removed_by_the_next_load(
    rank_pools: Any, checkpoint: str
) -> None:
    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
        ).stdout
    )
    here = os.stat("/proc/self/ns/pid").st_ino
    stale = SHM_DIR / f"{PREFIX}{here}-{dead}-0123456789ab"
    alive = SHM_DIR / f"{PREFIX}{here}-{os.getpid()}-0123456789ab"  # a load in progress elsewhere
    # another PID namespace's (a container sharing /dev/shm): its pid means nothing here
    elsewhere = SHM_DIR / f"{PREFIX}{here + 1}-{dead}-0123456789ab"
    for path in (stale, alive, elsewhere):
        path.write_bytes(b"\0" * 4096)
    try:
        rank_pools[2].run(load_as_nodes, checkpoint, {"tp": 2}, 2, {})
        assert not stale.exists()
        assert alive.exists()
        assert elsewhere.exists()
    finally:
        for path in (stale, alive, elsewhere):
            Path(path).unlink(missing_ok=True)


_MADE_IN_A_NAMESPACE = """
import os, sys, time
target = int(sys.argv[1])
while True:  # pids count up from 1 in a new namespace: fork until the child is `target`
    pid = os.fork()
    if pid == 0:
        if os.getpid() == target:
            from megastart.loader.stream.shm import Segment
            print(Segment.create(4096).name, flush=True)
            time.sleep(60)
        os._exit(0)
    if pid >= target:
        os.waitpid(pid, 0)
        break
    os.waitpid(pid, 0)
"""


def test_a_live_segment_of_another_pid_namespace_survives_a_sweep_here() -> None:
    """Containers sharing ``/dev/shm`` (``--ipc=host``) each have their own PID namespace: a
    live leader's segment there, whose pid is no live process here, is not swept here."""
    from megastart.loader.stream.shm import sweep_stale

    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode:
        pytest.skip("this machine does not allow a new PID namespace (unshare)")
    dead = next(p for p in range(300, 4000) if not Path(f"/proc/{p}").exists())
    unshare = ["unshare", "--pid", "--fork", "--kill-child"]
    inner = subprocess.Popen(
        [*unshare, sys.executable, "-c", _MADE_IN_A_NAMESPACE, str(dead)],
        stdout=subprocess.PIPE,
        text=True,
    )
    name = "not made"
    try:
        assert inner.stdout is not None
        name = inner.stdout.readline().strip()
        made_by = creator(name)
        assert made_by is not None and made_by[1] == dead, name
        sweep_stale()
        assert (SHM_DIR / name).exists()
    finally:
        inner.kill()
        inner.wait()
        (SHM_DIR / name).unlink(missing_ok=True)
