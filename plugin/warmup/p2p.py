"""Point-to-point steps: pipeline stages and context-parallel rings, paired without deadlock.

NCCL (through PyTorch) gives each unbatched send/recv pair of ranks its own
communicator, created when the pair first talks, and connects each direction
separately; ``batch_isend_irecv`` runs on the group's own communicator.
Creating a pair's communicator blocks both ranks until both arrive, so the
pairs are visited in phases (links from even positions, then from odd
positions, then the wrap-around link): in a phase no rank is in two pairs, and
every rank walks the phases in the same order, so no cycle of waits can form.

Which group carries which direction follows the installed megatron-core's
``p2p_communication._p2p_ops``: at pipeline size 2 (backend other than UCC),
the odd stage's sends and the even stage's receives go over WORLD.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from megastart.warmup.step import Step, buffer

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from megastart.warmup.groups import WarmGroup


def pipeline_steps(
    warm: WarmGroup,
    nbytes: int,
    device: torch.device,
    *,
    model_config: Any,
    wrap: bool,
    smallest: bool,
) -> list[Step]:
    """Both directions over every link between adjacent stages (and last -> first with
    the interleaved schedule), unbatched and/or batched as ``model_config`` selects.
    ``smallest``: ``nbytes`` is the warmup's smallest size (tensor shapes use it)."""
    links = _links(len(warm.ranks), wrap=wrap)
    steps = []
    for batched, scalar in _pipeline_modes(model_config):
        if scalar and not smallest:
            continue
        for phase in links:
            for a, b in phase:
                if batched:
                    steps += _batched(warm, a, b, nbytes, device, both_ways=True)
                else:
                    steps += _unbatched(warm, a, b, nbytes, device, _megatron_group(warm, a), True)
                    steps += _unbatched(warm, b, a, nbytes, device, _megatron_group(warm, b), False)
    return steps


def ring_steps(warm: WarmGroup, nbytes: int, device: torch.device) -> list[Step]:
    """Send to the next and receive from the previous rank of the ring, as Transformer
    Engine's context-parallel attention does (batched at size 2 or with
    ``NVTE_BATCH_MHA_P2P_COMM``)."""
    size = len(warm.ranks)
    batched = size == 2 or os.environ.get("NVTE_BATCH_MHA_P2P_COMM", "0") not in ("", "0")
    steps = []
    for phase in _links(size, wrap=True):
        for a, b in phase:
            if batched:
                steps += _batched(warm, a, b, nbytes, device, both_ways=False)
            else:
                steps += _unbatched(warm, a, b, nbytes, device, (warm.name, warm.group), True)
    return steps


def _links(size: int, *, wrap: bool) -> list[list[tuple[int, int]]]:
    """Directed links ``(stage, next stage)`` in group ranks, in phases of disjoint pairs."""
    even = [(i, i + 1) for i in range(0, size - 1, 2)]
    odd = [(i, i + 1) for i in range(1, size - 1, 2)]
    last = [(size - 1, 0)] if wrap else []
    return [phase for phase in (even, odd, last) if phase]


def _pipeline_modes(config: Any) -> list[tuple[bool, bool]]:
    """``(batched, shapes only)`` modes of Megatron's pipeline p2p for this model config."""
    if config is None:
        return [(False, False), (True, False)]  # unknown: warm both
    if getattr(config, "use_ring_exchange_p2p", False):
        raise ValueError(
            "comm_warmup: the model config sets use_ring_exchange_p2p, which megatron-core "
            "sends through torch.distributed.ring_exchange (a patched PyTorch); comm_warmup "
            "cannot warm it. Block the plugin with MEGASTART_BLOCKLIST=comm_warmup."
        )
    if config.batch_p2p_comm:
        return [(True, False)]
    if getattr(config, "variable_seq_lengths", False) or getattr(config, "mtp_standalone", False):
        return [(False, False), (True, True)]  # shapes go batched before each tensor
    return [(False, False)]


def _megatron_group(warm: WarmGroup, sender: int) -> tuple[str, dist.ProcessGroup]:
    """The group ``_p2p_ops`` sends on from pipeline position ``sender``."""
    import torch.distributed as dist

    if len(warm.ranks) == 2 and sender % 2 == 1 and dist.get_backend(warm.group) != "ucc":
        return "world", cast("dist.ProcessGroup", dist.group.WORLD)
    return warm.name, warm.group


def _unbatched(
    warm: WarmGroup,
    src: int,
    dst: int,
    nbytes: int,
    device: torch.device,
    carrier: tuple[str, dist.ProcessGroup],
    forward: bool,
) -> list[Step]:
    """One message from group rank ``src`` to ``dst`` (``forward``: to its next rank) over
    ``carrier`` (name, group): a step on each of the two ranks."""
    import torch.distributed as dist

    name, group = carrier
    me = dist.get_rank()
    src_rank, dst_rank = warm.ranks[src], warm.ranks[dst]
    pair = (src_rank, dst_rank)
    if me == src_rank:

        def send() -> list[dist.Work]:
            work = dist.isend(buffer(nbytes, 1, device), dst=dst_rank, group=group)
            return [cast("dist.Work", work)]  # None only for a rank outside the group

        return [Step(name, f"send_{'next' if forward else 'prev'}:{nbytes}", pair, send)]
    if me == dst_rank:

        def recv() -> list[dist.Work]:
            work = dist.irecv(buffer(nbytes, 1, device), src=src_rank, group=group)
            return [cast("dist.Work", work)]

        return [Step(name, f"recv_{'prev' if forward else 'next'}:{nbytes}", pair, recv)]
    return []


def _batched(
    warm: WarmGroup, a: int, b: int, nbytes: int, device: torch.device, *, both_ways: bool
) -> list[Step]:
    """``batch_isend_irecv`` on the group between ``a`` and its next rank ``b``: ``a``
    sends (and receives back if ``both_ways``), ``b`` receives (and sends back)."""
    import torch.distributed as dist

    me = dist.get_rank()
    rank_a, rank_b = warm.ranks[a], warm.ranks[b]
    if me == rank_a:
        sends, receives, direction = True, both_ways, "next"
        peer = rank_b
    elif me == rank_b:
        sends, receives, direction = both_ways, True, "prev"
        peer = rank_a
    else:
        return []
    what = "send_recv" if sends and receives else "send" if sends else "recv"
    return [
        Step(
            warm.name,
            f"batch_{what}_{direction}:{nbytes}",
            (rank_a, rank_b),
            _batch(warm.group, peer, nbytes, device, sends=sends, receives=receives),
        )
    ]


def _batch(
    group: dist.ProcessGroup,
    peer: int,
    nbytes: int,
    device: torch.device,
    *,
    sends: bool,
    receives: bool,
) -> Callable[[], list[dist.Work]]:
    import torch.distributed as dist

    def start() -> list[dist.Work]:
        ops = []
        if sends:
            ops.append(dist.P2POp(dist.isend, buffer(nbytes, 1, device), peer, group))
        if receives:
            ops.append(dist.P2POp(dist.irecv, buffer(nbytes, 1, device), peer, group))
        return dist.batch_isend_irecv(ops)

    return start
