"""The demo's sequence of steps on one pool of ranks, timed and memory-sampled.

Run 1, megastart: start Megatron, build the model, ``on_model_load``, check the
logits against ``transformers``, save a Megatron distributed checkpoint, then a
simulated restart in the same processes (fresh model restored from it,
``post_recover_load``, ``pre_first_step``, one training step).
Run 2, the baseline: the same model and layout loaded the way verl's legacy
loader did (``every_rank_full`` of ``megastart bench loader``: every rank holds
a private copy of the whole checkpoint).

Node memory is the sum of the ranks' PSS, sampled by the benchmark's
:class:`~megastart.bench.memory.PssSampler` for the whole run; each step's
start and end are recorded, so the table and the plot read the same samples.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from megastart.demo.checks import Layout
from megastart.records import LoadReport

LOGITS_TOKENS = 16
"""Length of the random prompt whose logits are compared with ``transformers``."""

LOGITS_ATOL = 1e-3
"""Largest absolute logit difference accepted between Megatron and ``transformers`` (both fp32)."""

MEGASTART, BASELINE = "megastart", "every_rank_full"


def run_demo(
    checkpoint: str, layout: Layout, *, timeout_s: float, sample_s: float = 0.02
) -> dict[str, Any]:
    """Run both loaders on ``checkpoint`` in ``layout``; everything the table, JSON and plot need."""
    from megastart.bench import strategies
    from megastart.bench.memory import PssSampler
    from megastart.demo import host
    from megastart.harness.launch import RankPool

    input_ids, reference = _reference_logits(checkpoint)
    with tempfile.TemporaryDirectory(prefix="megastart-demo-recover-") as recover_dir:
        _say(f"starting {layout.describe()} over gloo")
        with RankPool(layout.ranks, timeout_s=timeout_s) as pool:
            pids = pool.run(os.getpid)
            with PssSampler(pids, period_s=sample_s) as sampler:
                steps = _Steps(pool, sampler, pids)
                ours = _megastart_run(
                    steps, host, checkpoint, layout, input_ids, reference, recover_dir
                )
                theirs = _baseline_run(steps, strategies, checkpoint, layout)
    t0 = sampler.timeline[0][0]
    return {
        "checkpoint": checkpoint,
        "checkpoint_bytes": _checkpoint_bytes(checkpoint),
        "layout": asdict(layout) | {"dp": layout.dp},
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        MEGASTART: ours,
        BASELINE: theirs,
        "loaders": {
            MEGASTART: _load_row(
                steps, "on_model_load", ours["load"]["seconds"], ours["load"]["bytes_read"]
            ),
            BASELINE: _load_row(steps, "load", theirs["seconds"], theirs["bytes_read"]),
        },
        "steps": [
            {"run": run, "name": name, "start_s": start - t0, "end_s": end - t0}
            for run, name, start, end in steps.records
        ],
        "memory": {
            "what": (
                "sum over the ranks of their PSS: RssAnon (/proc/<pid>/status) every sample, "
                "Pss_File + Pss_Shmem (/proc/<pid>/smaps_rollup) every 10th "
                "(megastart.bench.memory.PssSampler)"
            ),
            "period_s": sample_s,
            "seconds": [t - t0 for t, _ in sampler.timeline],
            "bytes": [b for _, b in sampler.timeline],
        },
    }


def _megastart_run(
    steps: _Steps,
    host: Any,
    checkpoint: str,
    layout: Layout,
    input_ids: Any,
    reference: Any,
    recover_dir: str,
) -> dict[str, Any]:
    steps.run = MEGASTART
    steps("start Megatron", host.start, checkpoint, layout.tp, layout.pp)
    steps("build model", host.build_model)
    _say("[1/4] loading the checkpoint through on_model_load")
    load = steps.load("on_model_load", host.load_weights)[0]
    _say(f"      {LoadReport(**load).summary()}")
    loaded = steps("logits", host.logits, input_ids)[0]
    check = _compare(loaded, reference)
    _say(
        f"[2/4] logits vs transformers (fp32, {LOGITS_TOKENS} tokens): max |diff| "
        f"{check['max_abs_diff']:.2e} (tolerance {LOGITS_ATOL:g}), same next tokens: "
        f"{check['same_argmax']} -> {'OK' if check['match'] else 'MISMATCH'}"
    )
    _say(
        "[3/4] simulated restart: Megatron distributed checkpoint saved, model rebuilt and restored"
    )
    steps("save dist checkpoint", host.save_recover_checkpoint, recover_dir)
    restart = steps("restore dist checkpoint", host.restore_recover_checkpoint, recover_dir)[0]
    _say(f"      {_restart_summary(restart)}")
    restored = steps("logits", host.logits, input_ids)[0]
    post = steps("post_recover_load", host.post_recover_load, recover_dir)
    first = steps("pre_first_step", host.pre_first_step)
    train = steps("train step", host.train)
    steps("finish", host.finish)
    last_stage = next(t for t in reversed(train) if t["loss"] is not None)
    hooks = {"post_recover_load": post[0], "pre_first_step": first[0]}
    warmed = [(hook, ran["warmup"]) for hook, ran in hooks.items() if ran["warmup"] is not None]
    result = {
        "load": load,
        "logits": check,
        "restart": restart,
        "restored_logits_equal": bool((restored == loaded).all()),
        "hooks": hooks,
        "warmup": warmed[0][1] | {"hook": warmed[0][0]} if warmed else None,
        "train_step": last_stage | {"all_ranks_updated": all(t["updated"] for t in train)},
    }
    _say(
        f"      restored model's logits identical to the loaded one's: {result['restored_logits_equal']}"
    )
    for hook, ran in hooks.items():
        _say(f"      {hook}: {_hook_summary(ran, result['warmup'])}")
    step = result["train_step"]
    _say(
        f"      train step: {step['schedule']} + {step['optimizer']}: loss {step['loss']:.4f}, "
        f"grad norm {step['grad_norm']:.4f}, every rank updated its parameters: "
        f"{step['all_ranks_updated']}"
    )
    return result


def _restart_summary(restart: dict[str, Any]) -> str:
    if restart["hf_load"] == "skipped":
        return (
            f"HF load skipped: the resume restored all {restart['parameters_restored']} of rank "
            f"0's parameters; {restart['bytes_not_read'] / 1e6:.1f} MB of the checkpoint not read "
            "(rank0_loader.skip_hf_load_on_resume)"
        )
    return "HF load run before the resume (rank0_loader.skip_hf_load_on_resume is off)"


def _baseline_run(
    steps: _Steps, strategies: Any, checkpoint: str, layout: Layout
) -> dict[str, Any]:
    _say(f"[4/4] the same model and layout loaded by {BASELINE} (every rank reads it all)")
    steps.run = BASELINE
    bench_layout = {"tp": layout.tp, "pp": layout.pp, "vpp": None, "ep": 1, "dtype": "float32"}
    steps("start Megatron + build model", strategies.build_model, checkpoint, bench_layout)
    steps("settle", strategies.settle)
    per_rank = steps.load("load", strategies.load, BASELINE, checkpoint, {})
    steps("finish", strategies.teardown)
    return {
        "implementation": strategies.IMPLEMENTATIONS[BASELINE],
        "seconds": max(r["wall_s"] for r in per_rank),
        "bytes_read": sum(r["bytes_read"] for r in per_rank),
    }


class _Steps:
    """Runs each step on every rank and records ``(run, name, start, end)`` on the sampler's clock.

    Around the loads it also reads the kernel's peak RSS of every rank (``VmHWM``,
    reset before the step): no sampling gap can hide a peak from it.
    """

    def __init__(self, pool: Any, sampler: Any, pids: list[int]) -> None:
        self.pool = pool
        self.sampler = sampler
        self.pids = pids
        self.run = ""
        self.records: list[tuple[str, str, float, float]] = []
        self.rank_peaks_added: dict[str, int] = {}
        """Per run: sum over the ranks of (peak RSS during its load - RSS before it)."""

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any) -> list[Any]:
        start = time.monotonic()
        out = self.pool.run(fn, *args)
        self.records.append((self.run, name, start, time.monotonic()))
        return out

    def load(self, name: str, fn: Callable[..., Any], *args: Any) -> list[Any]:
        from megastart.bench.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

        before = [rss_bytes(pid) for pid in self.pids]
        for pid in self.pids:
            reset_peak_rss(pid)
        out = self(name, fn, *args)
        peaks = [peak_rss_bytes(pid) for pid in self.pids]
        self.rank_peaks_added[self.run] = sum(p - b for p, b in zip(peaks, before, strict=True))
        return out

    def memory_during(self, run: str, name: str) -> tuple[int, int]:
        """Node memory at the start of step ``name`` of ``run``, and its peak during the step.

        The peak counts the start's level too: memory freed as the step begins
        (a collection, the previous step's buffers) would make the load look as
        if it added less than nothing.
        """
        (start, end) = next((s, e) for r, n, s, e in self.records if (r, n) == (run, name))
        timeline = self.sampler.timeline
        before = next((b for t, b in reversed(timeline) if t <= start), timeline[0][1])
        return before, max([before, *(b for t, b in timeline if start <= t <= end)])


def _load_row(steps: _Steps, name: str, seconds: float, bytes_read: int) -> dict[str, Any]:
    run = next(r for r, n, _, _ in steps.records if n == name)
    before, peak = steps.memory_during(run, name)
    return {
        "seconds": seconds,
        "node_peak_bytes": peak,
        "node_before_bytes": before,
        "added_bytes": peak - before,
        "rank_peaks_added_bytes": steps.rank_peaks_added[run],
        "bytes_read": bytes_read,
    }


def _reference_logits(checkpoint: str) -> tuple[Any, Any]:
    """A random prompt and the ``transformers`` model's fp32 logits for it (in this process)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    _say("computing reference logits with transformers (fp32)")
    transformers_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (1, LOGITS_TOKENS), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits.float()
    del model
    return input_ids, logits


def _compare(ours: Any, reference: Any) -> dict[str, Any]:
    diff = float((ours - reference).abs().max())
    same_argmax = bool((ours.argmax(-1) == reference.argmax(-1)).all())
    return {
        "tokens": LOGITS_TOKENS,
        "max_abs_diff": diff,
        "tolerance": LOGITS_ATOL,
        "same_argmax": same_argmax,
        "match": diff <= LOGITS_ATOL and same_argmax,
    }


def _checkpoint_bytes(checkpoint: str) -> int:
    return sum(
        os.path.getsize(os.path.join(checkpoint, f))
        for f in os.listdir(checkpoint)
        if f.endswith(".safetensors")
    )


def _hook_summary(ran: dict[str, Any], warmup: dict[str, Any] | None) -> str:
    plugins = ", ".join(ran["plugins"]) or "no plugin"
    report = ran["warmup"]
    if report is not None:
        return (
            f"{plugins} ran; comm_warmup warmed {len(report['groups'])} groups "
            f"[{', '.join(report['groups'])}] with {len(report['operations'])} operations "
            f"in {report['seconds']:.2f} s"
        )
    if warmup is not None:
        return f"{plugins} ran; nothing left to warm (once per process: done at {warmup['hook']})"
    if "comm_warmup" not in ran["plugins"]:
        return f"{plugins} ran (comm_warmup is blocked or megastart disabled)"
    return f"{plugins} ran; comm_warmup's 'when' setting selects the other hook"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
