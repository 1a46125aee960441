"""rank0_loader failures: every bad input and every mid-stream failure is raised on every
rank, with the same message naming the file, tensor, parameter and shapes; nothing hangs."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.loader_faults import (
    load_unless_rank,
    load_while_a_rank_dies,
    load_with_another_plan_on,
    load_with_failing_reads,
    load_with_failing_receiver,
    load_with_stalled_read,
)
from support.loader_ranks import (
    load_and_forward,
    load_expecting_error,
    load_for_engine_counting_warnings,
    load_per_rank_settings,
    load_with_resolved_settings,
)

from megastart.harness.launch import RankFailure, RankPool
from megastart.records import LoadReport

TP2 = {"tp": 2}


@pytest.fixture(scope="module")
def original(llama: Path) -> tuple[Path, torch.Tensor]:
    from support.loader_ranks import reference_logits

    return llama, reference_logits(llama)


@pytest.fixture
def checkpoint(original: tuple[Path, torch.Tensor], tmp_path: Path) -> Path:
    """A copy of the module's checkpoint that a test may damage."""
    return Path(shutil.copytree(original[0], tmp_path / "checkpoint"))


def edit_tensors(
    directory: Path, holding: str, edit: Callable[[dict[str, torch.Tensor]], None]
) -> None:
    """Rewrite the shard that holds tensor ``holding`` after ``edit``; keep the index in step."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][holding]
    tensors = load_file(directory / shard)
    edit(tensors)
    save_file(tensors, directory / shard, metadata={"format": "pt"})
    weight_map = {n: f for n, f in index["weight_map"].items() if f != shard} | dict.fromkeys(
        tensors, shard
    )
    index_path.write_text(json.dumps({**index, "weight_map": weight_map}))


def same_on_every_rank(messages: list[str]) -> str:
    assert len(set(messages)) == 1, messages
    assert messages[0] != "loaded"
    assert messages[0].startswith("CollectiveError: rank0_loader: ")
    return messages[0]


def test_missing_directory(pool: RankPool, tmp_path: Path, original: Any) -> None:
    message = same_on_every_rank(
        pool.run(load_expecting_error, str(tmp_path / "absent"), TP2, {}, str(original[0]))
    )
    assert f"'{tmp_path / 'absent'}' does not exist" in message


def test_missing_config(pool: RankPool, checkpoint: Path, original: Any) -> None:
    (checkpoint / "config.json").unlink()
    message = same_on_every_rank(
        pool.run(load_expecting_error, str(checkpoint), TP2, {}, str(original[0]))
    )
    assert "config.json' is missing" in message


def test_config_of_a_different_model(pool: RankPool, checkpoint: Path, tmp_path: Path) -> None:
    from megastart.harness.checkpoints import make_checkpoint

    other = tmp_path / "other"
    make_checkpoint("llama", other, tie_word_embeddings=False, num_key_value_heads=8)
    message = same_on_every_rank(
        pool.run(load_expecting_error, str(checkpoint), TP2, {}, str(other))
    )
    assert "is for a different model than the one built" in message
    assert "num_key_value_heads=4 in config.json but num_query_groups=8 in Megatron" in message


def test_missing_tensor(pool: RankPool, checkpoint: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    edit_tensors(checkpoint, name, lambda t: t.pop(name))
    message = same_on_every_rank(pool.run(load_expecting_error, str(checkpoint), TP2, {}))
    assert f"['{name}'] missing from checkpoint" in message
    assert "'decoder.layers.1.mlp.linear_fc1.weight'" in message


def test_unexpected_tensor_is_an_error_when_strict_and_a_warning_otherwise(
    pool: RankPool, checkpoint: Path, original: Any
) -> None:
    extra = "model.layers.0.mlp.extra_proj.weight"
    edit_tensors(checkpoint, "model.norm.weight", lambda t: t.update({extra: torch.ones(3)}))
    message = same_on_every_rank(
        pool.run(load_expecting_error, str(checkpoint), TP2, {"strict": True})
    )
    assert f"holds 1 tensor(s) no Megatron parameter uses: '{extra}'" in message
    for _, logits in pool.run(load_and_forward, str(checkpoint), TP2, {"strict": False}):
        assert (logits - original[1]).abs().max().item() <= 1e-4


def test_shape_mismatch_names_tensor_parameter_and_shapes(pool: RankPool, checkpoint: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    edit_tensors(checkpoint, name, lambda t: t.update({name: t[name].t().contiguous()}))
    message = same_on_every_rank(pool.run(load_expecting_error, str(checkpoint), TP2, {}))
    rows, cols = load_file_shape(checkpoint, name)  # transposed: [intermediate, hidden]
    assert rows != cols, "the test needs a non-square tensor"
    assert f"HF tensor '{name}' has shape [{rows}, {cols}], expected [{cols}, {rows}]" in message
    param = "'decoder.layers.0.mlp.linear_fc2.weight'"
    assert f"Megatron parameter {param} (shape [{cols}, {rows // 2}]" in message  # TP2 shard


def load_file_shape(directory: Path, name: str) -> tuple[int, ...]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return tuple(load_file(directory / index["weight_map"][name])[name].shape)


def test_truncated_shard(pool: RankPool, checkpoint: Path) -> None:
    shard = sorted(checkpoint.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    message = same_on_every_rank(pool.run(load_expecting_error, str(checkpoint), TP2, {}))
    assert f"'{shard}' ({shard.stat().st_size} bytes) is not a valid safetensors file" in message
    assert "file not fully covered" in message and "corrupt or truncated" in message


def test_corrupt_header(pool: RankPool, checkpoint: Path) -> None:
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"garbage!"
    shard.write_bytes(bytes(data))
    message = same_on_every_rank(pool.run(load_expecting_error, str(checkpoint), TP2, {}))
    assert f"'{shard}' ({shard.stat().st_size} bytes) is not a valid safetensors file" in message
    assert "invalid JSON in header" in message


def test_index_naming_a_missing_shard(pool: RankPool, checkpoint: Path) -> None:
    shard = sorted(checkpoint.glob("*.safetensors"))[1]
    shard.unlink()
    message = same_on_every_rank(pool.run(load_expecting_error, str(checkpoint), TP2, {}))
    assert f"names shard(s) ['{shard.name}'] that do not exist" in message


@pytest.mark.parametrize("layout", [TP2, {"pp": 2}], ids=["tp2", "pp2"])
def test_reader_io_error_in_the_middle_reaches_every_rank(
    pool: RankPool, original: Any, layout: dict[str, int]
) -> None:
    """With pp2 the failing bucket is for one stage only; the other stage's rank hears it too."""
    start = time.monotonic()
    message = same_on_every_rank(pool.run(load_with_failing_reads, str(original[0]), layout, 5))
    assert time.monotonic() - start < 30
    assert "rank0_loader: streaming" in message
    assert "Input/output error" in message
    assert "reader rank 0 failed" in message or "failed on rank 0" in message


def test_unsupported_architecture_falls_through_to_the_host_with_one_warning(
    pool: RankPool, checkpoint: Path
) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(
        json.dumps({**config, "architectures": ["ToyForCausalLM"]})
    )
    assert pool.run(load_for_engine_counting_warnings, str(checkpoint)) == [(None, 1), (None, 0)]


def test_supported_architecture_is_loaded_through_the_hook(pool: RankPool, original: Any) -> None:
    results = pool.run(load_for_engine_counting_warnings, str(original[0]))
    assert all(isinstance(report, LoadReport) and warnings == 0 for report, warnings in results)


def test_a_rank_that_dies_mid_stream_makes_the_others_raise_within_timeout(original: Any) -> None:
    timeout_s = 5.0
    with RankPool(2, timeout_s=120, grace_s=3 * timeout_s) as pool:
        start = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            pool.run(load_while_a_rank_dies, str(original[0]), TP2, 1, timeout_s)
        elapsed = time.monotonic() - start
    message = str(failure.value)
    assert "ranks that died: 1 (exit code 7)" in message
    assert "--- rank 0 raised" in message
    assert "CollectiveError: rank0_loader: streaming" in message
    assert elapsed < 3 * timeout_s + 10


def test_pickle_checkpoint_loads_only_when_allowed(
    pool: RankPool, checkpoint: Path, original: Any
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for shard in checkpoint.glob("*.safetensors"):
        tensors |= load_file(shard)
        shard.unlink()
    (checkpoint / "model.safetensors.index.json").unlink()
    torch.save(tensors, checkpoint / "pytorch_model.bin")
    message = same_on_every_rank(pool.run(load_expecting_error, str(checkpoint), TP2, {}))
    assert "allow_pickle=true" in message
    for _, logits in pool.run(load_and_forward, str(checkpoint), TP2, {"allow_pickle": True}):
        assert (logits - original[1]).abs().max().item() <= 1e-4


def test_nccl_transport_needs_cuda_parameters(pool: RankPool, original: Any) -> None:
    message = same_on_every_rank(
        pool.run(load_expecting_error, str(original[0]), TP2, {"transport": "nccl"})
    )
    assert (
        "SettingsError: rank0_loader.transport=nccl needs CUDA parameters on every rank, found ['cpu']"
        in message
    )


def loads_like_the_original(pool: RankPool, checkpoint: Path, original: Any) -> None:
    for _, logits in pool.run(load_and_forward, str(checkpoint), TP2, {}):
        assert (logits - original[1]).abs().max().item() <= 1e-4


def refused_quickly(
    pool: RankPool,
    checkpoint: Path,
    overrides: dict[str, Any] | None = None,
    build_from: Path | None = None,
) -> str:
    """The one message every rank raised, within a bound far below ``timeout_s`` (60 s)."""
    start = time.monotonic()
    messages = pool.run(
        load_expecting_error, str(checkpoint), TP2, overrides or {}, str(build_from or checkpoint)
    )
    assert time.monotonic() - start < 30
    return same_on_every_rank(messages)


def move_shards_into(directory: Path, sub: str) -> list[str]:
    """Move the shards into ``directory/sub`` and name them so in the index; the new names."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    (directory / sub).mkdir()
    for shard in set(index["weight_map"].values()):
        (directory / shard).rename(directory / sub / shard)
    index["weight_map"] = {n: f"{sub}/{f}" for n, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return sorted(set(index["weight_map"].values()))


def test_index_naming_shards_in_a_subdirectory_reads_them_not_same_named_files_beside_it(
    pool: RankPool, checkpoint: Path, original: Any, tmp_path: Path
) -> None:
    """transformers joins index names to the directory; a same-named file at the top
    level (another checkpoint's weights) must not be read instead."""
    from megastart.harness.checkpoints import make_checkpoint

    move_shards_into(checkpoint, "sub")
    other = make_checkpoint("llama", tmp_path / "other", tie_word_embeddings=False, seed=1)
    for shard in other.glob("*.safetensors"):
        shutil.copy(shard, checkpoint / shard.name)
    assert sorted(p.name for p in checkpoint.glob("*.safetensors")) == sorted(
        p.name for p in (checkpoint / "sub").glob("*.safetensors")
    )
    loads_like_the_original(pool, checkpoint, original)


@pytest.mark.parametrize("escape", ["../outside", "/absolute"], ids=["dotdot", "absolute"])
def test_index_naming_a_shard_outside_the_directory_is_refused_before_any_transfer(
    pool: RankPool, checkpoint: Path, escape: str
) -> None:
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, shard = next(iter(index["weight_map"].items()))
    target = (checkpoint / shard).resolve()
    outside = f"{checkpoint.parent}/{shard}" if escape == "/absolute" else f"../{shard}"
    shutil.copy(target, checkpoint.parent / shard)  # the file exists there: still refused
    index["weight_map"][name] = outside
    index_path.write_text(json.dumps(index))
    message = refused_quickly(pool, checkpoint)
    assert "reading the metadata" in message
    assert f"names shard {outside!r}, which lies outside the checkpoint directory" in message


def test_hugging_face_cache_layout_with_symlinked_shards_loads(
    pool: RankPool, original: Any, tmp_path: Path
) -> None:
    """``snapshots/<revision>/<file>`` are symlinks into ``../../blobs``, as huggingface_hub writes."""
    cache = tmp_path / "models--test--llama"
    snapshot = cache / "snapshots" / "0123abcd"
    (cache / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(original[0].iterdir())):
        blob = cache / "blobs" / f"{number:040x}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    loads_like_the_original(pool, snapshot, original)


def rewrite_header(shard: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a safetensors header; the tensor bytes stay as they are."""
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text = text.ljust(-(-len(text) // 8) * 8)
    shard.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])


def first_two_tensors(header: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    first, second = sorted(
        (v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0]
    )[:2]
    return first, second


def share_offsets(header: dict[str, Any]) -> None:
    first, second = first_two_tensors(header)
    if first["shape"] == second["shape"]:
        second["data_offsets"] = list(first["data_offsets"])
    else:  # same byte range for a tensor of another shape: still two tensors on the same bytes
        first["data_offsets"] = [0, first["data_offsets"][1]]
        second["data_offsets"] = [0, second["data_offsets"][1] - second["data_offsets"][0]]


def shift_by_four(header: dict[str, Any]) -> None:
    first, _ = first_two_tensors(header)
    first["data_offsets"] = [first["data_offsets"][0] + 4, first["data_offsets"][1] + 4]


def negative_start(header: dict[str, Any]) -> None:
    first, _ = first_two_tensors(header)
    first["data_offsets"] = [-4, first["data_offsets"][1]]


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (share_offsets, "invalid offset for tensor"),
        (shift_by_four, "invalid offset for tensor"),
        (negative_start, "expected usize"),
    ],
    ids=["shared", "shifted", "negative"],
)
def test_corrupt_data_offsets_are_refused_as_safetensors_refuses_them(
    pool: RankPool, checkpoint: Path, corrupt: Callable[[dict[str, Any]], None], reason: str
) -> None:
    from safetensors import SafetensorError, safe_open

    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    rewrite_header(shard, corrupt)
    with pytest.raises(SafetensorError, match=reason):  # the library's own verdict
        safe_open(shard, framework="pt")
    message = refused_quickly(pool, checkpoint)
    assert f"'{shard}' ({shard.stat().st_size} bytes) is not a valid safetensors file" in message
    assert reason in message
    assert "download it again" in message


def write_config(checkpoint: Path, config: Any) -> Path:
    (checkpoint / "config.json").write_text(json.dumps(config))
    return checkpoint / "config.json"


def test_config_that_is_not_an_object_is_named_with_the_fix(
    pool: RankPool, checkpoint: Path, original: Any
) -> None:
    path = write_config(checkpoint, [json.loads((checkpoint / "config.json").read_text())])
    message = refused_quickly(pool, checkpoint, build_from=original[0])
    assert f"'{path}' holds a JSON list, not an object: write the model's config with" in message


def test_architectures_that_is_a_string_is_named_with_the_fix(
    pool: RankPool, checkpoint: Path
) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    path = write_config(checkpoint, {**config, "architectures": "LlamaForCausalLM"})
    message = refused_quickly(pool, checkpoint)
    assert f"'{path}': 'architectures' must be a list of class names" in message
    assert "got 'LlamaForCausalLM'" in message


def as_pickle_shards(checkpoint: Path, contents: list[Any]) -> list[Path]:
    """Replace the safetensors shards by ``.bin`` files holding ``contents`` (one per file)."""
    for shard in checkpoint.glob("*.safetensors"):
        shard.unlink()
    (checkpoint / "model.safetensors.index.json").unlink()
    files = [checkpoint / f"pytorch_model-{i + 1:05d}.bin" for i in range(len(contents))]
    for file, content in zip(files, contents, strict=True):
        torch.save(content, file)
    return files


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ({}, "holds an empty state dict (no tensors)"),
        ([torch.ones(2)], "holds a list, not a state dict"),
    ],
    ids=["empty", "list"],
)
def test_pickle_file_that_is_not_a_state_dict_is_named_with_the_fix(
    pool: RankPool, checkpoint: Path, content: Any, problem: str
) -> None:
    (file,) = as_pickle_shards(checkpoint, [content])
    message = refused_quickly(pool, checkpoint, {"allow_pickle": True})
    assert f"'{file}' {problem}; save the model's state dict" in message


def test_tensor_in_two_pickle_shards_is_named_with_both_files(
    pool: RankPool, checkpoint: Path
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for shard in checkpoint.glob("*.safetensors"):
        tensors |= load_file(shard)
    name = "model.norm.weight"
    first, second = as_pickle_shards(checkpoint, [tensors, {name: torch.zeros_like(tensors[name])}])
    message = refused_quickly(pool, checkpoint, {"allow_pickle": True})
    assert f"tensor {name!r} is stored twice: in {first.name!r} and in {second.name!r}" in message


def test_config_without_architectures_resolves_it_from_model_type(
    pool: RankPool, checkpoint: Path, original: Any
) -> None:
    """A config saved from a config object (no ``architectures``) loads as transformers loads it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    config.architectures = None
    config.save_pretrained(checkpoint)
    saved = json.loads((checkpoint / "config.json").read_text())
    assert not saved.get("architectures") and saved["model_type"] == "llama"
    from support.loader_ranks import reference_logits

    assert (
        reference_logits(checkpoint) - original[1]
    ).abs().max().item() == 0  # transformers loads it
    loads_like_the_original(pool, checkpoint, original)


def one_error(attempts: list[Any], bound_s: float) -> str:
    """The one error every rank raised, each within ``bound_s`` of its call."""
    assert len({(kind, message) for kind, message, _ in attempts}) == 1, attempts
    kind, message, _ = attempts[0]
    assert kind == "CollectiveError"
    assert all(seconds < bound_s for _, _, seconds in attempts), attempts
    return message


def test_ranks_with_different_settings_are_told_which_setting_and_ranks_before_any_transfer(
    pool: RankPool, original: Any
) -> None:
    """Different bucket sizes once aborted a rank inside gloo (size mismatch)."""
    attempts = pool.run(load_per_rank_settings, str(original[0]), TP2, {1: {"bucket_mb": 1.0}})
    message = one_error(attempts, 5)
    assert message.startswith(
        "rank0_loader: the ranks' settings differ: "
        "bucket_mb is 0.05 on ranks [0], 1.0 on ranks [1]; set the MEGASTART_RANK0_LOADER_*"
    )


@pytest.mark.parametrize(
    ("reader_node", "what"),
    [
        ("shared_memory", r"announced a bucket of \d+ bytes where this rank planned \d+ "),
        ("page_cache", r"planned \d+ buckets of \d+ bytes where this rank planned \d+ of \d+"),
    ],
)
def test_a_received_size_other_than_planned_is_an_error_not_an_abort(
    pool: RankPool, original: Any, reader_node: str, what: str
) -> None:
    """Rank 1 plans buckets 8 times larger: found before it copies anything, on either route."""
    results = pool.run(
        load_with_another_plan_on, str(original[0]), TP2, 1, {"reader_node": reader_node}
    )
    message = one_error(results, 5)
    assert message.startswith("rank0_loader: streaming")
    assert re.search(f"failed on rank 1: the reader \\(rank 0\\) {what}", message), message
    assert "the ranks' plans differ; nothing was" in message


def test_a_receiver_failing_mid_stream_is_named_on_every_rank_at_once_and_retries_fail_fast(
    pool: RankPool, original: Any
) -> None:
    """Every rank hears the receiver's own error within a fraction of timeout_s; a retry
    is refused at once; the host's next group works. The parameters are partly written."""
    timeout_s = 30.0
    results = pool.run(load_with_failing_receiver, str(original[0]), TP2, 1, timeout_s)
    for rank, (attempts, (written, total), group_sum) in enumerate(results):
        (kind, message, seconds), (retry_kind, retry_message, retry_seconds) = attempts
        assert kind == "CollectiveError", (rank, message)
        assert message.startswith("rank0_loader: streaming")
        assert "failed on rank 1" in message
        assert "MemoryError: out of host memory (injected)" in message
        assert seconds < 10, (rank, seconds)
        assert retry_kind == "FailedBefore"
        assert retry_message.startswith(
            "rank0_loader: not run: rank0_loader already failed in this process (rank0_loader: "
            "streaming"
        )
        assert "Restart the process" in retry_message
        assert retry_seconds < 0.5
        assert group_sum == 2.0
        # What docs/loader.md says is left behind: the failing rank's parameters partly written;
        # a rank that never waits for it (the reader, from the page cache) may finish its own.
        assert 0 < written < total if rank == 1 else 0 < written <= total, (rank, written, total)


def test_a_rank_that_never_calls_the_loader_is_named_and_the_host_groups_keep_working(
    original: Any,
) -> None:
    timeout_s = 5.0
    with RankPool(2, timeout_s=120) as pool:
        (present, present_group), (absent, absent_group) = pool.run(
            load_unless_rank, str(original[0]), TP2, 1, timeout_s
        )
    named = (
        f"rank0_loader: rank(s) [1] did not start it within timeout_s={timeout_s:g} s (died, "
        "hung, or never called it); no process group was made"
    )
    (kind, message, seconds), (retry_kind, retry_message, retry_seconds) = present
    assert (kind, message) == ("CollectiveError", named)
    assert timeout_s <= seconds < timeout_s + 3
    assert retry_kind == "FailedBefore" and named in retry_message and retry_seconds < 0.5
    ((late_kind, late_message, late_seconds),) = absent
    assert (late_kind, late_message) == ("CollectiveError", named)  # the latecomer, at once
    assert late_seconds < 0.5
    assert present_group == absent_group == 2.0


def test_a_stalled_read_is_named_on_every_rank_within_timeout(
    pool: RankPool, original: Any
) -> None:
    timeout_s = 5.0
    results = pool.run(load_with_stalled_read, str(original[0]), TP2, 5, timeout_s)
    for kind, message, seconds in results:
        assert kind == "CollectiveError"
        assert message.startswith("rank0_loader: streaming")
        assert (
            f"failed on rank 0: rank 0 waited timeout_s={timeout_s:g} s for the reader's read "
            "of tensor '" in message
        )
        assert "(the storage did not answer)" in message
        assert timeout_s <= seconds < timeout_s + 3


def test_a_settings_error_on_one_rank_reaches_every_rank_at_once(original: Any) -> None:
    bad = {"MEGASTART_RANK0_LOADER_BUCKET_MB": "nan"}
    with RankPool(2, timeout_s=120, env=lambda rank: bad if rank == 1 else {}) as pool:
        (kind, message, seconds), (own_kind, own_message, _) = pool.run(
            load_with_resolved_settings, str(original[0]), TP2
        )
    why = "MEGASTART_RANK0_LOADER_BUCKET_MB='nan': expected a finite number, got 'nan'"
    assert (own_kind, own_message) == ("SettingsError", why)
    assert kind == "PeerFailed"
    assert message.startswith(f"rank0_loader failed on rank 1: SettingsError: {why} [")
    assert seconds < 5
