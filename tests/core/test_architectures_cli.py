"""``megastart architectures`` says which architectures rank0_loader loads, and, given a
checkpoint, what would happen to it (the Megatron-Bridge half runs in tests/bridge)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.pyrun import run_python
from support.quantise import quantise_fp8

CLI = "import sys; from megastart.cli import main; sys.exit(main({argv!r}))"


def architectures(*argv: str) -> str:
    return run_python(CLI.format(argv=["architectures", *argv])).stdout


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megastart.harness.checkpoints import make_checkpoint

    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek"), dtype="bfloat16")


def test_lists_the_built_in_tables_and_says_when_megatron_bridge_is_missing() -> None:
    out = json.loads(architectures("--json"))
    assert {"DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Qwen3MoeForCausalLM"} <= set(
        out["built_in"]
    )
    assert out["megatron_bridge"] == {"installed": False}
    text = architectures()
    assert (
        "Megatron-Bridge (where megastart replaces its load_hf_weights):\n  not installed here"
        in text
    )
    assert "decided when the model is built" in text


def test_predicts_a_checkpoint_plain_fp8_and_unknown(deepseek: Path, tmp_path: Path) -> None:
    plain = json.loads(architectures(str(deepseek), "--json"))["checkpoint"]
    assert plain["built_in"] == "the DeepseekV3ForCausalLM table"
    assert plain["quantisation"] == "none"
    assert architectures(str(deepseek)).splitlines()[-1] == "verdict: loaded by megastart"

    fp8 = Path(shutil.copytree(deepseek, tmp_path / "fp8"))
    quantise_fp8(fp8)
    text = architectures(str(fp8))
    assert (
        "quantisation:   fp8 (config.json has quantization_config (blocks of 128x128)): "
        "dequantised by megastart" in text
    )

    unknown = Path(shutil.copytree(deepseek, tmp_path / "unknown"))
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"] = ["Qwen3NextForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(config))
    text = architectures(str(unknown))
    assert "built-in table: none: left to the host" in text
    assert text.splitlines()[-1] == (
        "verdict: left to the host: no built-in table for Qwen3NextForCausalLM"
    )


def test_predicts_an_mxfp4_release_dequantised_where_its_bridge_loads_it(tmp_path: Path) -> None:
    from support.quantise import quantise_mxfp4
    from transformers import GptOssConfig

    from megastart.harness.checkpoints import SMALL_SIZE, make_checkpoint

    config = GptOssConfig(
        **{**SMALL_SIZE, "intermediate_size": 64, "num_local_experts": 4},
        head_dim=8,
        architectures=["GptOssForCausalLM"],
        dtype="bfloat16",
    )
    directory = make_checkpoint(config, tmp_path / "gpt_oss")
    quantise_mxfp4(directory)
    assert (
        "quantisation:   mxfp4 (config.json has quantization_config (mxfp4)): dequantised by "
        "megastart where the host's Megatron-Bridge is GPTOSSBridge"
        in architectures(str(directory))
    )
    assert architectures(str(directory)).splitlines()[-1].startswith("verdict: left to the host")
