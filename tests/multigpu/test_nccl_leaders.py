"""NCCL between node leaders on real GPUs (the ``multigpu`` marker: skipped without two GPUs,
never in CI): each GPU a simulated node (``--ranks-per-node 1``), so every bucket that crosses
between nodes goes over the loader's NCCL groups, made by the leaders alone.

Run on a machine with two or more GPUs, from the project's root:
``pytest tests/multigpu -m multigpu -v`` (see CONTRIBUTING.md).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from support.nccl_ranks import nccl_group_between_two_ranks

from megastart.cli import main
from megastart.harness.launch import RankPool

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def test_an_nccl_group_made_by_its_ranks_alone_broadcasts_and_registers_nothing() -> None:
    with RankPool(2, timeout_s=300) as pool:
        results = pool.run(nccl_group_between_two_ranks, 1 << 20)
    for result in results:
        assert result["received"]
        assert result["groups_after"] == result["groups_before"]


@pytest.mark.parametrize(
    "model",
    [["--arch=qwen2", "--pp=2"], ["--arch=qwen3_moe", "--pp=1", "--ep=2"]],
    ids=["dense_pp2", "moe_ep2"],
)
def test_nccl_between_leaders_loads_bit_exact_global_and_striped(
    tmp_path: Path, model: list[str]
) -> None:
    """``megastart bench loader --device cuda --transport nccl --ranks-per-node 1`` on two
    GPUs: both readers load mmap_slices' weights bit for bit, and the NCCL limit is measured."""
    capture = tmp_path / "stdout.txt"
    with capture.open("w") as stdout, contextlib.redirect_stdout(stdout):
        code = main(
            [
                "bench",
                "loader",
                "--ranks=2",
                "--tp=1",
                *model,
                "--device=cuda",
                "--transport=nccl",
                "--ranks-per-node=1",
                "--readers=global,striped",
                "--strategies=megastart,mmap_slices",
                "--size-gb=0.05",
                "--page-cache=warm",
                f"--workdir={tmp_path}",
                f"--json={tmp_path / 'bench.json'}",
            ]
        )
    table = capture.read_text()
    assert code == 0, table
    results = json.loads((tmp_path / "bench.json").read_text())
    rows = results["strategies"]
    assert rows["megastart[global]"]["checksums"] == rows["megastart[striped]"]["checksums"]
    assert rows["mmap_slices"]["weights_match_megastart"]
    assert results["megastart_settings"]["transport"] == "nccl"
    assert results["limits"]["nccl_broadcast_gbps"] > 0
    assert "limit, NCCL between the 2 node leaders" in table
