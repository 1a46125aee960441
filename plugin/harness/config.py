"""A ``transformers`` config as Megatron-core's ``TransformerConfig``: the sizes, attention,
rotary embedding and MoE fields of the model types the harness builds
(:data:`SUPPORTED_MODEL_TYPES`), for :mod:`megastart.harness.model`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer import TransformerConfig

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
"""Megatron-LM's default: the embedding is padded to a multiple of this times TP."""

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "deepseek_v3",
    "glm4_moe",
)

MLA_MODEL_TYPES = ("deepseek_v3",)
"""Models with multi-latent attention, built with :class:`megastart.harness.attention.CausalAttention`."""


def padded_vocab_size(vocab_size: int) -> int:
    """The embedding rows Megatron allocates: ``vocab_size`` rounded up to 128 * TP."""
    from megatron.core import parallel_state

    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * parallel_state.get_tensor_model_parallel_world_size()
    return -(-vocab_size // multiple) * multiple


def rotary_percent(hf_config: Any) -> float:
    """The share of each head's dims that rotary embeddings turn (GLM-4.5: half)."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return float(
        parameters.get("partial_rotary_factor")
        or getattr(hf_config, "partial_rotary_factor", None)
        or 1.0
    )


def rope_theta(hf_config: Any) -> float:
    """The rotary base, from ``rope_theta`` or ``rope_parameters`` (transformers 5)."""
    # transformers 5 keeps theta and scaling in rope_parameters; 4.x in rope_theta / rope_scaling.
    parameters = (
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(
            f"{hf_config.model_type}: rope scaling {parameters} is not supported by the "
            "CPU demo model; use rope_type 'default'"
        )
    theta = getattr(hf_config, "rope_theta", None) or parameters.get("rope_theta")
    if theta is None:
        raise ValueError(
            f"{hf_config.model_type}: config has neither rope_theta nor rope_parameters"
        )
    return float(theta)


def transformer_config(hf_config: Any, *, dtype: torch.dtype) -> TransformerConfig:
    """Megatron's TransformerConfig for ``hf_config`` under the current parallel state."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"build_gpt_chunks: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if hf_config.hidden_act != "silu":
        raise NotImplementedError(f"{model_type}: hidden_act {hf_config.hidden_act!r} (only silu)")
    biased = getattr(hf_config, "attention_bias", False) and model_type != "glm4_moe"
    if biased or getattr(hf_config, "mlp_bias", False):
        raise NotImplementedError(
            f"{model_type}: attention_bias/mlp_bias add an o_proj/MLP bias, "
            "which the CPU demo model does not build"
        )
    heads = hf_config.num_attention_heads
    config_class: Any = TransformerConfig
    mla: dict[str, Any] = {}
    if model_type in MLA_MODEL_TYPES:
        from megatron.core.transformer import MLATransformerConfig

        config_class = MLATransformerConfig
        mla = dict(
            q_lora_rank=hf_config.q_lora_rank,
            kv_lora_rank=hf_config.kv_lora_rank,
            qk_head_dim=hf_config.qk_nope_head_dim,
            qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
            rope_type="rope",
            rotary_base=rope_theta(hf_config),
            rotary_scaling_factor=1.0,
        )
    return config_class(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=_has_qkv_bias(hf_config),
        qk_layernorm=_has_qk_norm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        **_moe_fields(hf_config),
        **mla,
    )


def _has_qkv_bias(hf_config: Any) -> bool:
    if hf_config.model_type == "qwen2":  # always biased: the config has no switch
        return True
    if hf_config.model_type == "glm4_moe":  # q/k/v biased, o_proj not
        return bool(hf_config.attention_bias)
    return bool(getattr(hf_config, "qkv_bias", False))


def _has_qk_norm(hf_config: Any) -> bool:
    """Q/K norms (Qwen3; GLM-4.5 with ``use_qk_norm``); MLA's norms of the latents use the
    same switch in Megatron."""
    model_type = hf_config.model_type
    if model_type == "glm4_moe":
        return bool(hf_config.use_qk_norm)
    return model_type in ("qwen3", "qwen3_moe", *MLA_MODEL_TYPES)


def _moe_fields(hf_config: Any) -> dict[str, Any]:
    """TransformerConfig's MoE fields: sequential experts, allgather dispatch, HF's routing."""
    if hasattr(hf_config, "n_routed_experts"):
        return _sigmoid_moe_fields(hf_config)
    experts = getattr(hf_config, "num_experts", None) or getattr(
        hf_config, "num_local_experts", None
    )
    if not experts:
        return {}
    layers = hf_config.num_hidden_layers
    sparse_step = getattr(hf_config, "decoder_sparse_step", None) or 1
    dense_layers = set(getattr(hf_config, "mlp_only_layers", None) or ())
    moe_layers = [int(i not in dense_layers and (i + 1) % sparse_step == 0) for i in range(layers)]
    fields: dict[str, Any] = dict(
        num_moe_experts=experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=(
            hf_config.intermediate_size  # Mixtral's experts are full-size MLPs
            if hf_config.model_type == "mixtral"
            else hf_config.moe_intermediate_size
        ),
        moe_layer_freq=moe_layers,
        # Mixtral always renormalises the top-k weights; Qwen does when norm_topk_prob.
        # Softmax over the top-k logits is exactly that; pre-softmax is plain top-k.
        moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", True),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
    )
    shared = getattr(hf_config, "shared_expert_intermediate_size", None)
    if shared:
        fields.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return fields


def _sigmoid_moe_fields(hf_config: Any) -> dict[str, Any]:
    """DeepSeek-V3 and GLM-4.5's MoE: a sigmoid router with an expert bias, routing within the
    best groups, renormalised top-k times ``routed_scaling_factor``, always-on shared experts,
    the first ``first_k_dense_replace`` layers dense."""
    dense = hf_config.first_k_dense_replace
    return dict(
        num_moe_experts=hf_config.n_routed_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_layer_freq=[int(i >= dense) for i in range(hf_config.num_hidden_layers)],
        moe_shared_expert_intermediate_size=(
            hf_config.moe_intermediate_size * hf_config.n_shared_experts
        ),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=hf_config.routed_scaling_factor,
        moe_router_num_groups=hf_config.n_group,
        moe_router_group_topk=hf_config.topk_group,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
    )
