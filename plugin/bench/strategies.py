"""The loading strategies the benchmark compares, as rank functions for a RankPool.

Every strategy converts HF tensors to Megatron shards with megastart's own
mapping tables and transforms (:mod:`megastart.loader.mapping.mappings`,
:mod:`megastart.loader.mapping.transforms`), so all of them write the same values;
only how the bytes get from the files to the ranks differs (the baselines:
:mod:`megastart.bench.baselines`):

* ``megastart``: :func:`megastart.load_hf_checkpoint` (one reader; its node's ranks take
  their slices from the page cache, other nodes' from shared memory).
* ``megastart_shm``: the same with ``reader_node=shared_memory`` (shared memory everywhere).
* ``megastart_registered``: the same with ``cuda_copy=registered`` (into CUDA straight out of
  the page cache registered with CUDA, the rest through the staging ring);
  ``megastart_staged``: with ``cuda_copy=staged`` (all through the staging ring, filled out of
  the files' mappings: the route before the GPU cut).
* ``megastart_registry``: the same, with the mapping from Megatron-Bridge's registry for the
  checkpoint's architecture (as on verl 0.9's default branch), where Megatron-Bridge imports.
* ``bridge``: Megatron-Bridge's own load (``AutoBridge.load_hf_weights``), where it imports;
  its mappings are not megastart's, so its checksum checks both.
* ``every_rank_full``: every rank holds a private copy of the whole checkpoint.
* ``stage_reader``: tensor-parallel rank 0 reads its stage, then scatters.
* ``mmap_slices``: every rank reads only its slices from the mmapped files.

On a checkpoint with packed experts (:mod:`megastart.bench.packed`) every megastart route
maps through the bridge's registry (the built-in tables read one tensor per expert), and the
baselines do not run.

``megastart[R]`` is megastart with ``reader=R`` (``bench loader --readers``). With
``--read-gbps`` every strategy's reads of the files are capped per process
(:class:`~megastart.bench.limits.ReadCap`), as a parallel file system caps each client.

The rank process keeps the model it built between calls (:data:`_STATE`), since
the benchmark builds, loads, measures and checksums in separate pool runs.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from megastart.bench.baselines import BASELINES
from megastart.bench.loader_results import strategy_reader

IMPLEMENTATIONS = {
    "megastart": "real: megastart.load_hf_checkpoint (reader=global, transport=gloo)",
    "megastart_shm": (
        "real: megastart.load_hf_checkpoint with reader_node=shared_memory (the reader's node "
        "takes its slices out of shared-memory slots, not the page cache)"
    ),
    "megastart_registry": (
        "real: megastart.load_hf_checkpoint(bridge=AutoBridge.from_hf_pretrained(checkpoint)): "
        "the mapping from Megatron-Bridge's registry, not the built-in table"
    ),
    "megastart_registered": (
        "real: megastart.load_hf_checkpoint with cuda_copy=registered (into CUDA straight out "
        "of the page cache registered with CUDA read-only, the rest through page-locked staging)"
    ),
    "megastart_staged": (
        "real: megastart.load_hf_checkpoint with cuda_copy=staged (into CUDA through page-locked "
        "staging chunks filled out of the files' mappings, cut on the CPU)"
    ),
    "bridge": (
        "real: Megatron-Bridge's AutoBridge.load_hf_weights(chunks, checkpoint) (a packed-experts "
        "checkpoint: its model bridge with the packed mappings 0.6 gives Qwen3.5-MoE, "
        "load_weights_hf_to_megatron); bytes read not counted (0)"
    ),
    "every_rank_full": (
        "re-implementation of verl's legacy loader (before verl PR #330 every rank ran "
        "from_pretrained, verl/utils/model.py _load_hf_model, and copied its slices): every "
        "rank reads every tensor into a private copy, then copies its shards"
    ),
    "stage_reader": (
        "re-implementation of mbridge Bridge.load_weights(memory_efficient=False) "
        "(mbridge/core/bridge.py _load_weights_impl): TP rank 0 of each stage reads all its "
        "chunk's tensors (SafeTensorIO.load_some_hf_weight: safe_open + get_tensor), then "
        "per parameter builds every TP rank's shard and torch.distributed.scatter()s them"
    ),
    "mmap_slices": (
        "re-implementation of AReaL load_weights_from_hf_with_mbridge_fast "
        "(areal/models/mcore/hf_load.py): every rank safe_open()s the files and reads only "
        "its TP slices through get_slice(), in a thread pool of min(8, cpus // world) workers"
    ),
}

MEGASTART_ROUTES = {
    "megastart": {},
    "megastart_shm": {"reader_node": "shared_memory"},
    "megastart_registry": {},
    "megastart_registered": {"cuda_copy": "registered"},
    "megastart_staged": {"cuda_copy": "staged"},
}
"""The strategies that are megastart, and the settings each adds to the benchmark's."""

_STATE: dict[str, Any] = {}
"""This rank's model chunks and checkpoint metadata, from :func:`build_model` until :func:`teardown`."""


# --- rank functions (run through RankPool.run) -------------------------------


def build_model(checkpoint: str, layout: dict[str, Any], device: str = "cpu") -> None:
    """Initialise Megatron for ``layout`` and build this rank's chunks in ``layout["dtype"]``
    (a torch dtype name), by default the checkpoint's, on ``device``.

    For ``cuda`` the chunks are built on CPU and moved to this rank's GPU (rank modulo the
    GPUs visible: several ranks may share one), and the CPU shims are removed again.
    The parameters start as zeros, not random: every load overwrites what it loads, and the
    random initialisation of a 4 GB model took longer than all of a strategy's loads.
    """
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from megastart.harness.cpu import initialize_megatron, remove_shims
    from megastart.harness.model import build_gpt_chunks
    from megastart.loader.checkpoint import read_metadata

    meta = read_metadata(checkpoint, allow_pickle=False)
    dtypes = [entry.dtype for entry in meta.tensors.values()]
    dtype = getattr(torch, layout.get("dtype") or max(set(dtypes), key=dtypes.count))
    initialize_megatron(tp=layout["tp"], pp=layout["pp"], vpp=layout["vpp"], ep=layout["ep"])
    hf_config = AutoConfig.from_pretrained(checkpoint)
    chunks = build_gpt_chunks(hf_config, dtype=dtype, perform_initialization=False)
    with torch.no_grad():
        for parameter in (p for chunk in chunks for p in chunk.parameters()):
            parameter.zero_()
    if device == "cuda":
        remove_shims()
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        chunks = [chunk.to("cuda") for chunk in chunks]
    _STATE.update(chunks=chunks, meta=meta, device=device)


def load(
    strategy: str,
    checkpoint: str,
    megastart_options: dict[str, Any],
    read_gbps: float | None = None,
) -> dict[str, Any]:
    """Load with ``strategy``, timed between two barriers: wall seconds, bytes this rank read,
    bytes sent between nodes (megastart's report; on rank 0), and on CUDA the GPU memory the
    load allocated beyond the parameters (peak).

    :param megastart_options: ``Rank0LoaderSettings`` fields for the ``megastart`` strategy.
    :param read_gbps: this process's storage bandwidth, in GB/s (``None``: the machine's).
    """
    import torch
    import torch.distributed as dist

    from megastart.bench.limits import ReadCap, megastart_reads_capped
    from megastart.bench.packed import is_packed

    chunks = _STATE["chunks"]
    on_cuda = _STATE["device"] == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_before = torch.cuda.memory_allocated()
    routed = megastart_route(strategy)
    packed = is_packed(_STATE["meta"].tensors)  # megastart's own tables read experts one by one
    by_bridge = strategy in ("megastart_registry", "bridge") or (routed is not None and packed)
    bridge = _bridge(checkpoint) if by_bridge else None
    cap = ReadCap(read_gbps) if read_gbps else None
    dist.barrier()
    start = time.perf_counter()
    between_nodes = 0
    if routed is not None:
        with megastart_reads_capped(cap):
            options = megastart_options | routed
            bytes_read, between_nodes = _megastart(chunks, checkpoint, options, bridge)
    elif strategy == "bridge":
        bytes_read = _bridge_load(bridge, chunks, checkpoint)
    else:
        bytes_read = BASELINES[strategy](chunks, _STATE["meta"], cap)
    if on_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    wall_s = time.perf_counter() - start
    gpu_extra = torch.cuda.max_memory_allocated() - gpu_before if on_cuda else 0
    return {
        "wall_s": wall_s,
        "bytes_read": bytes_read,
        "bytes_between_nodes": between_nodes,
        "gpu_peak_extra_bytes": gpu_extra,
    }


def megastart_route(strategy: str) -> dict[str, Any] | None:
    """The settings a megastart strategy adds (``megastart[node]``: ``reader=node``), or ``None``
    for a baseline."""
    base, reader = strategy_reader(strategy)
    if base not in MEGASTART_ROUTES:
        return None
    return MEGASTART_ROUTES[base] | ({"reader": reader} if reader else {})


def implementation(strategy: str, *, packed: bool = False) -> str:
    """What ``strategy`` runs, for the report (``packed``: on a checkpoint with packed experts,
    where megastart maps through the bridge's registry)."""
    base, reader = strategy_reader(strategy)
    text = IMPLEMENTATIONS[base]
    if reader:
        text = text.replace("reader=global", f"reader={reader}")
    if packed and base in MEGASTART_ROUTES and base != "megastart_registry":
        text += "; mapped through Megatron-Bridge's registry of packed mappings (bench.packed)"
    return text


def _bridge(checkpoint: str) -> Any:
    """The checkpoint's bridge, made once per process (a host builds its bridge when it builds
    the model, long before it loads): its ``AutoBridge``, or for packed experts the model
    bridge with the packed mappings (:mod:`megastart.bench.packed`)."""
    if "bridge" not in _STATE:
        from megastart.bench.packed import bridge_with_packed_experts, is_packed

        try:
            from megatron.bridge import AutoBridge
        except ImportError as e:
            raise RuntimeError(
                f"the bridge and megastart_registry strategies need Megatron-Bridge, and "
                f"megatron.bridge does not import in this rank process: {e}"
            ) from e
        auto = AutoBridge.from_hf_pretrained(checkpoint)
        packed = is_packed(_STATE["meta"].tensors)
        _STATE["bridge"] = bridge_with_packed_experts(auto) if packed else auto
        _STATE["auto_bridge"] = auto
    return _STATE["bridge"]


def _bridge_load(bridge: Any, chunks: list[Any], checkpoint: str) -> int:
    """Megatron-Bridge's own load; its bytes read are not counted (0)."""
    if bridge is _STATE["auto_bridge"]:
        bridge.load_hf_weights(chunks, checkpoint)
    else:
        bridge.load_weights_hf_to_megatron(_STATE["auto_bridge"].hf_pretrained, chunks)
    return 0


def settle() -> None:
    """Free what the last step left behind, so PSS shows only what is still in use."""
    from megastart.bench.memory import release_free_memory

    release_free_memory()


def checksum() -> str:
    """SHA-256 over this rank's parameters (names, dtypes, shapes and bytes), in name order."""
    import torch

    digest = hashlib.sha256()
    for i, chunk in enumerate(_STATE["chunks"]):
        for name, param in sorted(chunk.named_parameters()):
            digest.update(f"{i}:{name}:{param.dtype}:{tuple(param.shape)}".encode())
            digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def teardown() -> None:
    from megastart.harness.cpu import destroy_megatron

    _STATE.clear()
    destroy_megatron()


# --- megastart: (chunks, checkpoint, options, bridge) -> bytes read and sent ---


def _megastart(
    chunks: list[Any], checkpoint: str, options: dict[str, Any], bridge: Any
) -> tuple[int, int]:
    import torch.distributed as dist

    from megastart import load_hf_checkpoint
    from megastart.loader.settings import Rank0LoaderSettings

    settings = Rank0LoaderSettings(**options)
    report = load_hf_checkpoint(chunks, checkpoint, settings=settings, bridge=bridge)
    # The report counts what every reader read and sent; charge it to the first reader.
    if dist.get_rank() == min(report.reader_ranks):
        return report.bytes_read, report.bytes_broadcast
    return 0, 0
