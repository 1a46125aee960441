"""Settings of the ``rank0_loader`` plugin (section ``rank0_loader``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class Rank0LoaderSettings:
    reader: Literal["global", "node"] = "global"
    """``global``: global rank 0 reads, the checkpoint is read once per job;
    ``node``: local rank 0 of each node reads for its node."""

    transport: Literal["auto", "nccl", "gloo"] = "auto"
    """The backend between node leaders, in process groups of the loader's own
    (destroyed after the load); ``auto``: NCCL for CUDA parameters, gloo for CPU
    ones. Inside a node the ranks read the node's shared memory."""

    bucket_mb: float = 32.0
    """Tensors are streamed in buckets of at most this many MiB (a tensor larger than
    that travels as row blocks in several buckets). Transient memory is about three
    buckets of shared memory per node, whatever the largest tensor. 32: on
    ``megastart bench loader`` (1 GB Qwen2, TP2 x PP2, gloo) it loaded faster than
    64 or 256 when buckets travelled by broadcast (smaller messages let the read of
    the next bucket and the broadcast tree's hops overlap sooner); three 32 MiB
    slots keep a node's transient memory near 0.1 GB; 32 MiB messages already
    reach a broadcast's bandwidth between nodes (gloo here, NCCL on NVLink)."""

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
