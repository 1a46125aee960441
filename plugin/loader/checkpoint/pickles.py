"""``.bin`` (pickle) checkpoints, read only when the user allows it, with
``torch.load(weights_only=True, mmap=True)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from megastart.loader.checkpoint.entries import TensorEntry, add_entry
from megastart.loader.checkpoint.errors import CheckpointError
from megastart.loader.checkpoint.files import ShardIdentity, changed, open_regular

if TYPE_CHECKING:
    import torch


def read_entries(
    path: Path, files: list[str]
) -> tuple[dict[str, TensorEntry], dict[str, ShardIdentity]]:
    """Every tensor of the ``.bin`` files ``files`` (relative to ``path``), and their identities."""
    entries: dict[str, TensorEntry] = {}
    shards: dict[str, ShardIdentity] = {}
    for file in files:
        fd = open_regular(path / file, "a shard")
        try:
            shards[file] = ShardIdentity.of(os.fstat(fd))
        finally:
            os.close(fd)
        for name, tensor in load_bin(path / file, shards[file]).items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            add_entry(entries, TensorEntry(name, file, dtype, tuple(tensor.shape)), path)
    return entries, shards


def load_bin(file: Path, expected: ShardIdentity) -> dict[str, torch.Tensor]:
    """The state dict of ``file``, which must still be the version ``expected``."""
    import torch

    found = ShardIdentity.of(os.stat(file))
    if found != expected:
        raise changed(file, expected, found)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(
            f"{str(file)!r} could not be read with torch.load(weights_only=True): {e}"
        ) from e
    fix = "save the model's state dict (tensor name -> tensor) with torch.save, or convert to safetensors"
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{str(file)!r} holds a {type(state).__name__}, not a state dict; {fix}"
        )
    if not state:
        raise CheckpointError(f"{str(file)!r} holds an empty state dict (no tensors); {fix}")
    odd = next(
        (k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)),
        None,
    )
    if odd is not None:
        raise CheckpointError(
            f"{str(file)!r} holds {odd!r} -> {type(state[odd]).__name__}, not tensor name -> tensor; {fix}"
        )
    return state
