"""``cuda_copy=registered`` registers only the page-cache blocks of slices a copy takes
straight (contiguous, in the parameter's dtype): a row-parallel slice's strided columns and a
converted tensor go through the staging ring, and registering their blocks would pin pages
no copy reads. The choice is made on CPU (the registration itself needs CUDA: the GPU suite
runs it), over gloo, with real safetensors files and real Megatron-core models, and checked
against the pieces the stream cuts out of real views of the files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megastart.harness.launch import RankPool


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megastart.harness.checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("llama"))


ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
"""At TP > 1, each rank takes columns of these: strided, never copied straight."""


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_registration_chooses_the_slots_copied_straight_and_only_those(
    rank_pools: dict[int, RankPool], llama: Path, layout: dict[str, int]
) -> None:
    from support.registration_ranks import straight_slots

    for rank, out in enumerate(rank_pools[2].run(straight_slots, str(llama), layout)):
        assert out["chosen"] == out["copied_straight"], f"rank {rank}"
        left = sorted(set(out["mine"]) - set(out["chosen"]))
        if "tp" in layout:
            assert left and all(name.endswith(ROW_PARALLEL) for name in left), left
            assert any(name.endswith("q_proj.weight") for name in out["chosen"])
        else:  # whole tensors, as stored: every one straight
            assert left == [], f"rank {rank}: {left}"
        assert out["blocks"] > 0


def test_a_checkpoint_in_another_dtype_registers_nothing(
    rank_pools: dict[int, RankPool], tmp_path: Any
) -> None:
    """A bfloat16 checkpoint into float32 parameters: every piece is converted on the way."""
    from support.registration_ranks import straight_slots

    from megastart.harness.checkpoints import make_checkpoint

    bf16 = make_checkpoint("llama", tmp_path, dtype="bfloat16")
    for rank, out in enumerate(rank_pools[2].run(straight_slots, str(bf16), {"tp": 2})):
        assert out["mine"], f"rank {rank}"
        assert out["chosen"] == out["copied_straight"] == [], f"rank {rank}"
        assert out["blocks"] == 0, f"rank {rank}"


def test_a_quantised_weight_and_its_scales_are_never_registered(
    rank_pools: dict[int, RankPool], tmp_path: Any
) -> None:
    """FP8 blocks are dequantised on the way (with their scales, kept on the host)."""
    from support.quantise import quantise_fp8
    from support.registration_ranks import straight_slots

    from megastart.harness.checkpoints import make_checkpoint

    fp8 = make_checkpoint("deepseek_v3", tmp_path)
    quantise_fp8(fp8)
    for rank, out in enumerate(rank_pools[2].run(straight_slots, str(fp8), {"tp": 2})):
        assert out["chosen"] == out["copied_straight"], f"rank {rank}"
        quantised = [n for n in out["mine"] if n.endswith(("_proj.weight", "_scale_inv"))]
        assert quantised and not set(quantised) & set(out["chosen"]), f"rank {rank}"
        assert any(n.endswith("norm.weight") for n in out["chosen"]), f"rank {rank}"
