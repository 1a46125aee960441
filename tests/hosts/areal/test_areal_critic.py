"""AReaL 1.0.4's Megatron critic (``TrainEngineConfig.is_critic``) loads through
``on_model_load`` as a value model: the backbone from the HF checkpoint, AReaL's
``ValueHead`` as AReaL initialised it, or from AReaL's own ``value_head.pt`` where
AReaL saved one (2 ranks, TP2, real Megatron-core chunks over gloo)."""

from __future__ import annotations

import shutil

from areal_cpu import activated_pool

ENV = {"MEGASTART_BLOCKLIST": "comm_warmup"}


def _critic_values(checkpoint: str) -> dict:
    """A critic engine loaded through the hook: its values on the test tokens, its head
    before and after the load (``None`` off the last stage)."""
    from areal_ranks import VALUE_HEADS_BEFORE_LOAD, engine_on_cpu
    from support.loader_ranks import TOKENS

    from megastart.engines.base import unwrap_chunks
    from megastart.harness.model import forward_logits

    engine = engine_on_cpu(checkpoint, tp=2, critic=True)
    chunks = unwrap_chunks(list(engine.model))
    head = chunks[-1].output_layer.weight if chunks[-1].post_process else None
    return {
        "values": forward_logits(chunks, TOKENS, value_model=True),
        "before": VALUE_HEADS_BEFORE_LOAD[-1] if head is not None else None,
        "after": None if head is None else head.detach().clone(),
    }


def _save_value_head(checkpoint: str, out: str) -> None:
    """A critic whose head is set to 0.5, saved with AReaL's own ``save_critic_value_head``."""
    import torch
    from areal.models.mcore.hf_save import save_critic_value_head
    from areal_ranks import engine_on_cpu

    engine = engine_on_cpu(checkpoint, tp=2, critic=True)
    with torch.no_grad():
        for model in engine.model:
            if hasattr(model, "output_layer"):
                model.output_layer.weight.fill_(0.5)
    save_critic_value_head(engine.model, out)
    torch.distributed.barrier()


def test_a_critic_loads_its_backbone_through_on_model_load_and_keeps_areals_value_head(
    checkpoint, tmp_path
):
    from megastart_areal_probe import events
    from support.critic_ranks import reference_hidden_states

    log = tmp_path / "events.jsonl"
    with activated_pool({**ENV, "AREAL_PROBE_LOG": str(log)}) as ranks:
        results = ranks.run(_critic_values, checkpoint)
    hidden, _ = reference_hidden_states(checkpoint)
    for rank, out in enumerate(results):
        (load,) = [e for e in events(str(log)) if e["rank"] == rank]
        assert (load["event"], load["value_model"]) == ("on_model_load", True)
        assert out["after"] is not None  # TP2: both ranks are the last stage
        assert out["after"].equal(out["before"])
        diff = (out["values"] - hidden @ out["before"].T).abs().max().item()
        assert diff <= 1e-4, f"rank {rank}: max abs value difference {diff:.3g}"


def test_a_critic_takes_the_value_head_areal_saved_next_to_the_checkpoint(checkpoint, tmp_path):
    import torch

    saved = tmp_path / "critic"
    shutil.copytree(checkpoint, saved)
    with activated_pool(ENV) as ranks:
        ranks.run(_save_value_head, checkpoint, str(saved))
    assert (saved / "value_head.pt").is_file()
    with activated_pool(ENV) as ranks:
        results = ranks.run(_critic_values, str(saved))
    for out in results:
        assert torch.all(out["after"] == 0.5)
