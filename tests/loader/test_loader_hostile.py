"""Checkpoints that would load a wrong model silently, hang a rank or explain themselves
wrongly: quantised weights, a checkpoint replaced mid-load, special files, misleading
indexes and configs, more shards than open files. Each refused on every rank (or left
whole to the host), naming the file and the fix, on both of the reader node's routes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from support.hostile_ranks import (
    load_for_host,
    load_while_replacing_the_checkpoint,
    load_with_few_file_handles,
    load_with_stalled_metadata,
    timed_error,
)
from support.loader_ranks import load_expecting_error
from support.quantise import quantise_fp8, rewrite_shards

from megastart.harness.launch import RankPool
from megastart.loader.checkpoint.files import MAX_OPEN_SHARDS

ROUTES = ("page_cache", "shared_memory")
TP2 = {"tp": 2}


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 checkpoint, as DeepSeek-V3's FP8 weights were made from."""
    from megastart.harness.checkpoints import make_checkpoint

    directory = tmp_path_factory.mktemp("llama_bf16")
    make_checkpoint("llama", directory, tie_word_embeddings=False, dtype="bfloat16")
    return directory


@pytest.fixture
def quantisable(bf16: Path, tmp_path: Path) -> Path:
    """A copy of the bf16 checkpoint that a test quantises."""
    return Path(shutil.copytree(bf16, tmp_path / "checkpoint"))


@pytest.fixture
def checkpoint(llama: Path, tmp_path: Path) -> Path:
    """A copy of the Llama checkpoint that a test may damage."""
    return Path(shutil.copytree(llama, tmp_path / "checkpoint"))


def same_on_every_rank(messages: list[str]) -> str:
    assert len(set(messages)) == 1, messages
    assert messages[0] != "loaded"
    return messages[0]


def gptq_packed(tensors: dict[str, torch.Tensor]) -> None:
    """GPTQ's format for one projection: packed int32 ``qweight``, ``qzeros``, ``scales``, ``g_idx``."""
    name = "model.layers.0.mlp.up_proj"
    if f"{name}.weight" not in tensors:  # another shard
        return
    rows, cols = tensors.pop(f"{name}.weight").shape
    tensors[f"{name}.qweight"] = torch.zeros(cols // 8, rows, dtype=torch.int32)
    tensors[f"{name}.qzeros"] = torch.zeros(1, rows // 8, dtype=torch.int32)
    tensors[f"{name}.scales"] = torch.ones(1, rows, dtype=torch.float16)
    tensors[f"{name}.g_idx"] = torch.zeros(cols, dtype=torch.int32)


def quantise(directory: Path, form: str) -> None:
    """``fp8``: DeepSeek-V3's format without ``weight_block_size`` (the loader cannot tell the
    blocks); ``fp8_tensors_only``: its tensors without any ``quantization_config``; ``gptq``."""
    if form == "gptq":
        rewrite_shards(directory, gptq_packed)
        return
    quantise_fp8(directory, config=form == "fp8")
    if form == "fp8":
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text())
        del config["quantization_config"]["weight_block_size"]
        config_path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("form", "method", "evidence"),
    [
        ("fp8", "fp8", "config.json has quantization_config"),
        ("fp8_tensors_only", "fp8", "is float8_e4m3fn"),
        ("gptq", "gptq/awq", "is a packed-integer companion"),
    ],
)
@pytest.mark.parametrize("route", ROUTES)
def test_quantised_checkpoint_is_refused_on_every_rank_not_cast(
    pool: RankPool, quantisable: Path, form: str, method: str, evidence: str, route: str
) -> None:
    checkpoint = quantisable
    quantise(checkpoint, form)
    message = same_on_every_rank(
        pool.run(load_expecting_error, str(checkpoint), TP2, {"reader_node": route})
    )
    assert message.startswith(
        f"QuantisedCheckpoint: checkpoint '{checkpoint}' is quantised ({method}: "
    )
    assert evidence in message
    assert "never casts quantised weights without their scales" in message
    assert "Load a bf16/fp16 copy of the model" in message


def test_quantised_checkpoint_goes_whole_to_a_host_that_dequantises_it(
    pool: RankPool, quantisable: Path
) -> None:
    checkpoint = quantisable
    quantise(checkpoint, "fp8")
    (left, lines0), (left1, lines1) = pool.run(load_for_host, str(checkpoint), frozenset({"fp8"}))
    assert left == left1 == "left to the host"
    assert len(lines0) == 1 and not lines1, (lines0, lines1)
    assert "leaves" in lines0[0] and "which dequantises fp8 checkpoints" in lines0[0]


def test_quantised_checkpoint_is_refused_where_the_host_does_not_dequantise_it(
    pool: RankPool, quantisable: Path
) -> None:
    checkpoint = quantisable
    quantise(checkpoint, "fp8")
    (error, lines0), (error1, lines1) = pool.run(
        load_for_host, str(checkpoint), frozenset({"gptq"})
    )
    assert error == error1 and error.startswith("QuantisedCheckpoint: ")
    assert len(lines0) == 1 and not lines1, (lines0, lines1)
    assert lines0[0].startswith("megastart: rank0_loader refuses the load on every rank: ")


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_replaced_while_loading_fails_on_every_rank(
    pool: RankPool, checkpoint: Path, route: str
) -> None:
    overrides = {"reader_node": route}
    message = same_on_every_rank(
        pool.run(load_while_replacing_the_checkpoint, str(checkpoint), overrides)
    )
    assert message.startswith("CollectiveError: rank0_loader: ")
    assert f"'{checkpoint}/model-0000" in message
    assert "changed while loading" in message
    assert "load again once it is stable" in message


@pytest.mark.parametrize("special", ["shard", "indexed_shard", "config"])
@pytest.mark.parametrize("route", ROUTES)
def test_fifo_in_the_checkpoint_is_refused_within_the_timeout(
    pool: RankPool, checkpoint: Path, llama: Path, special: str, route: str
) -> None:
    index = checkpoint / "model.safetensors.index.json"
    if special == "config":
        fifo = checkpoint / "config.json"
    elif special == "indexed_shard":
        fifo = checkpoint / json.loads(index.read_text())["weight_map"]["lm_head.weight"]
    else:
        index.unlink()
        fifo = checkpoint / "extra.safetensors"
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    overrides = {"reader_node": route, "timeout_s": 10.0}
    results = pool.run(timed_error, str(checkpoint), overrides, str(llama))
    message = same_on_every_rank([m for m, _ in results])
    assert f"'{fifo}'" in message and "is a FIFO, not a regular file" in message
    assert all(seconds < 10 for _, seconds in results), results


@pytest.mark.parametrize("route", ROUTES)
def test_metadata_read_the_storage_never_answers_fails_every_rank_within_the_timeout(
    pool: RankPool, checkpoint: Path, route: str
) -> None:
    overrides = {"reader_node": route, "timeout_s": 2.0}
    results = pool.run(load_with_stalled_metadata, str(checkpoint), overrides, 6.0)
    message = same_on_every_rank([m for m, _ in results])
    assert f"reading the metadata of '{checkpoint}' failed on rank 0: it did not finish " in message
    assert "within timeout_s=2 s (the storage did not answer)" in message
    assert all(seconds < 5 for _, seconds in results), results


@pytest.mark.parametrize("route", ROUTES)
def test_index_with_an_empty_weight_map_is_named(
    pool: RankPool, checkpoint: Path, route: str
) -> None:
    index = checkpoint / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    overrides = {"reader_node": route}
    message = same_on_every_rank(pool.run(load_expecting_error, str(checkpoint), TP2, overrides))
    assert f"'{index}' is an index with an empty 'weight_map'" in message


@pytest.mark.parametrize("route", ROUTES)
def test_index_inconsistent_with_its_shards_is_named(
    pool: RankPool, checkpoint: Path, route: str
) -> None:
    index = checkpoint / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    shards = sorted(set(content["weight_map"].values()))
    moved = next(n for n, f in content["weight_map"].items() if f == shards[0])
    content["weight_map"][moved] = shards[1]
    index.write_text(json.dumps(content))
    overrides = {"reader_node": route}
    message = same_on_every_rank(pool.run(load_expecting_error, str(checkpoint), TP2, overrides))
    assert f"'{index}' is inconsistent with the shards: it puts tensor '{moved}'" in message
    assert f"in '{shards[1]}', but '{shards[0]}' holds it" in message


@pytest.mark.parametrize(
    ("file", "damage", "expected"),
    [
        ("config.json", b'{"model_type": "llama", \xff}', "is not UTF-8 text: byte 24 is 0xff"),
        ("config.json", b'{"model_type": "ll\xc3\xa9", }', "enclosed in double quotes at byte 23"),
        ("model.safetensors.index.json", b'{"weight_map": [}', "at byte 16 (line 1, column 17)"),
    ],
)
@pytest.mark.parametrize("route", ROUTES)
def test_undecodable_config_and_index_name_the_file_and_the_byte(
    pool: RankPool,
    checkpoint: Path,
    llama: Path,
    file: str,
    damage: bytes,
    expected: str,
    route: str,
) -> None:
    (checkpoint / file).write_bytes(damage)
    overrides = {"reader_node": route}
    message = same_on_every_rank(
        pool.run(load_expecting_error, str(checkpoint), TP2, overrides, str(llama))
    )
    assert f"'{checkpoint / file}'" in message and expected in message
    assert "save_pretrained" in message  # the fix


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of one tensor per shard, more shards than the file-handle limit below."""
    from megastart.harness.checkpoints import make_checkpoint

    directory = tmp_path_factory.mktemp("many_shards")
    make_checkpoint("llama", directory, num_hidden_layers=12, max_shard_size=1)
    assert len(list(directory.glob("*.safetensors"))) > 4 * MAX_OPEN_SHARDS
    return directory


@pytest.mark.parametrize("route", ROUTES)
def test_more_shards_than_open_files_load(pool: RankPool, many_shards: Path, route: str) -> None:
    outcomes = pool.run(
        load_with_few_file_handles, str(many_shards), {"reader_node": route}, 2 * MAX_OPEN_SHARDS
    )
    assert outcomes == ["loaded", "loaded"]
