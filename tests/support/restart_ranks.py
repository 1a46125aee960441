"""What each rank runs in the restart tests (:mod:`megastart.restart`): a real megatron-core
model on CPU over gloo, its HF load (megastart's loader) deferred, and a resume through
megatron-core's ``dist_checkpointing`` of a checkpoint saved in an earlier life."""

from __future__ import annotations

from typing import Any

import torch

from support.loader_ranks import build, megatron, settings


def hf_loaded(checkpoint: str, chunks: list[Any]) -> None:
    from megastart import load_hf_checkpoint

    load_hf_checkpoint(chunks, checkpoint, settings=settings())


def first_life(checkpoint: str, saved: str, layout: dict[str, int], drop: str = "") -> list[float]:
    """Load from HF, change the weights (a training step's worth), save a distributed
    checkpoint (without the sharded keys containing ``drop``, a checkpoint of another
    model); the parameters' sums."""
    import os

    from megatron.core import dist_checkpointing

    from megastart.demo.restart import _writer_processes_allowed
    from megastart.demo.train import cuda_factories_on_cpu

    with megatron(layout):
        chunks = build(checkpoint)
        hf_loaded(checkpoint, chunks)
        with torch.no_grad():
            for p in chunks[0].parameters():
                p.mul_(0.5).add_(0.25)  # not the HF weights: a resume must bring these back
        state = {"model0": chunks[0].sharded_state_dict()}
        state["model0"] = {k: v for k, v in state["model0"].items() if not (drop and drop in k)}
        os.makedirs(saved, exist_ok=True)
        with _writer_processes_allowed(), cuda_factories_on_cpu():
            dist_checkpointing.save(state, saved)
        return sums(chunks)


def second_life(
    checkpoint: str, saved: str, layout: dict[str, int], *, resume: bool, strict: str
) -> dict[str, Any]:
    """Build, defer the HF load, then resume from ``saved`` (``dist_checkpointing.load`` with
    ``strict``, as Megatron-LM's ``--dist-ckpt-strictness``; ``load_state_dict(strict=False)``)
    or, without ``resume``, take a forward's trigger: whether the HF load ran, the sums, the
    skip record, or the error."""
    from megatron.core import dist_checkpointing

    from megastart.restart import DEFERRALS, Deferred, last_skipped

    ran: list[str] = []
    with megatron(layout):
        chunks = build(checkpoint)
        owner = object.__new__(type("Engine", (), {}))

        def load() -> None:
            ran.append("hf")
            hf_loaded(checkpoint, chunks)

        deferred = Deferred(
            host="test", checkpoint=checkpoint, load=load, chunks=lambda: chunks, timeout_s=60
        )
        DEFERRALS.defer(owner, deferred)
        try:
            if resume:
                with DEFERRALS.resuming(owner, saved, restores_optimizer=False):
                    state = {"model0": chunks[0].sharded_state_dict()}
                    loaded = dist_checkpointing.load(state, saved, strict=strict)
                    chunks[0].load_state_dict(loaded["model0"], strict=False)
            DEFERRALS.run(owner, before="the first forward")
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "ran": ran}
        skip = last_skipped()
        return {"ran": ran, "sums": sums(chunks), "skip": skip and skip.bytes_not_read}


def sums(chunks: list[Any]) -> list[float]:
    return [float(p.detach().double().sum()) for c in chunks for p in c.parameters()]
