"""Restarts skip the HF load they would overwrite (``rank0_loader.skip_hf_load_on_resume``, on
by default), on AReaL's real engine, recover handler and checkpoint manager: a restart whose
recover checkpoint restores every parameter never reads the HF checkpoint and ends with the
weights of a restart that read it; a fresh start still loads, before its first step (or its
first save). Prints what the skip saves (``pytest -s``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from areal_cpu import activated_pool

from megastart.harness.launch import RankPool

NO_SKIP = {"MEGASTART_RANK0_LOADER_SKIP_HF_LOAD_ON_RESUME": "0"}


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
    from areal_ranks import (
        HF_LOAD_SECONDS,
        engine_on_cpu,
        parameter_sums,
        save_recover_checkpoint,
    )

    engine = engine_on_cpu(checkpoint, tp=2, trainable=True)
    before = parameter_sums(engine)  # a fresh start defers too: its save runs the load first
    loaded = save_recover_checkpoint(engine, fileroot)
    assert loaded != before
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

    from megastart.restart import last_skipped

    engine_class = recording_engine_class()
    engine = engine_on_cpu(checkpoint, tp=2, engine_class=engine_class, trainable=True)
    record("initialized")
    if restart:
        recover(engine, fileroot)
    first_forward(engine)
    skip = last_skipped()
    return {
        "hf_load_s": HF_LOAD_SECONDS[-1],
        "after": parameter_sums(engine),
        "not_read": skip and skip.bytes_not_read,
    }


def test_restart_skips_the_hf_load_and_a_fresh_start_loads_before_its_first_step(
    large_checkpoint, tmp_path
):
    from megastart_areal_probe import events

    checkpoint = large_checkpoint
    fileroot = str(tmp_path / "fileroot")
    with pool({}) as ranks:
        first = ranks.run(_first_life, checkpoint, fileroot)
    skipped_log, loaded_log = tmp_path / "skipped.jsonl", tmp_path / "loaded.jsonl"
    with pool({"AREAL_PROBE_LOG": str(skipped_log)}) as ranks:
        skipped = ranks.run(_second_life, checkpoint, fileroot, True)
    with pool({**NO_SKIP, "AREAL_PROBE_LOG": str(loaded_log)}) as ranks:
        loaded = ranks.run(_second_life, checkpoint, fileroot, True)
    fresh_log = tmp_path / "fresh.jsonl"
    with pool({"AREAL_PROBE_LOG": str(fresh_log)}) as ranks:
        fresh = ranks.run(_second_life, checkpoint, fileroot, False)

    size = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    for rank in range(2):
        assert "on_model_load" not in [e["event"] for e in events(str(skipped_log))]
        assert "on_model_load" in [e["event"] for e in events(str(loaded_log))]
        assert skipped[rank]["after"] == loaded[rank]["after"] == first[rank]["loaded"]
        assert skipped[rank]["not_read"] == size and loaded[rank]["not_read"] is None
        order = [e["event"] for e in events(str(fresh_log)) if e["rank"] == rank]
        assert order.index("initialized") < order.index("on_model_load")
        assert order.index("on_model_load") < order.index("pre_first_step")
        assert fresh[rank]["after"] == first[rank]["loaded"]

    before, after = max(r["hf_load_s"] for r in loaded), max(r["hf_load_s"] for r in skipped)
    print(
        f"\nskip_hf_load_on_resume: a restart's initialize skipped the HF load of "
        f"{size / 2**20:.1f} MiB ({size} bytes of safetensors): {before:.3f} s -> {after:.3f} s "
        "(AReaL's engine, TP 2 on CPU)"
    )
