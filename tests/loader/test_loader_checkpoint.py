"""Reading checkpoint directories: headers only, bytes exact, every bad input named with its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megastart.loader.checkpoint import (
    CheckpointError,
    TensorReader,
    as_seen_here,
    read_metadata,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], *, shards: int = 2) -> Path:
    """A sharded safetensors checkpoint with an index, as ``save_pretrained`` writes it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return directory


def sample_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(4, 3),
        "b.weight": torch.randn(5).to(torch.bfloat16),
        "c.bias": torch.arange(6, dtype=torch.int64),
    }


def test_headers_describe_every_tensor_and_reader_returns_exact_values(tmp_path: Path) -> None:
    tensors = sample_tensors()
    meta = read_metadata(write_checkpoint(tmp_path / "ckpt", tensors), allow_pickle=False)
    assert meta.config == CONFIG
    assert meta.format == "safetensors"
    assert {n: (e.shape, e.dtype) for n, e in meta.tensors.items()} == {
        "a.weight": ((4, 3), "float32"),
        "b.weight": ((5,), "bfloat16"),
        "c.bias": ((6,), "int64"),
    }
    reader = TensorReader(meta)
    for name, expected in tensors.items():
        out = torch.empty_like(expected)
        reader.read_into(meta.tensors[name], out)
        assert torch.equal(out, expected)
    converted = torch.empty(5, dtype=torch.float32)  # the reader converts to the parameter dtype
    reader.read_into(meta.tensors["b.weight"], converted)
    assert torch.equal(converted, tensors["b.weight"].float())
    reader.close()
    assert reader.bytes_read == 4 * 3 * 4 + 5 * 2 + 6 * 8 + 5 * 2


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'.*/nowhere' does not exist"):
        read_metadata(tmp_path / "nowhere", allow_pickle=False)


def test_missing_config_is_named(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "ckpt", sample_tensors())
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json' is missing"):
        read_metadata(directory, allow_pickle=False)


def test_index_naming_a_missing_shard_names_shard_and_tensors(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "ckpt", sample_tensors())
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"names shard\(s\) \['model-00002-of-00002.safetensors'\]"
    ) as e:
        read_metadata(directory, allow_pickle=False)
    assert "b.weight" in str(e.value)


def test_truncated_shard_names_file_and_size(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "ckpt", sample_tensors(), shards=1)
    shard = directory / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-20])
    with pytest.raises(
        CheckpointError,
        match=r"\(\d+ bytes\) is not a valid safetensors file \(.*file not fully covered\); "
        r"the file is corrupt or truncated",
    ):
        read_metadata(directory, allow_pickle=False)


def test_corrupt_header_is_reported(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "ckpt", sample_tensors(), shards=1)
    shard = directory / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{["
    shard.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError,
        match=r"not a valid safetensors file.*invalid UTF-8 in header.*download it again",
    ):
        read_metadata(directory, allow_pickle=False)


def test_pickle_checkpoint_refused_unless_allowed(tmp_path: Path) -> None:
    directory = tmp_path / "bin"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIG))
    tensors = sample_tensors()
    torch.save(tensors, directory / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError, match=r"pickle .* refuses it by default.*allow_pickle=true"
    ):
        read_metadata(directory, allow_pickle=False)
    meta = read_metadata(directory, allow_pickle=True)
    assert meta.format == "bin"
    out = torch.empty(4, 3)
    TensorReader(meta).read_into(meta.tensors["a.weight"], out)
    assert torch.equal(out, tensors["a.weight"])


def test_model_type_table_agrees_with_transformers_auto_classes() -> None:
    """Without ``transformers`` the mapping tables' ``model_types`` pick the class; with it,
    its ``AutoModelForCausalLM`` table does: both must agree for every mapped architecture."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from megastart.harness.checkpoints import ARCHITECTURES
    from megastart.loader.mapping.mappings import architecture_for_model_type

    for model_type, architecture in ARCHITECTURES.items():
        assert architecture_for_model_type(model_type) == architecture
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == architecture
    assert architecture_for_model_type("bert") is None


def test_another_nodes_mount_reads_the_same_version_and_refuses_another(tmp_path: Path) -> None:
    """Rank 0 records each shard's identity; another node's mount of a shared file system
    numbers the device (a FUSE mount the inodes) its own way. The same size and modification
    time are the same version: that node reads with its own identities. A shard rewritten
    since (another modification time), or absent on that node, is refused by name."""
    import os
    from dataclasses import replace

    tensors = {"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5)}
    directory = write_checkpoint(tmp_path / "ckpt", tensors)
    meta = read_metadata(directory, allow_pickle=False)
    on_rank0 = {
        f: identity._replace(device=identity.device + 1, inode=identity.inode + 7)
        for f, identity in meta.shards.items()
    }
    here = as_seen_here(meta.directory, on_rank0)
    assert here == meta.shards
    reader = TensorReader(replace(meta, shards=here))
    out = torch.empty(3, 4)
    reader.read_into(meta.tensors["a"], out)
    reader.close()
    assert torch.equal(out, tensors["a"])

    shard = Path(directory) / meta.tensors["b"].file
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError, match=f"{shard.name}' changed while loading"):
        as_seen_here(meta.directory, on_rank0)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"does not exist on this node .* same path"):
        as_seen_here(meta.directory, on_rank0)
