"""``megastart demo``: a real run at a small size, and the errors raised before any rank starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 of 4 layers, 8 heads in 4 KV groups, FFN 128, fp32 (sharded, with an index)."""
    from megastart.harness.checkpoints import make_checkpoint

    return make_checkpoint("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


def megastart_demo(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The ``megastart demo`` command in a fresh interpreter (plugin state is per process)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEGASTART_")}
    return subprocess.run(
        [sys.executable, "-m", "megastart.cli", "demo", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )


def with_config(checkpoint: Path, directory: Path, config: dict) -> Path:
    """A copy of ``checkpoint`` (weights and all) with ``config`` as its config.json."""
    copy = Path(shutil.copytree(checkpoint, directory / "checkpoint", dirs_exist_ok=True))
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def tensor_bytes(checkpoint: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in checkpoint.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            total += sum(f.get_tensor(name).nbytes for name in f.keys())
    return total


def test_demo_table_png_and_json_exist_and_agree(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = megastart_demo("--checkpoint", str(tiny_checkpoint), "--out", str(out))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    results = json.loads((out / "megastart-demo.json").read_text())
    png = out / "megastart-demo.png"
    assert results["png"] == str(png)
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert height > 300 and width > 600

    # The printed table is the JSON's, and its figures are the JSON's figures.
    assert results["table"] in proc.stdout
    rows = {
        m["loader"]: m
        for m in re.finditer(
            r"^\| (?P<loader>\S+) \| (?P<wall>[\d.]+) \| (?P<peak>\d+) \| (?P<added>\d+) "
            r"\| (?P<rank_peaks>-?\d+) \| (?P<read>\d+) \|$",
            proc.stdout,
            re.MULTILINE,
        )
    }
    assert set(rows) == {"megastart", "every_rank_full"}
    for loader, row in rows.items():
        figures = results["loaders"][loader]
        assert float(row["wall"]) == pytest.approx(figures["seconds"], abs=0.005)
        assert int(row["peak"]) == round(figures["node_peak_bytes"] / 1e6)
        assert int(row["added"]) == round(figures["added_bytes"] / 1e6)
        assert int(row["rank_peaks"]) == round(figures["rank_peaks_added_bytes"] / 1e6)
        assert int(row["read"]) == round(figures["bytes_read"] / 1e6)

    # megastart read the checkpoint once; every one of the 4 ranks read it all in the baseline.
    checkpoint_bytes = tensor_bytes(tiny_checkpoint)
    assert results["loaders"]["megastart"]["bytes_read"] == checkpoint_bytes
    assert results["loaders"]["every_rank_full"]["bytes_read"] == 4 * checkpoint_bytes

    # The peaks are the maxima of the plotted samples from the one before each load's step
    # to its end, so no load "adds" less than nothing (the table's column has no minus).
    memory = dict(zip(results["memory"]["seconds"], results["memory"]["bytes"], strict=True))
    for loader, step_name in (("megastart", "on_model_load"), ("every_rank_full", "load")):
        step = next(s for s in results["steps"] if (s["run"], s["name"]) == (loader, step_name))
        before = [b for t, b in memory.items() if t <= step["start_s"]][-1]
        inside = [b for t, b in memory.items() if step["start_s"] <= t <= step["end_s"]]
        assert results["loaders"][loader]["node_before_bytes"] == before
        assert results["loaders"][loader]["node_peak_bytes"] == max([before, *inside])

    ours = results["megastart"]
    assert ours["load"]["plugin"] == "rank0_loader"
    assert ours["logits"]["match"] and ours["logits"]["max_abs_diff"] <= 1e-3
    assert ours["restored_logits_equal"]
    # The restart's HF load waited for the resume, which restored every parameter: not read.
    restart = ours["restart"]
    assert restart["hf_load"] == "skipped" and restart["parameters_restored"] > 0
    assert restart["bytes_not_read"] == sum(
        f.stat().st_size for f in tiny_checkpoint.glob("*.safetensors")
    )
    assert f"HF load skipped: the resume restored all {restart['parameters_restored']}" in (
        proc.stderr
    )
    assert ours["warmup"]["hook"] == "post_recover_load"
    # Once per process: pre_first_step found the communicators warm.
    assert "comm_warmup" in ours["hooks"]["pre_first_step"]["plugins"]
    assert ours["hooks"]["pre_first_step"]["warmup"] is None
    step = ours["train_step"]
    assert step["schedule"] == "forward_backward_pipelining_without_interleaving"
    assert step["all_ranks_updated"] and step["params_changed"] == step["params"]


def test_demo_without_its_extras_says_in_one_line_what_to_install(tmp_path: Path) -> None:
    """After the README's plain ``pip install -e .``: no traceback, one line naming the extra."""
    blocked = "import sys; sys.modules['transformers'] = None; from megastart.cli import main; "
    proc = subprocess.run(
        [sys.executable, "-c", blocked + f"sys.exit(main(['demo', '--out', {str(tmp_path)!r}]))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "megastart demo: needs transformers, not installed here: pip install 'megastart[demo]' "
        "(from a clone: pip install -e '.[demo]')"
    ]
    assert not (tmp_path / "megastart-demo.json").exists()


def test_layout_that_does_not_divide_the_model_fails_before_any_rank_starts(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    start = time.monotonic()
    proc = megastart_demo("--checkpoint", str(tiny_checkpoint), "--tp", "3", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "--tp 3 does not divide num_attention_heads=8" in proc.stderr
    assert "num_key_value_heads=4" in proc.stderr and "Valid --tp: [1, 2, 4]" in proc.stderr
    assert "starting" not in proc.stderr and time.monotonic() - start < 60
    assert not (tmp_path / "megastart-demo.json").exists()

    proc = megastart_demo("--checkpoint", str(tiny_checkpoint), "--ranks", "6")
    assert proc.returncode == 2
    assert "--ranks 6 is not a multiple of --tp 2 x --pp 2 = 4" in proc.stderr

    proc = megastart_demo("--checkpoint", str(tiny_checkpoint), "--pp", "3", "--ranks", "6")
    assert proc.returncode == 2
    assert "--pp 3 does not divide num_hidden_layers=4" in proc.stderr
    assert "valid --pp: [1, 2, 4]" in proc.stderr


def test_architecture_without_a_mapping_fails_before_any_rank_starts(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["architectures"] = ["Qwen2ForQuestionAnswering"]
    proc = megastart_demo("--checkpoint", str(with_config(tiny_checkpoint, tmp_path, config)))
    assert proc.returncode == 2
    assert "['Qwen2ForQuestionAnswering']" in proc.stderr
    assert "no mapping" in proc.stderr and "Qwen2ForCausalLM" in proc.stderr
    assert "megastart.mappings" in proc.stderr

    gpt2 = with_config(tiny_checkpoint, tmp_path, config | {"model_type": "gpt2"})
    proc = megastart_demo("--checkpoint", str(gpt2))
    assert proc.returncode == 2 and "model_type='gpt2'" in proc.stderr


def test_reward_model_checkpoint_is_refused_before_any_rank_starts(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["architectures"] = ["Qwen2ForTokenClassification"]
    proc = megastart_demo("--checkpoint", str(with_config(tiny_checkpoint, tmp_path, config)))
    assert proc.returncode == 2
    assert "a reward model's checkpoint" in proc.stderr and "causal LM" in proc.stderr


def test_a_checkpoint_megastart_cannot_load_is_named_by_megastart_before_anything_reads_it(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = megastart_demo("--checkpoint", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(
        f"megastart demo: checkpoint directory '{tmp_path}' holds no *.safetensors"
    )

    del config["num_attention_heads"]
    proc = megastart_demo("--checkpoint", str(with_config(tiny_checkpoint, tmp_path, config)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "config.json lacks num_attention_heads" in proc.stderr


def test_blocked_loader_is_refused_because_the_demo_has_no_loader_of_its_own(
    tiny_checkpoint: Path,
) -> None:
    proc = megastart_demo(
        "--checkpoint", str(tiny_checkpoint), env={"MEGASTART_BLOCKLIST": "rank0_loader"}
    )
    assert proc.returncode == 2
    assert "rank0_loader plugin is blocked" in proc.stderr


def test_blocked_warmup_is_not_run_and_the_demo_says_so(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    proc = megastart_demo(
        "--checkpoint", str(tiny_checkpoint), "--ranks", "2", "--tp", "2", "--pp", "1",
        "--out", str(tmp_path), "--no-plot",
        env={
            "MEGASTART_BLOCKLIST": "comm_warmup",
            "MEGASTART_RANK0_LOADER_BUCKET_MB": "1",
            "MEGASTART_RANK0_LOADER_SKIP_HF_LOAD_ON_RESUME": "0",
        },
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    results = json.loads((tmp_path / "megastart-demo.json").read_text())
    # With the skip off, the restart loads the HF checkpoint, then the resume over it.
    assert results["megastart"]["restart"]["hf_load"] == "loaded"
    assert "HF load run before the resume (rank0_loader.skip_hf_load_on_resume is off)" in (
        proc.stderr
    )
    assert not (tmp_path / "megastart-demo.png").exists() and "png" not in results
    ours = results["megastart"]
    assert ours["warmup"] is None
    assert all("comm_warmup" not in ran["plugins"] for ran in ours["hooks"].values())
    assert "warmup: did not run (comm_warmup blocked" in proc.stdout
    # The user's loader setting wins over the demo's default, and the JSON says where it came from.
    assert results["set_by_demo"] == {}
    assert results["settings"]["rank0_loader"]["bucket_mb"] == {
        "value": 1.0,
        "source": "env:MEGASTART_RANK0_LOADER_BUCKET_MB",
    }
    assert results["settings"]["blocklist"]["value"] == ["comm_warmup"]
    assert ours["logits"]["match"] and ours["train_step"]["all_ranks_updated"]
