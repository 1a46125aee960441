"""The hosts' own loaders, re-implemented as the benchmark's baselines.

Each converts HF tensors to Megatron shards with megastart's mapping tables and
transforms, so it writes the same values as megastart; only how the bytes get from
the files to the ranks differs, as in the host it stands for
(:data:`megastart.bench.strategies.IMPLEMENTATIONS` names the source of each).
Reads are charged to the process's :class:`~megastart.bench.limits.ReadCap`, if any.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from megastart.bench.limits import ReadCap
    from megastart.loader.checkpoint import CheckpointMeta
    from megastart.loader.mapping.needs import Need
    from megastart.loader.mapping.transforms import Piece, Shard


def every_rank_full(chunks: list[Any], meta: CheckpointMeta, cap: ReadCap | None) -> int:
    """Every rank reads every tensor into a private copy, then copies its shards."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(meta):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                # A private copy, as the HF model from_pretrained built on every rank held.
                state[name] = f.get_tensor(name).clone()
                _storage_read(cap, state[name].nbytes)
    for needs, shard in _needs_by_chunk(chunks, meta):
        for need in needs:
            _write(chunks, need, _pieces(need, [state[n] for n in need.hf], shard))
    bytes_read = sum(t.nbytes for t in state.values())
    del state
    return bytes_read


def stage_reader(chunks: list[Any], meta: CheckpointMeta, cap: ReadCap | None) -> int:
    """Tensor-parallel rank 0 reads its stage's tensors, builds every shard, scatters them."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp_group = mpu.get_tensor_model_parallel_group()
    tp_rank, tp_size = (
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_tensor_model_parallel_world_size(),
    )
    src = dist.get_global_rank(tp_group, 0)
    bytes_read = 0
    for needs, shard in _needs_by_chunk(chunks, meta):
        hf_weights: dict[str, torch.Tensor] = {}
        if tp_rank == 0:  # the whole chunk's tensors at once (memory_efficient=False)
            hf_weights = _read_full_tensors(meta, {n for need in needs for n in need.hf}, cap)
            bytes_read += sum(t.nbytes for t in hf_weights.values())
        for need in needs:
            param = _param(chunks, need)
            shards = None
            if tp_rank == 0:
                inputs = [hf_weights[n] for n in need.hf]
                shards = [
                    _assemble(need, inputs, _with_tp_rank(shard, r), param) for r in range(tp_size)
                ]
            received = torch.empty(param.shape, dtype=param.dtype)  # gloo scatters host memory
            dist.scatter(received, shards, src=src, group=tp_group)
            _write(chunks, need, [(0, received.shape[0], received)])
        del hf_weights
    return bytes_read


def mmap_slices(chunks: list[Any], meta: CheckpointMeta, cap: ReadCap | None) -> int:
    """Every rank reads only its slices through ``get_slice``, on a few threads."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist
    from safetensors import safe_open

    counter = _ByteCounter(cap)
    handles = {
        file: safe_open(os.path.join(meta.directory, file), framework="pt", device="cpu")
        for file in {entry.file for entry in meta.tensors.values()}
    }
    lazy = {
        name: _FileSlice(handles[entry.file].get_slice(name), counter)
        for name, entry in meta.tensors.items()
    }

    def load_one(need: Need, shard: Shard) -> None:
        _write(chunks, need, _pieces(need, [lazy[n] for n in need.hf], shard))

    work = [(need, shard) for needs, shard in _needs_by_chunk(chunks, meta) for need in needs]
    workers = min(8, max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(load_one, *zip(*work, strict=True)))
    return counter.total


BASELINES: dict[str, Callable[[list[Any], CheckpointMeta, ReadCap | None], int]] = {
    "every_rank_full": every_rank_full,
    "stage_reader": stage_reader,
    "mmap_slices": mmap_slices,
}
"""The baselines by strategy name: (chunks, metadata, read cap) -> bytes this rank read."""


def checkpoint_files(meta: CheckpointMeta) -> list[str]:
    """The paths of the checkpoint's weight files, in name order."""
    return [
        os.path.join(meta.directory, f) for f in sorted({e.file for e in meta.tensors.values()})
    ]


class _ByteCounter:
    def __init__(self, cap: ReadCap | None) -> None:
        self.total = 0
        self._cap = cap
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes
        _storage_read(self._cap, nbytes)


def _storage_read(cap: ReadCap | None, nbytes: int) -> None:
    """A baseline read ``nbytes`` of the files: charged to the process's cap (if any)."""
    if cap is not None:
        cap.charge(nbytes)


class _FileSlice:
    """A checkpoint tensor not read yet: indexing it reads only that part of the file.

    Stands in for the full tensor in megastart's transforms, which only index
    their inputs, so a transform reads exactly the slices its shard needs, as
    AReaL's ``get_slice`` loader does.
    """

    def __init__(self, handle: Any, counter: _ByteCounter) -> None:
        import torch

        self._handle = handle
        self._counter = counter
        self.shape = tuple(handle.get_shape())
        self.dtype = getattr(torch, _SAFETENSORS_DTYPES[handle.get_dtype()])
        self.device = torch.device("cpu")

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._handle[index]
        self._counter.add(tensor.nbytes)
        return tensor


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def _read_full_tensors(
    meta: CheckpointMeta, names: set[str], cap: ReadCap | None
) -> dict[str, torch.Tensor]:
    """mbridge's ``SafeTensorIO.load_some_hf_weight``: grouped by file, ``get_tensor`` each."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(meta.tensors[name].file, []).append(name)
    out = {}
    for file, file_names in by_file.items():
        with safe_open(os.path.join(meta.directory, file), framework="pt", device="cpu") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
                _storage_read(cap, out[name].nbytes)
    return out


def _pieces(need: Need, inputs: list[Any], shard: Shard) -> Iterator[Piece]:
    from megastart.loader.mapping.transforms import TRANSFORMS

    return TRANSFORMS[need.transform].pieces(inputs, need.param.shape, shard)


def _write(chunks: list[Any], need: Need, pieces: Iterable[Piece]) -> None:
    """Copy the transform's row blocks into the parameter (reading lazy slices now)."""
    import torch

    param = _param(chunks, need)
    with torch.no_grad():
        for first, stop, block in pieces:
            param[first:stop].copy_(block if isinstance(block, torch.Tensor) else block[:])


def _assemble(need: Need, inputs: list[Any], shard: Shard, like: torch.Tensor) -> torch.Tensor:
    """One TP rank's whole shard as a host tensor (what mbridge scatters)."""
    import torch

    out = torch.empty(like.shape, dtype=like.dtype)
    for first, stop, block in _pieces(need, inputs, shard):
        out[first:stop].copy_(block)
    return out


def _param(chunks: list[Any], need: Need) -> torch.Tensor:
    """The parameter (or loaded buffer: the router's expert bias) a need fills."""
    chunk = chunks[need.param.chunk]
    module, _, name = need.param.local_name.rpartition(".")
    tensor: torch.Tensor = getattr(chunk.get_submodule(module), name)
    return tensor


def _with_tp_rank(shard: Shard, tp_rank: int) -> Shard:
    """Another TP rank's shard; experts too, whose expert-TP group is the TP group (ETP = TP)."""
    from dataclasses import replace

    return replace(shard, tp_rank=tp_rank, expert_tp_rank=tp_rank)


def _needs_by_chunk(chunks: list[Any], meta: CheckpointMeta) -> list[tuple[list[Need], Shard]]:
    """This rank's needs per chunk, resolved exactly as megastart's loader resolves them."""
    from megastart.loader.mapping.model import local_needs

    _, _, shard, needs = local_needs(chunks, meta)
    return [([n for n in needs if n.param.chunk == i], shard) for i in range(len(chunks))]
