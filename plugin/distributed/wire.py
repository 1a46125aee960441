"""The control plane's collectives on one of its groups, as bytes: a payload's size and its
first :data:`INLINE_BYTES` in one message (a verdict, a bucket count: one collective), the
rest in a second; every wait bounded, a peer's failure an error naming the group."""

from __future__ import annotations

import datetime
import pickle
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megastart.distributed.groups import LocalGroup
from megastart.errors import CollectiveError

if TYPE_CHECKING:
    import torch


class ControlFailed(CollectiveError):
    """A collective of the control plane failed before its time was up (not a timeout)."""


INLINE_BYTES = 4096 - 8
"""Bytes of a payload that travel in the same message as its size: a report (a verdict, a
bucket count) is one collective, not a size and then its bytes. Longer payloads send the
rest in a second."""


SQUEEZED_BYTES = 8 * INLINE_BYTES
"""The longest pickled report that is compressed when that makes it fit :data:`INLINE_BYTES`
(one collective, not two: a small model's metadata, 8.6 KB pickled, 2.5 KB compressed, for
0.2 ms of CPU); longer ones travel as they are (compressing megabytes costs more CPU than
the second collective they take anyway)."""

_PICKLED, _SQUEEZED = b"p", b"z"


def dumps(value: Any) -> bytes:
    """``value`` pickled, compressed where that makes it one collective (:data:`SQUEEZED_BYTES`),
    behind a byte that says which."""
    pickled = pickle.dumps(value)
    if INLINE_BYTES < len(pickled) + 1 <= SQUEEZED_BYTES:
        squeezed = zlib.compress(pickled, 1)
        if len(squeezed) + 1 <= INLINE_BYTES:
            return _SQUEEZED + squeezed
    return _PICKLED + pickled


def loads(payload: bytes) -> Any:
    """What :func:`dumps` made ``payload`` of."""
    body = payload[1:]
    return pickle.loads(zlib.decompress(body) if payload[:1] == _SQUEEZED else body)


def allgather(group: LocalGroup, payload: bytes, timeout_s: float) -> list[bytes]:
    """Every rank of ``group``'s ``payload``, in its order: each one's size and its first
    :data:`INLINE_BYTES`, then the rest if any is longer."""
    import torch

    heads, sizes = _heads(group, payload, timeout_s)
    rests: list[torch.Tensor] = []
    if max(sizes) > INLINE_BYTES:
        mine = _rest(payload, max(sizes))
        rests = [torch.empty_like(mine) for _ in group.ranks]
        wait(group, group.all_gather(rests, mine, timeout_s=timeout_s), timeout_s)
    return _joined(heads, rests, sizes)


def gather(group: LocalGroup, payload: bytes, timeout_s: float) -> list[bytes] | None:
    """Every rank of ``group``'s ``payload``, in its order, on its leader (``None`` on the
    others): the heads go to every rank (each learns the longest), the rests to the leader
    alone, so a rank receives its group's heads, not its payloads."""
    import torch

    heads, sizes = _heads(group, payload, timeout_s)
    rests: list[torch.Tensor] = []
    if max(sizes) > INLINE_BYTES:
        mine = _rest(payload, max(sizes))
        if group.index == 0:
            rests = [torch.empty_like(mine) for _ in group.ranks]
        wait(group, group.gather(rests, mine, timeout_s=timeout_s), timeout_s)
    return _joined(heads, rests, sizes) if group.index == 0 else None


def _heads(
    group: LocalGroup, payload: bytes, timeout_s: float
) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank of ``group``'s head (:func:`_head`), on every rank, and the sizes they give."""
    import torch

    heads = [torch.empty(8 + INLINE_BYTES, dtype=torch.uint8) for _ in group.ranks]
    wait(group, group.all_gather(heads, _head(payload), timeout_s=timeout_s), timeout_s)
    return heads, [int(head[:8].view(torch.int64)) for head in heads]


def _rest(payload: bytes, longest: int) -> torch.Tensor:
    """``payload`` beyond its first :data:`INLINE_BYTES`, zero-padded to the ``longest``'s rest."""
    import torch

    rest = torch.zeros(longest - INLINE_BYTES, dtype=torch.uint8)
    rest[: max(0, len(payload) - INLINE_BYTES)] = _bytes(payload[INLINE_BYTES:])
    return rest


def _joined(heads: list[torch.Tensor], rests: list[torch.Tensor], sizes: list[int]) -> list[bytes]:
    """Each payload from its head and, where it is longer than :data:`INLINE_BYTES`, its rest."""
    return [
        head[8 : 8 + min(size, INLINE_BYTES)].numpy().tobytes()
        + (rests[i][: size - INLINE_BYTES].numpy().tobytes() if size > INLINE_BYTES else b"")
        for i, (head, size) in enumerate(zip(heads, sizes, strict=True))
    ]


def broadcast(group: LocalGroup, payload: bytes, timeout_s: float) -> bytes:
    """``group``'s leader's ``payload`` (the others' is ignored): its size and first
    :data:`INLINE_BYTES`, then the rest if it is longer."""
    import torch

    leader, leads = group.ranks[0], group.index == 0
    head = _head(payload) if leads else torch.empty(8 + INLINE_BYTES, dtype=torch.uint8)
    wait(group, group.broadcast(head, leader, timeout_s=timeout_s), timeout_s)
    if leads:
        size = len(payload)
    else:
        size = int(head[:8].view(torch.int64))
    if size > INLINE_BYTES:
        rest = (
            _bytes(payload[INLINE_BYTES:])
            if leads
            else torch.empty(size - INLINE_BYTES, dtype=torch.uint8)
        )
        wait(group, group.broadcast(rest, leader, timeout_s=timeout_s), timeout_s)
    if leads:
        return payload
    received = head[8 : 8 + min(size, INLINE_BYTES)].numpy().tobytes()
    return received + (rest.numpy().tobytes() if size > INLINE_BYTES else b"")


def _head(payload: bytes) -> torch.Tensor:
    """``payload``'s size (8 bytes) and its first :data:`INLINE_BYTES` (zero-padded)."""
    import torch

    head = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
    head[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    inline = payload[:INLINE_BYTES]
    head[8 : 8 + len(inline)] = _bytes(inline)
    return head


def _bytes(payload: bytes) -> torch.Tensor:
    import torch

    return (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )


def wait(group: LocalGroup, work: Any, timeout_s: float) -> None:
    """Wait for ``work`` on ``group``, at most ``timeout_s``.

    :raises TimeoutError: when it did not complete in time, naming the group.
    :raises ControlFailed: when it failed otherwise (a peer's connection closed: it died or
        gave up), naming the group and gloo's error.
    """
    started = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        ranks, waited = _shown(group.ranks), time.monotonic() - started
        if "timed out" in str(e).lower():
            raise TimeoutError(
                f"the control group of ranks {ranks} did not complete within {timeout_s:g} s: {e}"
            ) from e
        raise ControlFailed(
            f"the control group of ranks {ranks} failed after {waited:.1f} s (a rank of it "
            f"died or gave up): {e}"
        ) from e


def _shown(ranks: Sequence[int]) -> str:
    return str(list(ranks)) if len(ranks) <= 8 else f"[{ranks[0]}, ..., {ranks[-1]}] ({len(ranks)})"
