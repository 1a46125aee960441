"""Settings of the ``rank0_loader`` plugin (section ``rank0_loader``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class Rank0LoaderSettings:
    reader: Literal["global", "node"] = "global"
    """``global``: global rank 0 reads, the checkpoint is read once per job;
    ``node``: local rank 0 of each node reads and broadcasts inside its node."""

    transport: Literal["auto", "nccl", "gloo"] = "auto"
    """The backend of the loader's own process group (destroyed after the load);
    ``auto``: NCCL for CUDA parameters, gloo for CPU ones."""

    bucket_mb: float = 32.0
    """Tensors are streamed in buckets of at most this many MiB (a tensor larger than
    that travels as row blocks in several buckets). Transient memory is about one
    bucket per receiving rank and two on the reader, whatever the largest tensor.
    32: on ``megastart bench loader`` (1 GB Qwen2, TP2 x PP2, gloo) it loads faster
    than 64 or 256 (smaller messages let the read of the next bucket and the
    broadcast tree's hops overlap sooner) and keeps the transient node memory near
    0.17 GB, over 20x below every rank loading the checkpoint; 32 MiB messages
    already reach a broadcast's bandwidth (gloo here, NCCL on NVLink)."""

    timeout_s: float = 300.0
    """Upper bound on any single collective of the load."""

    strict: bool = False
    """Checkpoint tensors no parameter uses are an error (default: a warning)."""

    allow_pickle: bool = False
    """Read ``.bin`` (pickle) checkpoints with ``torch.load(weights_only=True)``."""

    progress: bool = True
    """Show a progress bar on the reader (log lines when not on a terminal)."""

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
