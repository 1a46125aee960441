"""comm_warmup never hangs and never runs one-sided: a foreign group is never touched,
a missing or failing rank makes every rank raise within timeout_s, and a retry is refused at
once, chained to the first failure (the process's one latch)."""

from __future__ import annotations

import datetime
import multiprocessing
import time
from typing import Any

from megastart.harness.launch import RankPool

TIMEOUT_S = 5.0
SETTINGS = {"timeout_s": TIMEOUT_S, "message_bytes": (4096, 65536)}
FOREIGN = "update_weight_group_0"  # AReaL's name for the group it shares with SGLang


def rollout_worker(port: int, results: Any) -> None:
    """The other side of the weight-update group, as SGLang runs it: outside the training
    world, never part of the warmup. Its one collective is the test's sentinel."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{FOREIGN}/", store))
    group = dist.ProcessGroupGloo(prefixed, 1, 2, timeout)
    value = torch.tensor([100.0])
    group.allreduce([value]).wait()
    results.put(value.item())


def join_weight_update_group(port: int) -> Any:
    """AReaL's ``init_custom_process_group``: a group over its own store, registered in
    torch.distributed's process-group registry next to Megatron's groups."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    group, _ = _new_process_group_helper(
        2, 0, [], "gloo", store, group_name=FOREIGN, timeout=timeout
    )
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    return group


def warm_beside_weight_update_group(port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megastart.harness.cpu import destroy_megatron, initialize_megatron
    from megastart.warmup.api import reset_state, warmup_communicators
    from megastart.warmup.settings import CommWarmupSettings

    initialize_megatron(pp=2)
    try:
        foreign = join_weight_update_group(port) if dist.get_rank() == 0 else None
        registered = FOREIGN in dist.distributed_c10d._world.pg_names.values()
        report = warmup_communicators(settings=CommWarmupSettings(**SETTINGS))
        sentinel = None
        if foreign is not None:  # the group's first collective must still be the sentinel
            value = torch.tensor([1.0])
            dist.all_reduce(value, group=foreign, async_op=True).wait(
                datetime.timedelta(seconds=30)
            )
            sentinel = value.item()
        return {"registered": registered, "groups": report.groups, "sentinel": sentinel}
    finally:
        reset_state()
        destroy_megatron()


def test_weight_update_group_in_the_registry_is_never_touched() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=rollout_worker, args=(store.port, results), daemon=True)
    worker.start()
    try:
        with RankPool(2, timeout_s=300) as pool:
            trainer = pool.run(warm_beside_weight_update_group, store.port)
        assert trainer[0]["registered"]
        assert all(FOREIGN not in result["groups"] for result in trainer)
        assert trainer[0]["sentinel"] == 101.0
        assert results.get(timeout=30) == 101.0
    finally:
        worker.kill()
        worker.join(10)


def warm_unless_rank(absent: int) -> dict[str, Any]:
    """Every rank but ``absent`` warms, then retries as a host's RPC layer would."""
    import torch.distributed as dist

    from megastart.harness.cpu import initialize_megatron
    from megastart.warmup.api import warmup_communicators
    from megastart.warmup.settings import CommWarmupSettings

    initialize_megatron(pp=2)
    if dist.get_rank() == absent:
        return {"absent": True}
    return _attempt_twice(lambda: warmup_communicators(settings=CommWarmupSettings(**SETTINGS)))


def warm_with_refused_config_on(bad_rank: int) -> dict[str, Any]:
    """Every rank warms; ``bad_rank``'s model config asks for ring-exchange p2p, which
    the warmup refuses on that rank alone."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer import TransformerConfig

    from megastart.harness.cpu import initialize_megatron
    from megastart.warmup.api import warmup_communicators
    from megastart.warmup.settings import CommWarmupSettings

    initialize_megatron(pp=2)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        use_ring_exchange_p2p=dist.get_rank() == bad_rank,
    )
    settings = CommWarmupSettings(**SETTINGS)
    return _attempt_twice(lambda: warmup_communicators(settings=settings, model_config=config))


def warm_with_own_message_sizes() -> dict[str, Any]:
    """Rank 1 was given other message sizes (an environment variable set on one node)."""
    import torch.distributed as dist

    from megastart.harness.cpu import initialize_megatron
    from megastart.warmup.api import warmup_communicators
    from megastart.warmup.settings import CommWarmupSettings

    initialize_megatron(pp=2)
    sizes = (4096, 65536) if dist.get_rank() == 0 else (4096, 131072)
    settings = CommWarmupSettings(timeout_s=TIMEOUT_S, message_bytes=sizes)
    return _attempt_twice(lambda: warmup_communicators(settings=settings))


def _attempt_twice(warmup: Any) -> dict[str, Any]:
    """Two calls: each error's kind, message, seconds and id, and the id of the retry's cause."""
    errors, causes = [], []
    for _ in range(2):
        start = time.monotonic()
        try:
            warmup()
            errors.append(None)
            causes.append(None)
        except Exception as e:
            errors.append((type(e).__name__, str(e), time.monotonic() - start, id(e)))
            causes.append(id(e.__cause__))
    return {"absent": False, "first": errors[0], "retry": errors[1], "retry_cause": causes[-1]}


def test_a_rank_that_never_arrives_makes_the_others_raise_within_timeout() -> None:
    with RankPool(2, timeout_s=300) as pool:
        present, absent = pool.run(warm_unless_rank, 1)
    assert absent == {"absent": True}
    kind, message, seconds, first_id = present["first"]
    assert kind == "CollectiveError"
    assert "did not all start the warmup" in message and "no communicator was touched" in message
    assert TIMEOUT_S - 0.5 <= seconds < TIMEOUT_S + 5
    retry_kind, retry_message, retry_seconds, _ = present["retry"]
    assert retry_kind == "FailedBefore" and present["retry_cause"] == first_id  # chained to it
    assert retry_message.startswith("comm_warmup: not run: comm_warmup already failed")
    assert message in retry_message
    assert retry_seconds < 0.5  # raised at once, no collective attempted


def test_a_rank_that_raises_makes_every_rank_raise_and_retries_reraise() -> None:
    with RankPool(2, timeout_s=300) as pool:
        results = pool.run(warm_with_refused_config_on, 1)
    for result in results:
        kind, message, seconds, first_id = result["first"]
        assert kind == "CollectiveError"
        assert "comm_warmup: plan failed on rank 1" in message
        assert "use_ring_exchange_p2p" in message
        assert seconds < TIMEOUT_S
        assert result["retry"][0] == "FailedBefore"
        assert result["retry_cause"] == first_id and result["retry"][2] < 0.5


def test_ranks_with_different_settings_all_raise_before_any_operation() -> None:
    with RankPool(2, timeout_s=300) as pool:
        results = pool.run(warm_with_own_message_sizes)
    messages = [result["first"][1] for result in results]
    assert messages[0] == messages[1]
    assert (
        "comm_warmup: the ranks' settings differ: message_bytes is (4096, 65536) on ranks [0], (4096, 131072) on ranks [1];"
        in messages[0]
    )
    assert "MEGASTART_COMM_WARMUP_*" in messages[0]


def warm_twice_counting_groups() -> dict[str, int]:
    from torch.distributed.distributed_c10d import _world

    from megastart.distributed import kept_control
    from megastart.harness.cpu import destroy_megatron, initialize_megatron
    from megastart.warmup.api import reset_state, warmup_communicators
    from megastart.warmup.settings import CommWarmupSettings

    initialize_megatron(pp=2)
    try:
        made = []
        for _ in range(2):
            before = _world.group_count
            reset_state()  # a warmup per restart: as after a second recover load
            warmup_communicators(settings=CommWarmupSettings(timeout_s=TIMEOUT_S))
            made.append(_world.group_count - before)
        control = kept_control(timeout_s=TIMEOUT_S).group_ranks
        return {"first": made[0], "second": made[1], "control": control}
    finally:
        destroy_megatron()


def test_the_warmup_makes_no_process_group_over_the_world() -> None:
    """It reports over megastart's kept control plane (the loader's too): small gloo groups
    made once per process from the store, here the one node's, and never registered with
    torch.distributed (so the host's groups keep their names and counts); not over a group
    over the whole world made and destroyed per call."""
    with RankPool(2, timeout_s=300) as pool:
        results = pool.run(warm_twice_counting_groups)
    assert results == [{"first": 0, "second": 0, "control": [(0, 1)]}] * 2
