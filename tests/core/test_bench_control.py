"""``megastart bench control``: both control planes hand every rank the same reports, and the
figures of each world are there."""

from __future__ import annotations

import json
from pathlib import Path

from megastart.cli import main


def test_bench_control_gathers_the_same_over_the_tree_and_over_the_world(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    arguments = ["bench", "control", "--ranks=4", "--ranks-per-node=2", "--fanout=2"]
    assert main([*arguments, "--repeats=2", f"--json={out}"]) == 0
    (world,) = json.loads(out.read_text())["worlds"]
    assert world["ranks"] == 4 and world["same"]
    assert world["tree_groups"] == 2  # rank 0: its node's group and the two leaders'
    for key in ("world_make_s", "world_gather_s", "tree_make_s", "tree_gather_s"):
        assert world[key] > 0, key
