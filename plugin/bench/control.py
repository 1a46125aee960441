"""``megastart bench control``: the control plane the phases report over, as a tree of small
gloo groups (megastart's, :mod:`megastart.distributed.control`) against one gloo group over
the whole world (what megastart used before, and what ``all_gather_object`` over a new group
gives), on real ranks of this machine.

For each world size of ``--ranks``, one pool of processes on simulated nodes of
``--ranks-per-node`` (through ``LOCAL_RANK``) makes both, timed between barriers (the slowest
rank's time), then gathers every rank's report of ``--report-kb`` on every rank over each,
``--repeats`` times (the mean). Both gathers must hand every rank the same list.

On this machine the ranks share its cores: the figures say how each grows with the world,
not what a cluster would take. What a gloo group costs the store at 8,192 ranks is counted
by ``megastart bench plan --world``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "the control plane: a tree of small gloo groups against one gloo group over the world"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks",
        default="16,32",
        help="world sizes, comma-separated, each a pool of processes (default: 16,32)",
    )
    parser.add_argument("--ranks-per-node", type=int, default=4, help="simulated (default: 4)")
    parser.add_argument(
        "--fanout",
        type=int,
        default=4,
        help="the most node leaders in one group of the tree (megastart's default: 32; "
        "smaller here, so a small world has several levels) (default: 4)",
    )
    parser.add_argument("--report-kb", type=float, default=10.0, help="each rank's report")
    parser.add_argument("--repeats", type=int, default=5, help="gathers per world (default: 5)")
    parser.add_argument("--json", help="write the figures here")


def run(args: argparse.Namespace) -> int:
    from megastart.harness.launch import RankPool

    results: dict[str, Any] = {
        "ranks_per_node": args.ranks_per_node,
        "fanout": args.fanout,
        "report_kb": args.report_kb,
        "worlds": [],
    }
    for world in (int(n) for n in args.ranks.split(",")):
        with RankPool(world, timeout_s=600) as pool:
            figures = pool.run(
                measure,
                args.ranks_per_node,
                args.fanout,
                int(args.report_kb * 1000),
                args.repeats,
            )
        slowest = {key: max(f[key] for f in figures) for key in figures[0] if key != "same"}
        results["worlds"].append(
            {"ranks": world, **slowest, "same": all(f["same"] for f in figures)}
        )
    print(render(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


def measure(ranks_per_node: int, fanout: int, report_bytes: int, repeats: int) -> dict[str, Any]:
    """On every rank: make each control plane and gather over it; this rank's seconds."""
    import os
    import time

    import torch.distributed as dist

    from megastart.distributed import destroy_group, make_control, new_group

    os.environ["LOCAL_RANK"] = str(dist.get_rank() % ranks_per_node)
    report = {"rank": dist.get_rank(), "report": os.urandom(report_bytes)}
    timeout_s = 300.0

    def timed(work: Any) -> tuple[float, Any]:
        dist.barrier()
        started = time.perf_counter()
        done = work()
        return time.perf_counter() - started, done

    def world_gather(group: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, report, group=group)
        return gathered

    def made_world() -> Any:
        group = new_group(None, backend="gloo", timeout_s=timeout_s)
        dist.barrier(group=group)  # gloo connects its pairs here
        return group

    world_make_s, group = timed(made_world)
    world_s, by_world = timed(lambda: [world_gather(group) for _ in range(repeats)])
    tree_make_s, control = timed(lambda: make_control(timeout_s, fanout=fanout))
    tree_s, by_tree = timed(
        lambda: [control.gather(report, timeout_s=timeout_s) for _ in range(repeats)]
    )
    destroy_group(group)
    return {
        "world_make_s": world_make_s,
        "world_gather_s": world_s / repeats,
        "tree_make_s": tree_make_s,
        "tree_gather_s": tree_s / repeats,
        "tree_groups": len(control.groups),
        "same": by_world == by_tree,
    }


def render(results: dict[str, Any]) -> str:
    lines = [
        f"megastart bench control: nodes of {results['ranks_per_node']} ranks (simulated), tree "
        f"groups of at most {results['fanout']} leaders, reports of {results['report_kb']:g} kB",
        f"  {'ranks':>5}  {'make: world':>11} {'tree':>7} {'x world':>7}  "
        f"{'gather: world':>13} {'tree':>7} {'x world':>7}  same",
    ]
    for w in results["worlds"]:
        lines.append(
            f"  {w['ranks']:>5}  {w['world_make_s']:>10.3f}s {w['tree_make_s']:>6.3f}s "
            f"{w['tree_make_s'] / w['world_make_s']:>7.2f}  {w['world_gather_s']:>12.4f}s "
            f"{w['tree_gather_s']:>6.4f}s {w['tree_gather_s'] / w['world_gather_s']:>7.2f}  "
            f"{'yes' if w['same'] else 'NO'}"
        )
    lines.append(
        "  (make: a gloo group over every rank, connected, against megastart's tree; gather: "
        "every rank's report on every rank, the mean of --repeats; the slowest rank's seconds, "
        "between barriers; the ranks share this machine's cores)"
    )
    return "\n".join(lines)
