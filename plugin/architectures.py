"""``megastart architectures``: which architectures rank0_loader loads and which it leaves to
the host, from the built-in tables and the installed Megatron-Bridge's registries; given a
checkpoint, what would happen to it."""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

HELP = (
    "list the architectures rank0_loader loads (built-in, Megatron-Bridge) and predict a checkpoint"
)

AT_LOAD_TIME = (
    "decided when the model is built: the parallelism of each AutoMapping'd module, "
    "parameters the layout adds (MTP layers, a value head) and parameters no mapping names "
    "(left as the host initialised them, as the bridge leaves them)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", nargs="?", help="an HF checkpoint directory: predict what happens to it"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    report = collect(args.checkpoint)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def collect(checkpoint: str | None = None) -> dict[str, Any]:
    """The report as plain data (the ``--json`` output)."""
    from megastart.loader.mapping.mappings import known_architectures

    report: dict[str, Any] = {
        "built_in": known_architectures(),
        "megatron_bridge": megatron_bridge_architectures(),
        "at_load_time": AT_LOAD_TIME,
    }
    if checkpoint is not None:
        report["checkpoint"] = predict(checkpoint)
    return report


def megatron_bridge_architectures(hf_config: Any = None) -> dict[str, Any]:
    """Per architecture Megatron-Bridge registers: whether megastart loads it from the bridge's
    registry, and why not. ``{"installed": False}`` without Megatron-Bridge."""
    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.bridge") is None
    ):
        return {"installed": False}
    try:
        from megatron.bridge.models.conversion.model_bridge import get_model_bridge
    except Exception as e:  # an install this machine cannot import: say so, list nothing
        return {"installed": True, "error": f"importing Megatron-Bridge failed: {e}"}
    from importlib.metadata import version

    verdicts = {}
    for source in get_model_bridge._exact_types:
        name = source if isinstance(source, str) else source.__name__
        verdicts[name] = verdict(get_model_bridge(source, hf_config=hf_config))
    return {"installed": True, "version": version("megatron-bridge"), "architectures": verdicts}


def verdict(bridge: Any) -> dict[str, str]:
    """``{"bridge", "served": "yes" | "no" | "at load time", "why"}`` for one model bridge."""
    from megastart.loader.mapping.bridge import Untranslatable, bridge_table

    kind = type(bridge).__name__
    try:
        bridge_table(bridge, [], (), tied=False)
    except Untranslatable as e:
        return {"bridge": kind, "served": "no", "why": str(e)}
    except Exception as e:  # the registry reads the model's config: known once it is given
        return {
            "bridge": kind,
            "served": "at load time",
            "why": f"its registry needs the model's config ({type(e).__name__}: {e})",
        }
    return {"bridge": kind, "served": "yes", "why": "megastart translates every mapping"}


def predict(checkpoint: str) -> dict[str, Any]:
    """What rank0_loader would do with ``checkpoint`` on each load path."""
    from megastart.loader.checkpoint import read_metadata
    from megastart.loader.mapping.model import UnsupportedArchitecture, mapping_table

    meta = read_metadata(checkpoint, allow_pickle=True)
    out: dict[str, Any] = {"directory": meta.directory, "architectures": list(meta.architectures)}
    try:
        out["built_in"] = f"the {mapping_table(meta).architectures[0]} table"
    except UnsupportedArchitecture:
        out["built_in"] = "none: left to the host"
    out["quantisation"] = _quantisation(meta.quantisation)
    bridges = megatron_bridge_architectures(_hf_config(checkpoint)).get("architectures")
    if bridges is not None:
        out["megatron_bridge"] = {
            a: bridges.get(a, {"served": "no", "why": "no bridge"}) for a in meta.architectures
        }
    q = meta.quantisation
    out["verdict"] = _verdict(
        out,
        refused=q is not None and q.weight_block is None and not q.packing,
        built_in="table" in out["built_in"] and (q is None or not q.packing),
    )
    return out


def _quantisation(quantisation: Any) -> str:
    """What happens to a checkpoint's quantisation."""
    if quantisation is None:
        return "none"
    elif quantisation.weight_block is not None:
        return f"{quantisation.method} ({quantisation.evidence}): dequantised by megastart"
    elif quantisation.packing:
        from megastart.loader.mapping.hooks import HOOKS

        bridge = " or ".join(
            owner.rpartition(".")[2]
            for owner, hook in HOOKS.items()
            if quantisation.packing in hook.dequantises
        )
        return (
            f"{quantisation.method} ({quantisation.evidence}): dequantised by megastart where "
            f"the host's Megatron-Bridge is {bridge}; otherwise refused, or left to a host "
            "that dequantises it"
        )
    return (
        f"{quantisation.method} ({quantisation.evidence}): refused, or left to a host that "
        "dequantises it"
    )


def _verdict(prediction: dict[str, Any], *, refused: bool, built_in: bool) -> str:
    """One line: loaded by megastart, or left to the host, and why (``refused``: a quantisation
    megastart never dequantises; ``built_in``: a built-in table loads it)."""
    if refused:
        return f"left to the host: its quantisation is {prediction['quantisation']}"
    bridge = prediction.get("megatron_bridge", {})
    served = [a for a, v in bridge.items() if v["served"] != "no"]
    if built_in and (served or not bridge):
        return "loaded by megastart"
    if built_in:
        why = "; ".join(v["why"] for v in bridge.values())
        return (
            "loaded by megastart through its built-in table (mbridge, AReaL, "
            f"load_hf_checkpoint); where the host loads through Megatron-Bridge, left to it: {why}"
        )
    architectures = ", ".join(prediction["architectures"]) or "its architecture"
    if served:
        return (
            "loaded by megastart where the host loads through Megatron-Bridge; left to the host "
            f"otherwise (no built-in table for {architectures})"
        )
    why = "".join(f"; Megatron-Bridge: {v['why']}" for v in bridge.values())
    return f"left to the host: no built-in table for {architectures}{why}"


def _hf_config(checkpoint: str) -> Any:
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(checkpoint)
    except Exception:  # a registry that needs it says so
        return None


_VERDICTS = {
    "yes": "loaded by megastart",
    "at load time": "decided at load time",
    "no": "left to the bridge",
}
"""A bridge's ``served`` verdict and its heading, in the order they are listed."""


def render(report: dict[str, Any]) -> str:
    lines = ["rank0_loader's built-in tables (mbridge, AReaL, megastart.load_hf_checkpoint):"]
    lines += [f"  {a}" for a in report["built_in"]]
    bridge = report["megatron_bridge"]
    version = f" {bridge['version']}" if "version" in bridge else ""
    lines += ["", f"Megatron-Bridge{version} (where megastart replaces its load_hf_weights):"]
    if not bridge["installed"]:
        lines.append("  not installed here")
    elif "error" in bridge:
        lines.append(f"  {bridge['error']}")
    else:
        for served, title in _VERDICTS.items():
            names = [a for a, v in sorted(bridge["architectures"].items()) if v["served"] == served]
            lines.append(f"  {title} ({len(names)}):")
            for name in names:
                why = "" if served == "yes" else f": {bridge['architectures'][name]['why']}"
                lines.append(f"    {name}{why}")
    lines += ["", f"Always {report['at_load_time']}."]
    if "checkpoint" in report:
        c = report["checkpoint"]
        lines += ["", f"checkpoint {c['directory']} ({', '.join(c['architectures'])}):"]
        lines.append(f"  built-in table: {c['built_in']}")
        lines.append(f"  quantisation:   {c['quantisation']}")
        for arch, v in c.get("megatron_bridge", {}).items():
            lines.append(f"  Megatron-Bridge ({arch}): {v['served']}: {v['why']}")
        lines.append(f"verdict: {c['verdict']}")
    return "\n".join(lines)
