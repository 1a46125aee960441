"""``megastart-demo.png``: node memory over time for both loaders, with the hook phases marked.

Drawn from the demo's results (the same samples as the table and the JSON):
the top panel lays the two loads over each other, from the moment each began;
the bottom one is megastart's whole run, every step a shaded band, the hooks
in colour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_LOADER_COLOURS = {"megastart": "tab:green", "every_rank_full": "tab:red"}
_LOAD_STEP = {"megastart": "on_model_load", "every_rank_full": "load"}
_HOOK_COLOURS = {
    "on_model_load": "tab:green",
    "post_recover_load": "tab:orange",
    "pre_first_step": "tab:purple",
    "train step": "tab:blue",
}
_QUIET = "0.85"
_MARGIN_S = 1.0
"""Seconds shown before and after the loads in the top panel."""


def plot(results: dict[str, Any], path: Path) -> None:
    """Write the PNG to ``path`` (matplotlib is imported here, only when plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = list(
        zip(
            results["memory"]["seconds"],
            [b / 1e9 for b in results["memory"]["bytes"]],
            strict=True,
        )
    )
    top = max(g for _, g in samples) * 1.15
    fig, (loads, run) = plt.subplots(2, 1, figsize=(11, 8), gridspec_kw={"height_ratios": [1, 1.2]})
    _draw_loads(loads, results, samples, top)
    _draw_run(run, results, samples, top, "megastart")
    layout = results["layout"]
    fig.suptitle(
        f"megastart demo: {results['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, "
        f"{layout['ranks']} CPU ranks (TP{layout['tp']} x PP{layout['pp']}) over gloo; "
        "node memory = sum of the ranks' PSS",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_loads(
    ax: Any, results: dict[str, Any], samples: list[tuple[float, float]], top: float
) -> None:
    """Both loads from their start (t = 0), a second either side, peaks dotted."""
    longest = 0.0
    for loader, colour in _LOADER_COLOURS.items():
        step = _step(results, loader, _LOAD_STEP[loader])
        start, end = step["start_s"], step["end_s"]
        longest = max(longest, end - start)
        window = [(t - start, g) for t, g in samples if start - _MARGIN_S <= t <= end + _MARGIN_S]
        row = results["loaders"][loader]
        ax.plot(
            [t for t, _ in window],
            [g for _, g in window],
            color=colour,
            lw=1.6,
            label=(
                f"{loader}: {row['seconds']:.1f} s, peak {row['node_peak_bytes'] / 1e9:.2f} GB "
                f"(+{row['added_bytes'] / 1e9:.2f} GB), read {row['bytes_read'] / 1e9:.2f} GB"
            ),
        )
        ax.axhline(row["node_peak_bytes"] / 1e9, color=colour, ls=":", lw=0.9)
        ax.axvspan(0, end - start, color=colour, alpha=0.08, lw=0)
    ax.set_xlim(-_MARGIN_S, longest + _MARGIN_S)
    ax.set_ylim(0, top)
    ax.set_title(
        "the load: on_model_load (rank0_loader) vs every rank reading it all",
        loc="left",
        fontsize=10,
    )
    ax.set_xlabel("seconds since the load began")
    ax.set_ylabel("node memory, GB")
    ax.legend(loc="lower right", fontsize=8)


def _draw_run(
    ax: Any, results: dict[str, Any], samples: list[tuple[float, float]], top: float, run: str
) -> None:
    """One run's steps from the model build on (the ranks' imports left out), hooks coloured."""
    steps = [s for s in results["steps"] if s["run"] == run and s["name"] != "start Megatron"]
    start, end = steps[0]["start_s"], steps[-1]["end_s"]
    for i, step in enumerate(steps):
        colour = _HOOK_COLOURS.get(step["name"], _QUIET)
        left, right = step["start_s"] - start, step["end_s"] - start
        ax.axvspan(left, right, color=colour, alpha=0.3 if colour != _QUIET else 0.35, lw=0)
        ax.axvline(left, color="white", lw=0.8)
        wide = right - left > (end - start) / 10
        ax.text(
            (left + right) / 2,
            top * (0.97 if wide or i % 2 else 0.62),
            step["name"],
            ha="center",
            va="top",
            fontsize=7,
            rotation=0 if wide else 90,
        )
    window = [(t - start, g) for t, g in samples if start <= t <= end]
    ax.plot([t for t, _ in window], [g for _, g in window], color="black", lw=1.2)
    ax.set_xlim(0, end - start)
    ax.set_ylim(0, top)
    ax.set_title(
        f"{run}, the whole run: load, check, save and restore a Megatron dist checkpoint, "
        "the restart hooks, one training step",
        loc="left",
        fontsize=10,
    )
    ax.set_xlabel("seconds since the model build began (the ranks' imports are left out)")
    ax.set_ylabel("node memory, GB")


def _step(results: dict[str, Any], run: str, name: str) -> dict[str, Any]:
    return next(s for s in results["steps"] if (s["run"], s["name"]) == (run, name))
