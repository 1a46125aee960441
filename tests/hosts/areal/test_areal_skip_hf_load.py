"""``skip_hf_load_on_recover``: a restart whose recover checkpoint restores every
parameter never reads the HF checkpoint; a fresh start still gets it, before its
first step. Prints what the skip saves (``pytest -s``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from areal_cpu import activated_pool

from megastart.harness.launch import RankPool

SKIP = {"MEGASTART_AREAL_SKIP_HF_LOAD_ON_RECOVER": "1"}


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory) -> str:
    """Large enough that the HF load's time is measurable next to the recover load's."""
    from megastart.harness.checkpoints import make_checkpoint

    out = tmp_path_factory.mktemp("hf")
    sizes = dict(hidden_size=256, intermediate_size=1024, vocab_size=8000, num_hidden_layers=4)
    return str(make_checkpoint("llama", out, **sizes))


def pool(env: dict[str, str]) -> RankPool:
    return activated_pool({"MEGASTART_BLOCKLIST": "comm_warmup", **env})


def _first_life(checkpoint: str, fileroot: str) -> dict:
    from areal_ranks import HF_LOAD_SECONDS, engine_on_cpu, parameter_sums, save_recover_checkpoint

    engine = engine_on_cpu(checkpoint, tp=2)
    loaded = parameter_sums(engine)
    save_recover_checkpoint(engine, fileroot)
    return {"hf_load_s": HF_LOAD_SECONDS[-1], "loaded": loaded}


def _second_life(checkpoint: str, fileroot: str, restart: bool) -> dict:
    from areal_ranks import (
        HF_LOAD_SECONDS,
        engine_on_cpu,
        first_forward,
        parameter_sums,
        recording_engine_class,
        recover,
    )
    from megastart_areal_probe import record

    engine = engine_on_cpu(checkpoint, tp=2, engine_class=recording_engine_class())
    record("initialized")
    before = parameter_sums(engine)
    if restart:
        recover(engine, fileroot)
    first_forward(engine)
    return {"hf_load_s": HF_LOAD_SECONDS[-1], "before": before, "after": parameter_sums(engine)}


def test_restart_skips_the_hf_load_and_a_fresh_start_still_loads(large_checkpoint, tmp_path):
    from megastart_areal_probe import events

    checkpoint = large_checkpoint

    fileroot = str(tmp_path / "fileroot")
    with pool({}) as ranks:
        first = ranks.run(_first_life, checkpoint, fileroot)
    log = tmp_path / "restart.jsonl"
    with pool({**SKIP, "AREAL_PROBE_LOG": str(log)}) as ranks:
        restart = ranks.run(_second_life, checkpoint, fileroot, True)
    fresh_log = tmp_path / "fresh.jsonl"
    with pool({**SKIP, "AREAL_PROBE_LOG": str(fresh_log)}) as ranks:
        fresh = ranks.run(_second_life, checkpoint, fileroot, False)

    for rank in range(2):
        restarted = [e["event"] for e in events(str(log)) if e["rank"] == rank]
        assert "on_model_load" not in restarted  # the HF checkpoint was never read
        assert restart[rank]["after"] == pytest.approx(first[rank]["loaded"])
        fresh_events = [e["event"] for e in events(str(fresh_log)) if e["rank"] == rank]
        assert fresh_events.index("initialized") < fresh_events.index("on_model_load")
        assert fresh_events.index("on_model_load") < fresh_events.index("pre_first_step")
        assert fresh[rank]["after"] == pytest.approx(first[rank]["loaded"])
        assert fresh[rank]["before"] != pytest.approx(first[rank]["loaded"])

    size = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    saved = max(r["hf_load_s"] for r in first) - max(r["hf_load_s"] for r in restart)
    print(
        f"\nskip_hf_load_on_recover: restart initialize skipped the HF load of "
        f"{size / 2**20:.1f} MiB ({size} bytes of safetensors): "
        f"{max(r['hf_load_s'] for r in first):.3f} s -> "
        f"{max(r['hf_load_s'] for r in restart):.3f} s (saved {saved:.3f} s, TP 2 on CPU)"
    )
