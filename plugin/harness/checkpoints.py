"""Random Hugging Face checkpoints of the supported architectures, for tests, demo and benchmarks.

:func:`small_config` is a model of well under a megabyte whose every weight
matters to the logits (norm weights and biases are not left at 1 and 0, so a
loader that swaps or drops one is caught); :func:`scaled_config` sizes a bf16
model to a byte budget (a ~300 MB demo, ~1 GB benchmarks).
:func:`make_checkpoint` writes either with ``save_pretrained``: safetensors,
sharded with an index, exactly as the hub's files are laid out (transformers 5
keeps MoE experts fused in memory but writes one tensor per expert).
"""

from __future__ import annotations

import bisect
import copy
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
"""The ``model_type`` of each supported architecture and its transformers class."""

SMALL_SIZE: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=128,
)
"""The size of :func:`small_config`'s models, for tiny checkpoints of other architectures."""

_SHARDS = 4
"""How many files :func:`make_checkpoint` splits a checkpoint into by default."""


def small_config(
    arch: str, *, tie_word_embeddings: bool = False, **overrides: Any
) -> PretrainedConfig:
    """A tiny fp32 config of ``arch``: 4 layers, hidden 64, 8 heads in 4 KV groups, vocab 300.

    The vocabulary is not a multiple of 128, so Megatron pads it; Qwen3 and
    Mistral get ``head_dim=16`` (not hidden / heads), so ``kv_channels`` matters.
    ``overrides`` replace any config field (e.g. ``num_key_value_heads=8``).
    """
    fields: dict[str, Any] = dict(
        SMALL_SIZE,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        dtype="float32",
    )
    if arch in ("qwen3", "qwen3_moe", "mistral"):
        fields.update(head_dim=16)
    if arch == "mistral":
        fields.update(sliding_window=None)
    if arch == "deepseek_v3":  # MLA, with a low-rank query (q_lora_rank=None: a plain one)
        fields.update(
            num_key_value_heads=8,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        )
    if arch == "glm4_moe":  # as GLM-4.5: biased q/k/v, Q/K norms, rotary on half of each head
        fields.update(head_dim=16, attention_bias=True, use_qk_norm=True)
    experts = 8 if arch in ("deepseek_v3", "glm4_moe") else 4
    fields.update(_moe_fields(arch, fields["hidden_size"], experts=experts))
    return _config(arch, tie_word_embeddings=tie_word_embeddings, **{**fields, **overrides})


def scaled_config(
    arch: str, target_bytes: int, *, tie_word_embeddings: bool = False, dtype: str = "bfloat16"
) -> PretrainedConfig:
    """A config of ``arch`` whose weights take about ``target_bytes`` in ``dtype``.

    8 layers, 16 heads in 4 KV groups, a 32000-token vocabulary; the hidden size
    (a multiple of 64 from 256 up) is the one that comes closest to the budget.
    """
    item = 2 if dtype in ("bfloat16", "float16") else 4

    def config(hidden: int) -> PretrainedConfig:
        fields: dict[str, Any] = dict(
            vocab_size=32000,
            hidden_size=hidden,
            intermediate_size=_multiple(hidden * 8 // 3, 128),
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=hidden // 16,
            max_position_embeddings=4096,
            dtype=dtype,
        )
        if arch == "mistral":
            fields.update(sliding_window=None)
        fields.update(_moe_fields(arch, hidden, experts=8))
        return _config(arch, tie_word_embeddings=tie_word_embeddings, **fields)

    def size(hidden: int) -> int:
        return parameter_count(config(hidden)) * item

    grid = range(256, 16385, 64)
    above = bisect.bisect_left(grid, target_bytes, key=size)  # size grows with hidden
    candidates = grid[max(above - 1, 0) : above + 1]
    return config(min(candidates, key=lambda h: abs(size(h) - target_bytes)))


def make_checkpoint(
    arch: str | PretrainedConfig,
    out_dir: str | Path,
    *,
    tie_word_embeddings: bool = False,
    max_shard_size: int | str | None = None,
    seed: int = 0,
    reward_model: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a random ``transformers`` model as a sharded safetensors checkpoint.

    :param arch: a key of :data:`ARCHITECTURES` (then :func:`small_config` with
        ``tie_word_embeddings`` and ``config_overrides``), or a ready config
        (e.g. from :func:`scaled_config`; the other two must then be left out).
    :param out_dir: created if missing.
    :param max_shard_size: as ``save_pretrained`` takes it; by default a quarter
        of the model, so there are always several files and an index.
    :param seed: the weights are a function of the config and the seed.
    :param reward_model: write a reward model instead of a causal LM: the
        architecture's ``*ForSequenceClassification`` with one label (the
        decoder and a ``score.weight`` of ``[1, hidden]``, no LM head).
    :returns: ``out_dir``, holding ``config.json``, ``model-*.safetensors`` and
        ``model.safetensors.index.json``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4 (verl 0.7's, mbridge's) keeps it in modeling_utils
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]

    if isinstance(arch, str):
        config = small_config(arch, tie_word_embeddings=tie_word_embeddings, **config_overrides)
    elif tie_word_embeddings or config_overrides:
        raise TypeError(
            "make_checkpoint: pass tie_word_embeddings and config overrides to "
            "small_config/scaled_config when giving a config, not here"
        )
    else:
        config = arch
    dtype = getattr(torch, str(config.dtype or "float32").removeprefix("torch."))
    auto = AutoModelForSequenceClassification if reward_model else AutoModelForCausalLM
    if reward_model:
        config = copy.deepcopy(config)
        config.num_labels = 1
    with no_init_weights():  # _randomize writes every weight once; skip the default init
        model = auto.from_config(config, dtype=dtype)
    _randomize(model, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        max_shard_size = max(total // _SHARDS + 1, 1024)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    return out


def parameter_count(config: PretrainedConfig) -> int:
    """The model's parameter count, from a skeleton on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _config(arch: str, **fields: Any) -> PretrainedConfig:
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    return AutoConfig.for_model(arch, architectures=[ARCHITECTURES[arch]], **fields)


def _moe_fields(arch: str, hidden: int, *, experts: int) -> dict[str, Any]:
    """Experts, top-2 routing and expert sizes in the spelling each architecture reads."""
    if arch == "mixtral":  # experts are full-size MLPs; top-k weights always renormalised
        return dict(num_local_experts=experts, num_experts_per_tok=2)
    if arch == "qwen3_moe":  # as Qwen3-30B-A3B: renormalised top-k
        return dict(
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            norm_topk_prob=True,
        )
    if arch in ("deepseek_v3", "glm4_moe"):  # sigmoid routing in 2 groups, first layer dense
        return dict(
            n_routed_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
    if arch == "qwen2_moe":  # as Qwen1.5-MoE: plain top-k of the softmax, gated shared expert
        return dict(
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden,
            norm_topk_prob=False,
        )
    return {}


def _randomize(model: Any, seed: int) -> None:
    """Every weight random: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator).to(param.dtype)
            if param.dim() >= 2:
                param.copy_(noise.mul_(1 / math.sqrt(param.shape[-1])))
            elif "norm" in name:
                param.copy_(noise.mul_(0.1).add_(1))
            else:
                param.copy_(noise.mul_(0.1))
        for name, buffer in model.named_buffers():  # DeepSeek's router bias is model state
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator).mul_(0.1))
        # Other buffers (rotary inverse frequencies) are computed at construction: leave them.
    model.tie_weights()
    model.eval()


def _multiple(value: int, multiple: int) -> int:
    return max(multiple, value // multiple * multiple)
