"""Expert parallelism: global expert indices in parameter names, and the expert-count check.

With expert parallelism (EP) each rank builds only its ``num_experts / EP``
experts and numbers them from 0 (``local_experts.0``, grouped ``weight0``),
whatever their place in the model. The plan works on *canonical* names, where
the index is the global expert (EP rank times experts per rank, plus the local
index), so a mapping rule's ``{expert}`` field is the HF checkpoint's expert
number on every rank and in every layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from megastart.errors import PlanError

_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(?=\.)")
"""Sequential MLP: ``...mlp.experts.local_experts.{i}.linear_fc1.weight``, and wherever a
layer holds its experts (Ernie-4.5-VL's two pools: ``mlp.text_moe_layer.experts...`` and
``mlp.vision_moe_layer.experts...``), as Megatron-Bridge finds them (``.experts.local_experts.``
anywhere in the name)."""

_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
"""Grouped GEMM (Transformer Engine): ``...mlp.experts.linear_fc1.weight{i}``, and
``bias{i}`` where the experts have biases (gpt-oss)."""

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
"""``config.json`` spellings of the routed experts per layer (DeepSeek-V3 and GLM-4.5; Qwen;
Mixtral, transformers 5)."""


def global_expert_name(name: str, first_expert: int) -> str:
    """``name`` with its local expert index replaced by the global one (other names unchanged)."""
    if first_expert == 0:
        return name
    for pattern in (_LOCAL_EXPERT, _GROUPED_EXPERT):
        name, found = pattern.subn(lambda m: f"{m[1]}{int(m[2]) + first_expert}", name)
        if found:
            return name
    return name


def first_local_expert(megatron: Mapping[str, Any]) -> int:
    """The global index of this rank's first expert: EP rank times experts per EP rank.

    :param megatron: the model's ``TransformerConfig`` attributes by name.
    """
    experts = megatron.get("num_moe_experts")
    if not experts:
        return 0
    from megatron.core import parallel_state

    ep_size = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (experts // ep_size)


def check_expert_parallel(
    hf_config: Mapping[str, Any], megatron: Mapping[str, Any], *, checkpoint: str
) -> None:
    """Raise if the expert-parallel size does not divide the checkpoint's experts per layer.

    Megatron itself refuses such a model, so a model built with this EP size is
    for another checkpoint; this names the real constraint before the config
    comparison reports the differing expert counts.
    """
    experts = next((hf_config[k] for k in EXPERT_COUNT_KEYS if hf_config.get(k)), None)
    ep_size = megatron.get("expert_model_parallel_size") or 1
    if experts and experts % ep_size:
        sizes = [d for d in range(1, experts + 1) if experts % d == 0]
        raise PlanError(
            f"checkpoint {checkpoint!r} has {experts} experts per MoE layer (config.json), "
            f"which expert-parallel size {ep_size} does not divide: every EP rank must hold "
            f"the same number of experts. Choose an expert-parallel size among {sizes}"
        )
