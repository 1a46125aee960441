"""Attention for multi-latent attention (MLA) models on CPU: test and demo support only.

Megatron-core's MLA builds its core attention with keys wider than values
(``k_channels``, ``v_channels``), which only Transformer Engine's attention takes;
its local ``DotProductAttention`` does not, and Transformer Engine has no CPU
build. :class:`CausalAttention` is plain causal softmax attention with those
dims, which :func:`megastart.harness.model.build_gpt_chunks` puts in an MLA layer
spec. It is the textbook computation, as ``transformers``' eager attention does it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from megatron.core.transformer.module import MegatronModule

if TYPE_CHECKING:
    import torch


class CausalAttention(MegatronModule):
    """``softmax(q k^T * scale, causal) v`` per head; [s, b, heads, dim] in, [s, b, heads * v] out."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels or config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        import torch

        seq, batch, heads, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, h, s, d]
        scores = q @ k.transpose(-1, -2) * self.softmax_scale
        future = torch.ones(seq, key.shape[0], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [b, h, s, v]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * v.shape[-1]).to(query.dtype)
