"""mbridge on CPU: Megatron-core's local layer spec instead of Transformer Engine's (which has
no CPU build), and the local spec's two layer norms in mbridge's Qwen2 name table (which knows
only Transformer Engine's fused names), so mbridge's own HF loader runs to the end."""

from __future__ import annotations

from typing import Any


def use_local_spec_in_mbridge() -> None:
    from mbridge.core.llm_bridge import LLMBridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def local_spec(self: Any, vp_stage: int | None = None) -> Any:
        return get_gpt_decoder_block_spec(
            self.config, use_transformer_engine=False, vp_stage=vp_stage
        )

    LLMBridge._get_transformer_layer_spec = local_spec
    layer = "model.layers.{layer_number}"
    Qwen2Bridge._OTHER_MAPPING = {"input_layernorm.weight": [f"{layer}.input_layernorm.weight"]}
    Qwen2Bridge._MLP_MAPPING = {
        **Qwen2Bridge._MLP_MAPPING,
        "pre_mlp_layernorm.weight": [f"{layer}.post_attention_layernorm.weight"],
    }
