"""Rank functions of the multi-GPU tests (``tests/multigpu``): one process per GPU."""

from __future__ import annotations

from typing import Any


def nccl_group_between_two_ranks(nbytes: int) -> dict[str, Any]:
    """The loader's NCCL group between node leaders, made by its two ranks alone over a prefix
    of the store: what rank 0 broadcast arrives, and torch.distributed's groups are the
    host's as before (names and count)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store, _world

    from megastart.distributed import LocalGroup

    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    before = sorted(_world.pg_names.values())
    store = dist.PrefixStore("test/leaders/", _get_default_store())
    group = LocalGroup.make(store, range(dist.get_world_size()), timeout_s=60.0, backend="nccl")
    data = torch.arange(nbytes, device=device, dtype=torch.int64) % 251
    if rank != 0:
        data.zero_()
    group.broadcast(data, 0).wait()
    torch.cuda.synchronize(device)
    expected = torch.arange(nbytes, device=device, dtype=torch.int64) % 251
    got = bool(torch.equal(data, expected))
    group.close(failed=False)
    return {
        "received": got,
        "groups_before": before,
        "groups_after": sorted(_world.pg_names.values()),
    }
