"""Test-only reference: copy a ``transformers`` model's weights into Megatron GPTModel chunks.

Deliberately plain and independent of ``megastart.loader``: it walks this rank's
Megatron modules and slices the full HF tensors the textbook way. Matching
logits after this copy is what proves ``megastart.harness.model.forward_logits``
right, and it gives the loader's tests a second opinion.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps


def copy_hf_weights(chunks: list, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy ``hf_state`` (a transformers ``state_dict``, experts fused) into this rank's chunks."""
    config = chunks[0].hf_config
    tied = bool(config.tie_word_embeddings)
    with torch.no_grad():
        for chunk in chunks:
            if chunk.pre_process:
                _copy(
                    chunk.embedding.word_embeddings.weight,
                    _vocab_shard(chunk, hf_state["model.embed_tokens.weight"]),
                )
            for layer in chunk.decoder.layers:
                _copy_layer(layer, config, hf_state, f"model.layers.{layer.layer_number - 1}.")
            if chunk.post_process:
                _copy(chunk.decoder.final_layernorm.weight, hf_state["model.norm.weight"])
                if chunk.output_layer.weight is not None:
                    head = hf_state["model.embed_tokens.weight" if tied else "lm_head.weight"]
                    _copy(chunk.output_layer.weight, _vocab_shard(chunk, head))


def _copy_layer(layer, config, hf: dict[str, torch.Tensor], p: str) -> None:
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    attn = layer.self_attention
    _copy(layer.input_layernorm.weight, hf[p + "input_layernorm.weight"])
    _copy(layer.pre_mlp_layernorm.weight, hf[p + "post_attention_layernorm.weight"])
    heads = config.num_attention_heads
    groups = config.num_key_value_heads
    for suffix in ("weight", "bias"):
        if p + f"self_attn.q_proj.{suffix}" in hf:
            qkv = _fuse_qkv(*(hf[p + f"self_attn.{n}_proj.{suffix}"] for n in "qkv"), heads, groups)
            _copy(getattr(attn.linear_qkv, suffix), qkv.chunk(tp, dim=0)[tp_rank])
    _copy(attn.linear_proj.weight, hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank])
    if p + "self_attn.q_norm.weight" in hf:
        _copy(attn.q_layernorm.weight, hf[p + "self_attn.q_norm.weight"])
        _copy(attn.k_layernorm.weight, hf[p + "self_attn.k_norm.weight"])
    mlp = layer.mlp
    if not hasattr(mlp, "router"):
        _copy_mlp(mlp, hf, p + "mlp.", tp, tp_rank)
        return
    _copy(mlp.router.weight, hf[p + "mlp.gate.weight"])
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    local = mlp.experts.local_experts
    first = ps.get_expert_model_parallel_rank() * len(local)
    gate_up, down = hf[p + "mlp.experts.gate_up_proj"], hf[p + "mlp.experts.down_proj"]
    for j, expert in enumerate(local):
        gate, up = gate_up[first + j].chunk(2, dim=0)
        fc1 = torch.cat([gate.chunk(etp, dim=0)[etp_rank], up.chunk(etp, dim=0)[etp_rank]])
        _copy(expert.linear_fc1.weight, fc1)
        _copy(expert.linear_fc2.weight, down[first + j].chunk(etp, dim=1)[etp_rank])
    if p + "mlp.shared_expert.gate_proj.weight" in hf:
        _copy_mlp(mlp.shared_experts, hf, p + "mlp.shared_expert.", tp, tp_rank)
        _copy(mlp.shared_experts.gate_weight, hf[p + "mlp.shared_expert_gate.weight"])


def _copy_mlp(mlp, hf: dict[str, torch.Tensor], p: str, tp: int, tp_rank: int) -> None:
    gate = hf[p + "gate_proj.weight"].chunk(tp, dim=0)[tp_rank]
    up = hf[p + "up_proj.weight"].chunk(tp, dim=0)[tp_rank]
    _copy(mlp.linear_fc1.weight, torch.cat([gate, up]))
    _copy(mlp.linear_fc2.weight, hf[p + "down_proj.weight"].chunk(tp, dim=1)[tp_rank])


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int
) -> torch.Tensor:
    """Megatron's QKV layout: for each query group, its query heads, then its key, then its value."""
    q = q.reshape(groups, heads // groups * (q.shape[0] // heads), *q.shape[1:])
    k = k.reshape(groups, k.shape[0] // groups, *k.shape[1:])
    v = v.reshape(groups, v.shape[0] // groups, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _vocab_shard(chunk, full: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(chunk.vocab_size, full.shape[1], dtype=full.dtype)
    padded[: full.shape[0]] = full
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return padded.chunk(tp, dim=0)[tp_rank]


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    if param.shape != value.shape:
        raise ValueError(
            f"reference copy: parameter {tuple(param.shape)} vs HF {tuple(value.shape)}"
        )
    param.copy_(value)
