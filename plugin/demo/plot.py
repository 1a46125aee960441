"""``megastart-demo.png``: node memory over time for both loaders, each step marked.

Drawn from the demo's results (the same samples as the table and the JSON), one
panel per run on a shared memory axis; every step is a shaded band with its
name, the hooks in colour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_HOOK_COLOURS = {
    "on_model_load": "tab:green",
    "load": "tab:red",
    "post_recover_load": "tab:orange",
    "pre_first_step": "tab:purple",
    "train step": "tab:blue",
}
_QUIET = "0.9"
_SKIPPED = {"start Megatron", "settle"}
"""Steps not drawn: the ranks' imports (seconds of flat memory) and the benchmark's cleanup."""


def plot(results: dict[str, Any], path: Path) -> None:
    """Write the PNG to ``path`` (matplotlib is imported here, only when plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(step["run"] for step in results["steps"]))
    seconds = results["memory"]["seconds"]
    gigabytes = [b / 1e9 for b in results["memory"]["bytes"]]
    top = max(gigabytes) * 1.15
    drawn = {
        run: [s for s in results["steps"] if s["run"] == run and s["name"] not in _SKIPPED]
        for run in runs
    }
    longest = max(steps[-1]["end_s"] - steps[0]["start_s"] for steps in drawn.values())
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(11, 3.4 * len(runs)), squeeze=False, sharex=True
    )
    for ax, run in zip(axes[:, 0], runs, strict=True):
        steps = drawn[run]
        start, end = steps[0]["start_s"], steps[-1]["end_s"]
        window = [
            (t - start, g) for t, g in zip(seconds, gigabytes, strict=True) if start <= t <= end
        ]
        for i, step in enumerate(steps):
            colour = _HOOK_COLOURS.get(step["name"], _QUIET)
            left, right = step["start_s"] - start, step["end_s"] - start
            ax.axvspan(left, right, color=colour, alpha=0.25 if colour != _QUIET else 0.5, lw=0)
            ax.text(
                (left + right) / 2,
                top * (0.97 - 0.07 * (i % 2)),
                step["name"],
                ha="center",
                va="top",
                fontsize=7,
                rotation=0 if right - left > longest / 12 else 90,
            )
        ax.plot([t for t, _ in window], [g for _, g in window], color="black", lw=1.2)
        row = results["loaders"][run]
        ax.axhline(row["node_peak_bytes"] / 1e9, color="black", ls=":", lw=0.8)
        ax.set_title(
            f"{run}: load {row['seconds']:.1f} s, node peak {row['node_peak_bytes'] / 1e9:.2f} GB, "
            f"read {row['bytes_read'] / 1e9:.2f} GB",
            fontsize=10,
            loc="left",
        )
        ax.set_ylim(0, top)
        ax.set_xlim(0, longest)
        ax.set_ylabel("node memory, GB (sum of PSS)")
    axes[-1, 0].set_xlabel("seconds since the model was built (the ranks' imports are left out)")
    layout = results["layout"]
    fig.suptitle(
        f"megastart demo: {results['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, "
        f"{layout['ranks']} CPU ranks (TP{layout['tp']} x PP{layout['pp']}), gloo",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
