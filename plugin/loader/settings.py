"""Settings of the ``rank0_loader`` plugin (section ``rank0_loader``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

PLUGIN = "rank0_loader"
"""The plugin's name: its settings section, its board, its log lines."""

BUCKET_MB_RANGE = (0.01, 1024.0)
"""The ``bucket_mb`` values accepted (MiB), see :attr:`Rank0LoaderSettings.bucket_mb`."""


@dataclass(kw_only=True, slots=True)
class Rank0LoaderSettings:
    reader: Literal["global", "node", "striped", "auto"] = "global"
    """``global``: global rank 0 reads, the checkpoint is read once per job;
    ``node``: local rank 0 of each node reads for its node (the checkpoint once per node);
    ``striped``: every node leader reads a share of the buckets, each bucket once per job,
    and sends it to the other nodes that need it (:mod:`megastart.loader.plan.stripes`): the
    job's cold read bandwidth is the sum of its readers' storage clients (every node must
    see the checkpoint at the same path);
    ``auto``: ``striped`` when the job spans several nodes, else ``global``. On one node
    all four read the same way (``node`` and ``striped`` as ``global``)."""

    transport: Literal["auto", "nccl", "gloo"] = "auto"
    """The backend between node leaders, in process groups of the loader's own
    (destroyed after the load); ``auto``: NCCL for CUDA parameters, gloo for CPU
    ones. Inside a node the ranks read the node's shared memory."""

    reader_node: Literal["page_cache", "shared_memory"] = "page_cache"
    """How the other ranks on the reader's node take their slices: ``page_cache``, each
    from its own read-only mapping of the files, once the reader has read a bucket into
    the page cache (one copy per byte; the faster route in ``megastart bench loader``,
    docs/performance.md); ``shared_memory``, out of shared-memory buffers the reader reads into (two
    copies, but the reader's read is all the node's ranks touch). Other nodes always
    receive into shared memory; ``.bin`` checkpoints, and kernels without
    ``MADV_POPULATE_READ`` (before Linux 5.14), always use shared memory."""

    cuda_copy: Literal["auto", "preads", "registered", "staged"] = "auto"
    """How a rank copies into CUDA parameters (:mod:`megastart.loader.stream.copier`):
    ``preads`` (what ``auto`` means for CUDA parameters), the ranges of each bucket its
    pieces lie in read by ``pread`` into page-locked chunks on several threads (a buffer of
    the node copied straight), and cut on the GPU in a device buffer of a bucket
    (:mod:`megastart.loader.stream.landing`); ``registered``, straight out of the page
    cache, its blocks registered with CUDA (read-only) on a thread of their own while the
    copies run, and what is not registered yet through page-locked staging; ``staged``,
    all through page-locked staging chunks filled out of the files' mappings on the rank's
    share of the node's cores. A driver that refuses registration gets ``staged``, with
    one log line. ``auto`` leaves CPU parameters to their own copies; ``preads`` takes them
    through the same route as CUDA ones (how CI checks it)."""

    bucket_mb: float = 32.0
    """Tensors are streamed in buckets of at most this many MiB (a tensor larger than
    that travels as row blocks in several buckets). Transient memory is about three
    buckets of shared memory per node, whatever the largest tensor, and with CUDA
    parameters two 4 MiB page-locked staging chunks per copy thread of each rank, at most
    64 MiB (:mod:`megastart.loader.stream.staging`). 32: on
    ``megastart bench loader`` (1 GB Qwen2, TP2 x PP2, gloo) it loaded faster than
    64 or 256 when buckets travelled by broadcast (smaller messages let the read of
    the next bucket and the broadcast tree's hops overlap sooner); three 32 MiB
    buffers keep a node's transient memory near 0.1 GB; 32 MiB messages already
    reach a broadcast's bandwidth between nodes (gloo here, NCCL on NVLink).
    Accepted: 0.01 to 1024. Below 10 KiB each bucket's fixed cost (a header
    broadcast, a read call) outweighs its bytes; above 1 GiB the memory bound
    stops being one: a node holds three buckets of shared memory (page-locked on
    CUDA; a node leader two more on its GPU for NCCL between nodes), 3 GiB and
    more per node, for no faster transfer."""

    timeout_s: float = 300.0
    """Upper bound on any single wait of the load; a wait on another rank counts it from the
    readers' last progress, so a load may last longer."""

    strict: bool = False
    """Checkpoint tensors no parameter uses are an error (default: a warning)."""

    allow_pickle: bool = False
    """Read ``.bin`` (pickle) checkpoints with ``torch.load(weights_only=True)``."""

    progress: bool = True
    """Show a progress bar on the reader (log lines when not on a terminal)."""

    skip_hf_load_on_resume: bool = True
    """On a restart, put off the HF load the host runs before its resume load
    (:mod:`megastart.restart`): if the resume restores every parameter it never runs (every
    rank checks, else every rank fails naming what nothing loaded); anything that needs the
    weights first runs it. Where a host adapter knows a resume follows: docs/hosts/."""

    def __post_init__(self) -> None:
        low, high = BUCKET_MB_RANGE
        if not low <= self.bucket_mb <= high:  # also refuses nan
            raise ValueError(
                f"rank0_loader.bucket_mb (MEGASTART_RANK0_LOADER_BUCKET_MB) must be between "
                f"{low:g} and {high:g} MiB, got {self.bucket_mb}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(
                "rank0_loader.timeout_s (MEGASTART_RANK0_LOADER_TIMEOUT_S) must be a positive, "
                f"finite number of seconds, got {self.timeout_s}"
            )


def resolved() -> Rank0LoaderSettings:
    """This process's ``rank0_loader`` settings (the defaults where the section is absent)."""
    from megastart.manager import get_settings

    section: Rank0LoaderSettings | None = get_settings().sections.get(PLUGIN)
    return section or Rank0LoaderSettings()
