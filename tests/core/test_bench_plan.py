"""``megastart bench plan`` plans real models' checkpoints from synthetic metadata: the
names and shapes it makes are the ones ``transformers`` writes and the parameters the one
Megatron builds, checked here on small configs of the same families."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.loader_ranks import parameter_shapes

from megastart.bench.synthetic import Layout, hf_tensors, rank_parameters
from megastart.cli import main
from megastart.distributed import POLL_S
from megastart.distributed.polling import LONG_POLL_S
from megastart.harness.launch import RankPool
from megastart.loader.checkpoint import read_metadata

SMALL = {"deepseek_v3": {"num_nextn_predict_layers": 0}, "qwen3_moe": {}}
"""transformers writes no MTP layer, so the small DeepSeek-V3 has none."""


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from megastart.harness.checkpoints import make_checkpoint

    def make(arch: str) -> tuple[str, dict[str, Any]]:
        directory = make_checkpoint(arch, tmp_path_factory.mktemp(arch), **SMALL[arch])
        meta = read_metadata(directory, allow_pickle=False)
        return str(directory), meta.config

    return make


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_synthetic_tensors_are_the_ones_transformers_writes(small: Any, arch: str) -> None:
    directory, config = small(arch)
    tensors = read_metadata(directory, allow_pickle=False).tensors
    written = {name: entry.shape for name, entry in tensors.items()}
    made = {name: shape for name, shape, _ in hf_tensors(config)}
    assert made == written


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_synthetic_parameters_are_the_ones_megatron_builds(
    rank_pools: dict[int, RankPool], small: Any, arch: str
) -> None:
    directory, config = small(arch)
    (built,) = rank_pools[1].run(parameter_shapes, directory, {})
    made = {p.name: p.shape for p in rank_parameters(config, Layout(1, 1, 1))}
    assert made == built


def test_bench_plan_world_reports_each_role(tmp_path: Path) -> None:
    """A world of 64 ranks on nodes of 8, planned in this process: every role's figures."""
    out = tmp_path / "world.json"
    arguments = ["bench", "plan", "--model=qwen3-235b-a22b", "--world=64", "--tp=4", "--pp=2"]
    assert main([*arguments, "--ep=8", "--repeats=1", f"--json={out}"]) == 0
    results = json.loads(out.read_text())
    assert results["world"] == 64 and results["demands_mb"] > 0
    assert list(results["roles"]) == ["reader", "leader", "member"]
    assert [r["rank"] for r in results["roles"].values()] == [0, 8, 9]
    for figures in results["roles"].values():
        assert figures["plan_s"] > 0 and figures["plan_mb"] > 0
        assert 0 < figures["received_mb"] < results["demands_mb"]  # never the world's reports
    # per load, made by the leaders alone: the group of the 8 leaders and the sets of leaders
    # the buckets reach that hold it (the reader is in every one); a member is in none
    between = [r["between_leaders"] for r in results["roles"].values()]
    assert between[0] > between[1] >= 1 and between[2] == 0
    # and their node's own two, made by its ranks alone (none on the reader's node, which
    # takes its slices out of the page cache)
    assert [r["groups"] - r["between_leaders"] for r in results["roles"].values()] == [0, 2, 2]
    # the control plane: each node's group, and one of the 8 leaders (rank 0 and 8 are in it)
    assert [r["control_groups"] for r in results["roles"].values()] == [2, 2, 1]
    assert results["control"]["groups"] == 8 + 1 and results["control"]["largest"] == 8
    # 8 leaders look at the store every POLL_S while they wait (the store is idle with so few),
    # every LONG_POLL_S once settled, and every PROGRESS_LOOK_S at the readers' progress; the
    # other 56 ranks look at their node's page
    leader = results["roles"]["leader"]["store_rps"]
    assert leader["first"] >= 1 / POLL_S - 2 and leader["settled"] <= 1 / LONG_POLL_S + 1, leader
    assert results["roles"]["member"]["store_rps"] == {"first": 0, "settled": 0}
    assert results["store_rps_world"]["settled"] == pytest.approx(8 * leader["settled"])
