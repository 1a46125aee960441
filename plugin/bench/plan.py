"""``megastart bench plan``: one rank's planning of a real model's checkpoint, in one process.

The checkpoint's metadata is synthetic but complete (every tensor's name, shape and dtype
as the hub's files hold them: DeepSeek-V3 with its FP8 scales is 91,991 tensors), and so
is the rank's parameter list for the layout. The rank maps its parameters to the
checkpoint and plans its buckets twice in the same run, timed by process CPU time (best
of ``--repeats``): through megastart's built-in table, and through the installed
Megatron-Bridge's registry for the architecture, as on verl 0.9's default branch.

The registry path needs each parameter's module only for ``AutoMapping``, which reads its
class name: the benchmark gives it stand-ins named after the Megatron module that holds
such a parameter (the one thing it reads), not models of 671B parameters.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from megastart.bench.synthetic import (
    MODELS,
    Layout,
    expert_count,
    layout_shard,
    rank_parameters,
    synthetic_checkpoint,
    world_demands,
)

HELP = (
    "one rank's planning on a synthetic checkpoint: built-in table vs Megatron-Bridge's registry; "
    "with --world, one rank of each role in a world of that many ranks"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="deepseek-v3")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (default: 1)")
    parser.add_argument("--bucket-mb", type=float, default=512.0, help="bucket size (default: 512)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many (default: 3)")
    parser.add_argument(
        "--world",
        type=int,
        default=None,
        help="plan for a world of this many ranks instead: one rank of each role (reader, node "
        "leader, member), with the reports and views as the control plane hands them over",
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=8, help="with --world: ranks per node (default: 8)"
    )
    parser.add_argument("--json", help="also write the figures to this file")


def run(args: argparse.Namespace) -> int:
    config = MODELS[args.model]
    meta = synthetic_checkpoint(config)
    layout = Layout(args.tp, args.pp, args.ep)
    if args.world is not None:
        return _run_world(args, config, meta, layout)
    params = rank_parameters(config, layout)
    results = {"model": args.model, "tensors": len(meta.tensors), "parameters": len(params)}
    results["layout"] = {"tp": args.tp, "pp": args.pp, "ep": args.ep}
    results["built_in_s"] = _best(args.repeats, lambda: _plan(meta, params, layout, None, args))
    bridge = _megatron_bridge(config)
    if isinstance(bridge, str):
        results["registry"] = bridge
    else:
        results["registry_s"] = _best(
            args.repeats, lambda: _plan(meta, params, layout, bridge, args)
        )
        results["registry_vs_built_in"] = results["registry_s"] / results["built_in_s"]
    print(render(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


def _run_world(args: argparse.Namespace, config: dict[str, Any], meta: Any, layout: Layout) -> int:
    from megastart.bench.world import measure_world

    world, per_node = args.world, args.ranks_per_node
    stage = world // max(layout.pp, 1)
    if world % (layout.tp * layout.pp) or stage % (layout.tp * layout.ep) or world % per_node:
        raise SystemExit(
            f"--world {world} must be a multiple of --tp x --pp ({layout.tp * layout.pp}) and of "
            f"--ranks-per-node ({per_node}), with --tp x --ep ({layout.tp * layout.ep}) dividing a "
            f"pipeline stage's {stage} ranks"
        )
    if expert_count(config) % layout.ep:
        raise SystemExit(f"--ep {layout.ep} must divide the model's {expert_count(config)} experts")
    results = {
        "model": args.model,
        "tensors": len(meta.tensors),
        "world": world,
        "ranks_per_node": per_node,
        "layout": {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep},
    }
    results |= measure_world(
        world_demands(config, meta, layout, world),
        meta,
        ranks_per_node=per_node,
        bucket_mb=args.bucket_mb,
        repeats=args.repeats,
    )
    print(render_world(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


def render_world(results: dict[str, Any]) -> str:
    layout = results["layout"]
    lines = [
        f"{results['model']}: {results['tensors']:,} checkpoint tensors; {results['world']:,} "
        f"ranks, {results['ranks_per_node']} per node, TP{layout['tp']} PP{layout['pp']} "
        f"EP{layout['ep']}; every rank's report: {results['demands_mb']:.1f} MB (pickled)",
        f"  {'role':<7} {'rank':>6} {'plan s':>8} {'plan MB':>8} {'recv MB':>8} "
        f"{'groups (leaders)':>19} {'control':>7} {'store req/s waiting (first 3 s, then)':>38}",
    ]
    for role, figures in results["roles"].items():
        rps = figures["store_rps"]
        lines.append(
            f"  {role:<7} {figures['rank']:>6} {figures['plan_s']:>8.3f} {figures['plan_mb']:>8.1f} "
            f"{figures['received_mb']:>8.2f} "
            f"{figures['groups']:>7,} {'(' + format(figures['between_leaders'], ',') + ')':>11} "
            f"{figures['control_groups']:>7} "
            f"{rps['first']:>27.1f}, {rps['settled']:.1f}"
        )
    control = results["control"]
    lines.append(
        f"  control plane: {control['groups']:,} gloo groups of at most {control['largest']} "
        f"ranks, made once per process with about {control['store_requests']:,} store requests "
        "in all"
    )
    world_rps = results["store_rps_world"]
    lines.append(
        f"  store req/s with every rank waiting: {world_rps['first']:,.0f} in the first 3 s, "
        f"{world_rps['settled']:,.0f} after"
    )
    lines.append(
        "  (reader=global, as by default; plan s: process CPU time from the reports to "
        "the stream's first byte, best of --repeats; plan MB: peak Python memory allocated, the "
        "reports it holds included; recv MB: the bytes the control plane's tree brings it while "
        "planning: the reports going up (rank 0 alone gets them all), the summary, its node's "
        "view; groups: process groups each rank creates per load, none over the world, leaders: "
        "those between node leaders, made by those leaders alone; control: "
        "the control plane's groups it is in, kept; store req/s: one "
        "rank waiting at the board; node leaders look at the store, the other ranks at their "
        "node's page)"
    )
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    lines = [
        f"{results['model']}: {results['tensors']:,} checkpoint tensors; one rank of "
        f"TP{results['layout']['tp']} PP{results['layout']['pp']} EP{results['layout']['ep']} "
        f"holds {results['parameters']:,} parameters (rank 0 of each group)",
        f"  built-in table          {results['built_in_s']:.3f} s CPU",
    ]
    if "registry_s" in results:
        lines.append(
            f"  Megatron-Bridge registry {results['registry_s']:.3f} s CPU "
            f"({results['registry_vs_built_in']:.2f}x the built-in table's)"
        )
    else:
        lines.append(f"  Megatron-Bridge registry: {results['registry']}")
    lines.append(
        "  (mapping the rank's parameters to the checkpoint, checking every shape, and "
        "planning its buckets; best of --repeats, process CPU time)"
    )
    return "\n".join(lines)


def _best(repeats: int, work: Any) -> float:
    times = []
    for _ in range(max(1, repeats)):
        start = time.process_time()
        work()
        times.append(time.process_time() - start)
    return min(times)


def _plan(meta: Any, params: list[Any], layout: Layout, bridge: Any, args: Any) -> None:
    from megastart.loader.mapping.archs.table import MappingTable
    from megastart.loader.mapping.bridge import bridge_table
    from megastart.loader.mapping.mappings import mapping_for
    from megastart.loader.mapping.needs import resolve_needs
    from megastart.loader.plan.buckets import build_plan

    table: MappingTable | None = mapping_for(meta.architectures[0])
    if bridge is not None:
        stand_ins = [(p.name, _stand_in(p.name), False) for p in params]
        table = bridge_table(bridge, stand_ins, meta.architectures, tied=False)
    assert table is not None
    needs = resolve_needs(params, table, meta, layout_shard(meta.config, layout))
    demands = [d for need in needs for d in need.demands()]
    build_plan([demands], meta, bucket_bytes=int(args.bucket_mb * 2**20))


def _megatron_bridge(config: dict[str, Any]) -> Any:
    """The model bridge for the architecture, or why there is none here."""
    try:
        from megatron.bridge.models.conversion.model_bridge import get_model_bridge
        from transformers import AutoConfig
    except Exception as e:
        return f"not measured: Megatron-Bridge does not import here ({type(e).__name__}: {e})"
    fields = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    return get_model_bridge(
        config["architectures"][0], hf_config=AutoConfig.for_model(config["model_type"], **fields)
    )


_STAND_IN_TYPES = (
    ("embedding.", "", "VocabParallelEmbedding"),
    ("", "norm.weight", "RMSNorm"),
    ("", "router.weight", "TopKRouter"),
    ("", "router.expert_bias", "TopKRouter"),
    ("", "linear_proj.weight", "RowParallelLinear"),
    ("", "linear_fc2.weight", "RowParallelLinear"),
)
"""(name prefix, name suffix, Megatron module) of :func:`rank_parameters`' names; the rest
are column-parallel linears."""

_STAND_IN_CLASSES: dict[str, type] = {}


def _stand_in(name: str) -> Any:
    """An object whose class is named after the Megatron module that holds ``name``."""
    kind = next(
        (k for head, tail, k in _STAND_IN_TYPES if name.startswith(head) and name.endswith(tail)),
        "ColumnParallelLinear",
    )
    return _STAND_IN_CLASSES.setdefault(kind, type(kind, (), {}))()
