"""Settings of the ``comm_warmup`` plugin (section ``comm_warmup``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class CommWarmupSettings:
    when: Literal["post_recover", "first_step", "both"] = "both"
    """Which hook runs the warmup; ``both``: whichever comes first (once per process)."""

    timeout_s: float = 300.0
    """Upper bound on any single collective of the warmup."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
