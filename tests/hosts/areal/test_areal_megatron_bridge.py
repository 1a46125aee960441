"""AReaL's Megatron-Bridge path (``actor.megatron.bridge_type=megatron-bridge``) with the
AReaL adapter and, beneath it, the Megatron-Bridge library adapter attached: one hook
call per event, each with AReaL's context, and the weights bit for bit what the bridge's
own ``load_hf_weights`` writes (2 ranks, TP 2, gloo)."""

from __future__ import annotations

import torch
from areal_cpu import activated_pool

BRIDGE_LOADER = "megatron.bridge.models.conversion.model_bridge"


def _through_megatron_bridge(checkpoint: str, fileroot: str) -> dict:
    """AReaL's engine loads through megastart's rank0_loader, then through AReaL's own
    loader (Megatron-Bridge's ``load_hf_weights``), then the bridge loads by itself;
    then a save, a recover and the first step, as in ``test_areal_recover``."""
    import logging
    import os

    from areal_ranks import (
        engine_on_cpu,
        first_forward,
        parameter_sums,
        recording_engine_class,
        recover,
        save_recover_checkpoint,
        zero_parameters,
    )
    from megastart_areal_probe import record
    from support.bridge_ranks import poison, state

    from megastart.engines import adapters
    from megastart.engines.base import answering
    from megastart.manager import reset

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("megastart")
    level = logger.level
    logger.setLevel(logging.INFO)  # the hook calls' summary lines (rank 0)
    logger.addHandler(handler)
    engine = engine_on_cpu(
        checkpoint, tp=2, engine_class=recording_engine_class(), bridge_type="megatron-bridge"
    )
    chunks = list(engine.model)
    weights = {"rank0_loader": state(chunks)}
    os.environ["MEGASTART_BLOCKLIST"] = "rank0_loader,comm_warmup"  # AReaL's loader loads
    reset()
    poison(chunks)
    record("areal_loader")
    with engine.device:
        engine._load_model_from_hf(checkpoint)
    weights["areal"] = state(chunks)
    poison(chunks)
    record("bridge_alone")
    with answering("on_model_load"):  # no adapter answers: the bridge's own load
        engine.bridge.load_hf_weights(engine.model, hf_path=checkpoint)
    weights["bridge"] = state(chunks)
    saved = save_recover_checkpoint(engine, fileroot)
    zero_parameters(engine)
    record("weights.zeroed")
    recover(engine, fileroot)
    logger.removeHandler(handler)
    logger.setLevel(level)
    return {
        "loads": [line for line in lines if line.startswith("megastart: on_model_load ")],
        "attached": sorted(name for name, a in adapters().items() if a.attached),
        "weights": weights,
        "saved": saved,
        "restored": parameter_sums(engine),
        "forward": first_forward(engine),
    }


def test_one_hook_call_per_event_on_areals_megatron_bridge_path(checkpoint, tmp_path):
    from megastart_areal_probe import events

    log = tmp_path / "events.jsonl"
    env = {"MEGASTART_BLOCKLIST": "comm_warmup", "AREAL_PROBE_LOG": str(log)}
    with activated_pool(env) as ranks:
        results = ranks.run(_through_megatron_bridge, checkpoint, str(tmp_path / "fileroot"))
    for rank, out in enumerate(results):
        assert "areal.engine.megatron_engine" in out["attached"]
        assert BRIDGE_LOADER in out["attached"]  # beneath AReaL's loader, passing through
        seen = [e for e in events(str(log)) if e["rank"] == rank]
        names = [e["event"] for e in seen]
        print(f"rank {rank}: {names}; AReaL forward_batch on CPU: {out['forward']}")
        # one on_model_load per load through AReaL, none for the bridge's own load
        assert names[:6] == [
            "on_model_load",  # megastart's rank0_loader loads
            "areal_loader",
            "on_model_load",  # AReaL's loader (the bridge's load_hf_weights) loads
            "bridge_alone",
            "weights.zeroed",
            "post_recover_load",
        ]
        assert names.count("pre_first_step") == 1 and names.index("pre_first_step") > 5
        hooks = [e for e in seen if e["event"] in ("on_model_load", "post_recover_load")]
        assert {e["host"] for e in hooks} == {"areal"}  # AReaL's context, not the bridge's
        assert [e["is_restart"] for e in hooks] == [False, False, True]
        assert [e["host"] for e in seen if e["event"] == "pre_first_step"] == ["areal"]
        if rank == 0:  # megastart's loader read once, then AReaL's loader (the bridge) ran
            ours, areals = out["loads"]
            assert ours.startswith("megastart: on_model_load rank0_loader:"), ours
            assert "read by rank(s) [0]" in ours, ours
            assert "not handled by any plugin" in areals, areals
        assert out["restored"] == out["saved"]
        weights = out["weights"]
        assert weights["bridge"].keys() == weights["rank0_loader"].keys() == weights["areal"].keys()
        for name, tensor in weights["bridge"].items():
            assert not tensor.isnan().any(), f"rank {rank}: {name} left unloaded"
            assert torch.equal(weights["rank0_loader"][name], tensor), name
            assert torch.equal(weights["areal"][name], tensor), name
