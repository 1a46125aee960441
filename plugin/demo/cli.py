"""``megastart demo``: the whole plugin on this machine, no GPU needed.

A small Megatron-core job on CPU ranks over gloo (default: 4 ranks, TP2 x PP2)
acts as the host and calls megastart's hooks where verl or AReaL would:

  1. on_model_load loads a Qwen2-shaped fp32 HF checkpoint (~300 MB, made once
     and cached under ~/.cache/megastart/demo) with a progress bar;
  2. the loaded model's logits are checked against transformers (fp32);
  3. a simulated restart: a Megatron distributed checkpoint is saved and
     restored, then post_recover_load and pre_first_step run, then one real
     training step (Megatron's pipeline schedule + optimizer step);
  4. the same model and layout are loaded the way verl's legacy loader did
     (every rank reads the whole checkpoint), and a table compares the two.

Writes megastart-demo.png (node memory over time, hook phases marked) and
megastart-demo.json to --out. The installed plugins run, with your settings:
MEGASTART_BLOCKLIST=comm_warmup megastart demo   runs it without the warmup.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HELP = "load, check, restart and train a small Megatron model on CPU through megastart's hooks"

ARCH, DTYPE = "qwen2", "float32"
"""The demo's own checkpoint: Qwen2-shaped, in the dtype the CPU model trains in, so that,
as in a bf16 job on GPUs, the checkpoint's dtype is the parameters' (no conversion)."""
DEFAULT_SIZE_MB = 300
JSON_NAME, PNG_NAME = "megastart-demo.json", "megastart-demo.png"

BUCKET_ENV, DEMO_BUCKET_MB = "MEGASTART_RANK0_LOADER_BUCKET_MB", "16"
"""The demo's ``rank0_loader.bucket_mb`` unless the user sets it: the loader's default
(32 MiB) is sized for checkpoints of several GB; at 300 MB a bucket that size
would hold a tenth of the checkpoint on every rank at once."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="your own HF checkpoint directory (config.json + *.safetensors) instead of the demo's",
    )
    parser.add_argument("--ranks", type=int, default=4, help="world size (default: 4)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default: 2)")
    parser.add_argument(
        "--out", type=Path, default=Path("."), help="where to write the PNG and JSON (default: .)"
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    parser.add_argument(
        "--size-mb",
        type=float,
        default=DEFAULT_SIZE_MB,
        help=f"size of the demo's own checkpoint (default: {DEFAULT_SIZE_MB})",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="bound on every distributed step (default: 600)",
    )


DEMO_EXTRAS = ("transformers", "megatron.core", "psutil")
"""What ``megastart[demo]`` installs that the demo's host needs (matplotlib only for the PNG)."""


def run(args: argparse.Namespace) -> int:
    from megastart.demo.checks import Layout

    _check_extras(DEMO_EXTRAS + (() if args.no_plot else ("matplotlib",)))
    started = time.perf_counter()
    set_by_demo = {} if BUCKET_ENV in os.environ else {BUCKET_ENV: DEMO_BUCKET_MB}
    os.environ.update(set_by_demo)  # the ranks inherit the environment
    layout = Layout(ranks=args.ranks, tp=args.tp, pp=args.pp)
    checkpoint = _checkpoint(args, layout)  # a megastart error: its message, exit status 2
    from megastart.demo.scenario import run_demo
    from megastart.harness.launch import RankFailure

    try:
        results = run_demo(str(checkpoint), layout, timeout_s=args.timeout_s)
    except RankFailure as e:
        print(f"megastart demo: a step failed on the ranks.\n{e}", file=sys.stderr)
        return 1
    results["command"] = "megastart " + " ".join(sys.argv[1:])
    results["total_seconds"] = time.perf_counter() - started
    results["settings"] = _settings()
    results["set_by_demo"] = set_by_demo
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / JSON_NAME
    results["table"] = render_table(results)
    if not args.no_plot:
        from megastart.demo.plot import plot

        results["png"] = str(args.out / PNG_NAME)
        plot(results, args.out / PNG_NAME)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    print(results["table"])
    print(f"\nwrote {json_path}" + (f" and {results['png']}" if "png" in results else ""))
    print(f"demo took {results['total_seconds']:.0f} s")
    ours = results["megastart"]
    failed = [
        what
        for what, ok in (
            ("the logits do not match transformers'", ours["logits"]["match"]),
            ("the restored model differs from the loaded one", ours["restored_logits_equal"]),
            ("a rank's training step did not update", ours["train_step"]["all_ranks_updated"]),
        )
        if not ok
    ]
    for what in failed:
        print(f"megastart demo: FAILED: {what}", file=sys.stderr)
    return 1 if failed else 0


def render_table(results: dict[str, Any]) -> str:
    """The comparison table (Markdown, so docs/performance.md can show it as is)."""
    from megastart.loader.settings import Rank0LoaderSettings

    layout = results["layout"]
    lines = [
        f"{results['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, {layout['ranks']} ranks "
        f"(TP{layout['tp']} x PP{layout['pp']} x DP{layout['dp']}), gloo on "
        f"{results['machine']['cpus']} CPU cores",
        "",
        "| loader | wall s | node peak MB | added by the load MB | rank peaks added MB | read MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in results["loaders"].items():
        lines.append(
            f"| {name} | {row['seconds']:.2f} | {row['node_peak_bytes'] / 1e6:.0f} | "
            f"{row['added_bytes'] / 1e6:.0f} | {row['rank_peaks_added_bytes'] / 1e6:.0f} | "
            f"{row['bytes_read'] / 1e6:.0f} |"
        )
    warmup = results["megastart"]["warmup"]
    if warmup is None:
        what = "did not run (comm_warmup blocked or megastart disabled)"
    else:
        what = (
            f"comm_warmup ran at {warmup['hook']}: {len(warmup['groups'])} groups "
            f"({', '.join(warmup['groups'])}), {len(warmup['operations'])} operations, "
            f"{warmup['seconds']:.2f} s"
        )
    bucket = results["settings"].get("rank0_loader", {}).get("bucket_mb", {})
    lines += [
        "",
        f"warmup: {what}",
        f"rank0_loader.bucket_mb = {bucket.get('value')} ("
        + (
            "the demo's default for its small checkpoint; the loader's own is "
            f"{Rank0LoaderSettings().bucket_mb:g}"
            if BUCKET_ENV in results["set_by_demo"]
            else bucket.get("source", "")
        )
        + ")",
        "",
        "wall s: on_model_load's LoadReport.seconds / every_rank_full's time between a barrier "
        "before and after (slowest rank). node peak: the most the ranks held together during the "
        "load, the sum of their PSS sampled every "
        f"{results['memory']['period_s'] * 1e3:.0f} ms; added: that peak minus the moment before "
        "the load. rank peaks added: the sum over the ranks of the kernel's peak RSS during the "
        "load (VmHWM) minus their RSS before it; no sampling gap hides a peak from it, but peaks "
        "that did not coincide add up. read: bytes read from the checkpoint files, all ranks "
        "together.",
    ]
    return "\n".join(lines)


def _checkpoint(args: argparse.Namespace, layout: Any) -> Path:
    """The user's checkpoint or the demo's (made once, cached); checked before any rank starts."""
    from megastart.demo.checks import check_architecture, check_layout

    loader_enabled = _plugin_loaded("rank0_loader")
    if args.checkpoint is not None:
        from megastart.loader.checkpoint import read_metadata

        path = args.checkpoint.expanduser().resolve()
        # megastart's own checks first (config, index, shards, quantisation), as the loader
        # will make them: nothing else reads the directory before them.
        meta = read_metadata(path, allow_pickle=False)
        if meta.quantisation is not None:
            raise meta.quantisation.refusal(str(path))
        config = meta.config
        check_architecture(config, str(path), loader_enabled=loader_enabled)
        check_layout(layout, config, str(path))
        return path
    from megastart.harness.checkpoints import make_checkpoint, scaled_config

    hf_config = scaled_config(ARCH, int(args.size_mb * 1e6), dtype=DTYPE)
    config = hf_config.to_dict()
    name = f"demo {ARCH}-{args.size_mb:g}MB"
    check_architecture(config, name, loader_enabled=loader_enabled)
    check_layout(layout, config, name)
    path = _cache_dir() / hashlib.sha256(hf_config.to_json_string().encode()).hexdigest()[:16]
    if not (path / "config.json").is_file():
        start = time.perf_counter()
        print(
            f"making the demo checkpoint ({args.size_mb:g} MB, {ARCH}, {DTYPE}) in {path}",
            file=sys.stderr,
        )
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_checkpoint(hf_config, tmp)
        try:
            tmp.rename(path)  # atomic: a half-written checkpoint is never reused
        except OSError:  # another demo made it first
            if not (path / "config.json").is_file():
                raise
            shutil.rmtree(tmp)
        print(f"made it in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return path


def _check_extras(modules: tuple[str, ...]) -> None:
    """Refuse, in one line, where the demo's extras are not installed (not a traceback later)."""
    from importlib.util import find_spec

    from megastart.errors import MegastartError

    def missing(name: str) -> bool:
        try:
            return find_spec(name) is None
        except (ImportError, ValueError):  # a parent package missing, or the module blocked
            return True

    absent = [name for name in modules if missing(name)]
    if absent:
        raise MegastartError(
            f"needs {', '.join(absent)}, not installed here: pip install 'megastart[demo]' "
            "(from a clone: pip install -e '.[demo]')"
        )


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megastart" / "demo"


def _settings() -> dict[str, Any]:
    """The resolved megastart settings the ranks ran with, each with its source."""
    from megastart.manager import get_settings

    return get_settings().as_dict()


def _plugin_loaded(name: str) -> bool:
    from megastart.manager import get_plugin_manager

    return get_plugin_manager().get_plugin(name) is not None
