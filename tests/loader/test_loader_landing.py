"""Cut on the device (``rank0_loader.cuda_copy=preads``, :mod:`megastart.loader.stream.landing`),
here on CPU tensors: each rank's ranges of a bucket land whole in a buffer of a bucket and the
transforms cut them there, bit for bit as today's copies for every kind of transform (column-
and row-parallel, QKV and gate/up interleaving, experts, vocabulary, dtype conversion, FP8
dequantisation), on both of the reader node's routes; the ranges are read by ``pread`` into the
rank's chunks, bit-exact with part of the checkpoint dropped from the page cache; and a rank's
read error reaches every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.loader_ranks import build, megatron, settings
from support.quantise import fp8_and_reference
from test_loader_page_cache import drop, load_with_a_failing_pread, resident_fraction

from megastart.harness.launch import RankPool
from megastart.loader.stream import landing, preads

PREADS = {"cuda_copy": "preads"}
TINY = {"bucket_mb": 0.01}
"""10 KiB buckets: the larger tensors travel as row blocks, each its own slot."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from megastart.harness.checkpoints import make_checkpoint

    out = tmp_path_factory.mktemp("landing")
    made = {
        "llama": make_checkpoint("llama", out / "llama", dtype="bfloat16"),
        "qwen3_moe": make_checkpoint("qwen3_moe", out / "qwen3_moe", dtype="bfloat16"),
    }
    fp8, _ = fp8_and_reference(made["llama"], out / "fp8", (24, 40))
    return {**{name: str(path) for name, path in made.items()}, "fp8": fp8}


def load(
    checkpoint: str, layout: dict[str, int], overrides: dict[str, Any], params_dtype: str = ""
) -> tuple[dict[str, torch.Tensor], int, int]:
    """This rank's parameters (built in ``params_dtype``, else the checkpoint's), the bytes it
    read by ``pread`` and the bytes that landed in its device buffer."""
    from megastart import load_hf_checkpoint

    read, landed = [0], [0]
    original_read, original_close = preads.Descriptors.read, landing.Landing.close

    def counted(self: preads.Descriptors, file: str, offset: int, target: torch.Tensor) -> None:
        original_read(self, file, offset, target)
        read[0] += target.numel()

    def closed(self: landing.Landing) -> None:
        landed[0] += self.crossed_bytes
        original_close(self)

    preads.Descriptors.read = counted  # type: ignore[method-assign]
    landing.Landing.close = closed  # type: ignore[method-assign]
    dtype = {"params_dtype": getattr(torch, params_dtype)} if params_dtype else {}
    try:
        with megatron(layout):
            chunks = build(checkpoint, context_parallel_size=1, **dtype)
            load_hf_checkpoint(chunks, checkpoint, settings=settings(**overrides))
            loaded = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    finally:
        preads.Descriptors.read = original_read  # type: ignore[method-assign]
        landing.Landing.close = original_close  # type: ignore[method-assign]
    return loaded, read[0], landed[0]


SHM = "shared_memory"
CASES = [
    pytest.param("llama", {"tp": 2}, {}, "", "page_cache", id="llama-tp2"),
    pytest.param("llama", {"tp": 2}, {}, "", SHM, id="llama-tp2-shm"),
    pytest.param("llama", {"tp": 2}, TINY, "", "page_cache", id="llama-tp2-row_blocks"),
    pytest.param("llama", {"tp": 2}, {}, "float32", "page_cache", id="llama-tp2-bf16_into_fp32"),
    pytest.param("qwen3_moe", {"ep": 2}, TINY, "", "page_cache", id="qwen3_moe-ep2-row_blocks"),
    pytest.param("qwen3_moe", {"ep": 2}, TINY, "", SHM, id="qwen3_moe-ep2-row_blocks-shm"),
    pytest.param(
        "qwen3_moe", {"tp": 2, "ep": 2, "etp": 1}, {}, "", "page_cache", id="qwen3_moe-tp2_ep2"
    ),
    pytest.param("fp8", {"tp": 2}, TINY, "", "page_cache", id="fp8-tp2-row_blocks"),
    pytest.param("fp8", {"tp": 2}, TINY, "", SHM, id="fp8-tp2-row_blocks-shm"),
]


@pytest.mark.parametrize(("model", "layout", "overrides", "params_dtype", "route"), CASES)
def test_slices_cut_on_the_device_equal_todays_copies(
    rank_pools: dict[int, RankPool],
    checkpoints: dict[str, str],
    model: str,
    layout: dict[str, int],
    overrides: dict[str, Any],
    params_dtype: str,
    route: str,
) -> None:
    run = rank_pools[2].run
    base = {**overrides, "reader_node": route}
    today = run(load, checkpoints[model], layout, base, params_dtype)
    cut = run(load, checkpoints[model], layout, {**base, **PREADS}, params_dtype)
    for rank, ((want, _, none), (got, read, landed)) in enumerate(zip(today, cut, strict=True)):
        assert none == 0 and landed > 0, (rank, none, landed)
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), (rank, name)
        if params_dtype:
            assert any(value.dtype == torch.float32 for value in got.values())
        if route == "page_cache":  # every byte that landed was read by pread, none through a fault
            assert read == landed, (rank, read, landed)


def test_a_checkpoint_partly_in_the_page_cache_lands_bit_exact_by_pread(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, str]
) -> None:
    directory = Path(checkpoints["llama"])
    run = rank_pools[2].run
    warm = run(load, str(directory), {"tp": 2}, {})
    files = sorted(directory.glob("*.safetensors"))
    drop(files[::2])
    if resident_fraction(files[0]) > 0.5:
        pytest.skip(f"this file system keeps {files[0]} cached (POSIX_FADV_DONTNEED ignored)")
    partly = run(load, str(directory), {"tp": 2}, PREADS)
    for (want, _, _), (got, read, landed) in zip(warm, partly, strict=True):
        assert read == landed > 0
        for name, value in want.items():
            assert torch.equal(got[name], value), name


@pytest.mark.parametrize("failing", [0, 1])
def test_a_read_error_into_a_ranks_chunks_reaches_every_rank_naming_the_file(
    rank_pools: dict[int, RankPool], checkpoints: dict[str, str], failing: int
) -> None:
    messages = rank_pools[2].run(load_with_a_failing_pread, checkpoints["llama"], failing, PREADS)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("CollectiveError: rank0_loader: streaming")
    assert f"on rank {failing}: OSError: reading" in messages[0]
    assert checkpoints["llama"] in messages[0] and "Input/output error" in messages[0]
