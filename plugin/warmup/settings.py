"""Settings of the ``comm_warmup`` plugin (section ``comm_warmup``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

SMALL_MESSAGE_BYTES = 4 * 2**10
"""Well under NCCL's low-latency (LL) thresholds (p2p: ``NCCL_P2P_LL_THRESHOLD``, 16 KiB)."""

LARGE_MESSAGE_BYTES = 32 * 2**20
"""Well over the size where NCCL switches collectives and p2p to the Simple protocol."""


@dataclass(kw_only=True, slots=True)
class CommWarmupSettings:
    when: Literal["post_recover", "first_step", "both"] = "both"
    """Which hook runs the warmup; ``both``: whichever comes first (once per process)."""

    timeout_s: float = 300.0
    """Upper bound on any single collective of the warmup, and on the ranks'
    check-in: a rank that never arrives makes the others raise after this long."""

    message_bytes: tuple[int, ...] = (SMALL_MESSAGE_BYTES, LARGE_MESSAGE_BYTES)
    """Message sizes each operation is warmed with, one per NCCL protocol class
    to connect (LL for small messages, Simple for large ones; add a middle size
    to connect LL128 too). Operations the step only issues on a few scalars
    (grad-norm, metrics) use the smallest size only."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(
                "comm_warmup.timeout_s (MEGASTART_COMM_WARMUP_TIMEOUT_S) must be a positive, "
                f"finite number of seconds, got {self.timeout_s}"
            )
        if not self.message_bytes or min(self.message_bytes) < 64:
            raise ValueError(
                f"message_bytes must list at least one size of 64 bytes or more, "
                f"got {self.message_bytes}"
            )
