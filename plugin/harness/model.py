"""This rank's Megatron-core GPTModel chunks for a ``transformers`` config, and a CPU forward.

:func:`build_gpt_chunks` translates a Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE
/ Qwen2-MoE / Mixtral config (as ``transformers.AutoConfig`` loads it) into a
Megatron ``TransformerConfig`` (:mod:`megastart.harness.config`) and builds the chunks this rank owns, with
random weights. :func:`forward_logits` runs them as one pipeline and returns
the full logits on every rank, so a test can compare them with the
``transformers`` model's. Call both inside a rank set up by
:func:`megastart.harness.cpu.initialize_megatron`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megastart.harness.config import (
    padded_vocab_size,
    rope_theta,
    rotary_percent,
    transformer_config,
)

if TYPE_CHECKING:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig


def build_gpt_chunks(
    hf_config: Any,
    *,
    dtype: torch.dtype | None = None,
    layer_spec: str = "local",
    **config_overrides: Any,
) -> list[GPTModel]:
    """Build this rank's GPTModel chunks (one per virtual pipeline stage) for ``hf_config``.

    The sizes come from Megatron's parallel state, so call
    :func:`megastart.harness.cpu.initialize_megatron` first. Weights are random
    (``use_cpu_initialization=True``, seeded there); the embedding and output
    layer are padded to :func:`padded_vocab_size` rows.

    :param hf_config: a ``transformers`` config (``AutoConfig.from_pretrained``)
        of one of :data:`~megastart.harness.config.SUPPORTED_MODEL_TYPES`.
    :param dtype: parameter dtype (default ``torch.float32``).
    :param layer_spec: ``"local"`` (Megatron-core's own modules), or
        ``"transformer_engine"`` on a GPU: TE's specs as hosts build them (norms fused
        into the linears, grouped-GEMM experts), initialised on the current CUDA device.
    :param config_overrides: TransformerConfig fields to replace, e.g.
        ``num_layers_in_first_pipeline_stage=1`` for uneven pipeline stages, or
        ``mtp_num_layers=1`` for DeepSeek-V3's multi-token-prediction layer (on the last
        stage; not run by :func:`forward_logits`).
    :returns: the chunks in virtual-stage order, each in eval mode.
    """
    import dataclasses

    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    te = layer_spec == "transformer_engine"
    if not te and layer_spec != "local":
        raise ValueError(f"build_gpt_chunks: {layer_spec=}: 'local' or 'transformer_engine'")
    config = transformer_config(hf_config, dtype=dtype or torch.float32)
    if te:
        grouped = bool(config.num_moe_experts)
        config = dataclasses.replace(config, use_cpu_initialization=False, moe_grouped_gemm=grouped)
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp_size or 1):
        stage = None if vpp_size is None else vp_stage
        spec = te_block_spec(config, stage) if te else cpu_block_spec(config, stage)
        last = pp_rank == pp_size - 1 and vp_stage == (vpp_size or 1) - 1
        mtp = None
        if config.mtp_num_layers and last:  # as DeepSeek-V3's: the decoder's last layer's spec
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=te)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(hf_config.vocab_size),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pp_rank == 0 and vp_stage == 0,
            post_process=last,
            share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            position_embedding_type="rope",
            rotary_base=rope_theta(hf_config),
            rotary_percent=rotary_percent(hf_config),
            mtp_block_spec=mtp,
            vp_stage=stage,
        )
        if te:  # as Megatron's get_model: the router's weight is made on the CPU
            chunk.cuda(torch.cuda.current_device())
        chunk.hf_config = hf_config  # what forward_logits and loaders map back to
        chunks.append(chunk.eval())
    return chunks


def cpu_block_spec(config: TransformerConfig, vp_stage: int | None = None) -> Any:
    """Megatron's local layer specs per layer of this stage (dense and MoE layers where the
    config puts them), multi-latent attention with :class:`~megastart.harness.attention.
    CausalAttention` (its only core attention without Transformer Engine)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage
    )
    if config.multi_latent_attention:
        from megastart.harness.attention import CausalAttention

        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = CausalAttention
    return spec


def te_block_spec(config: TransformerConfig, vp_stage: int | None = None) -> Any:
    """Transformer Engine's layer specs per layer of this stage, as the hosts build them."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=True, normalization=config.normalization, vp_stage=vp_stage
    )


def forward_logits(
    chunks: list[GPTModel], input_ids: torch.Tensor, *, value_model: bool = False
) -> torch.Tensor:
    """Run ``chunks`` as one pipeline on ``input_ids``; the full logits on every rank.

    Every rank passes the same ``input_ids`` ([batch, seq], int64). Stages run
    one after another (virtual stages interleaved as Megatron places them:
    global stage ``v * pp + r`` is chunk ``v`` of pipeline rank ``r``); hidden
    states travel by blocking send/recv over the pipeline group; the last stage
    gathers the vocab-parallel logits over TP, drops the vocab padding, and
    broadcasts them over the pipeline group.

    Causal attention, positions ``0..seq-1``, no sliding window (Mistral's window
    only matters for sequences longer than it).

    :param value_model: the last stage's ``output_layer`` is a one-output value head.
    :returns: fp32 logits, [batch, seq, hf_vocab_size] (a value model's values:
        [batch, seq, 1]), identical on every rank.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() != 1:
        raise NotImplementedError("forward_logits: context parallelism is not supported")
    config = chunks[0].config
    batch, seq = input_ids.shape
    width = 1 if value_model else chunks[0].vocab_size
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    pp_size, pp_rank = len(pp_ranks), parallel_state.get_pipeline_model_parallel_rank()
    device = input_ids.device  # the CPU, or the GPU of TE models
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    # True = masked, as Megatron-LM's get_ltor_masks_and_position_ids makes it; without
    # one, Megatron's local attention builds its default causal mask on "cuda".
    causal_mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(diagonal=1)
    hidden_shape = (seq, batch, config.hidden_size)
    stages = pp_size * len(chunks)
    logits = None
    with torch.no_grad():
        for stage in range(stages):
            owner, chunk_index = stage % pp_size, stage // pp_size
            if owner != pp_rank:
                continue
            chunk = chunks[chunk_index]
            if stage > 0:
                hidden = torch.empty(hidden_shape, dtype=config.params_dtype, device=device)
                dist.recv(hidden, src=pp_ranks[(owner - 1) % pp_size], group=pp_group)
                chunk.set_input_tensor(hidden)
            output = chunk(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=causal_mask,
                runtime_gather_output=True,
            )
            if stage < stages - 1:
                dist.send(output.contiguous(), dst=pp_ranks[(owner + 1) % pp_size], group=pp_group)
            else:
                logits = output.float()
        if logits is None:
            logits = torch.empty((batch, seq, width), dtype=torch.float32, device=device)
        dist.broadcast(logits, src=pp_ranks[-1], group=pp_group)
    return logits if value_model else logits[..., : chunks[0].hf_config.vocab_size].contiguous()
