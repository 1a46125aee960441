"""Rank functions for test_harness.py (module-level, so RankPool can pickle them)."""

from __future__ import annotations

from typing import Any

import torch


def reference_copy_logits(
    hf_config: Any,
    hf_state: dict[str, torch.Tensor],
    layout: dict[str, int],
    tokens: torch.Tensor,
    **config_overrides: Any,
) -> torch.Tensor:
    """Build this rank's chunks, copy the HF weights in by the reference copier, forward."""
    from megastart.harness.cpu import destroy_megatron, initialize_megatron
    from megastart.harness.model import build_gpt_chunks, forward_logits
    from support.reference_copy import copy_hf_weights

    initialize_megatron(**layout)
    try:
        chunks = build_gpt_chunks(hf_config, **config_overrides)
        copy_hf_weights(chunks, hf_state)
        return forward_logits(chunks, tokens)
    finally:
        destroy_megatron()


def shims_during_and_after() -> tuple[str, bool, bool]:
    """What Megatron sees as the current device inside a layout, and whether destroy undid all."""
    from megatron.core import parallel_state

    from megastart.harness.cpu import destroy_megatron, initialize_megatron

    original_cuda = torch.Tensor.cuda
    initialize_megatron(tp=2)
    during = torch.cuda.current_device()
    destroy_megatron()
    restored = (
        torch.cuda.current_device.__module__ == "torch.cuda" and torch.Tensor.cuda is original_cuda
    )
    return during, restored, parallel_state.model_parallel_is_initialized()
