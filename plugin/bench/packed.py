"""Checkpoints whose routed experts are stored packed (one ``gate_up_proj`` ``[E, 2I, H]`` and
one ``down_proj`` ``[E, H, I]`` per layer, as Qwen3.5-MoE and Qwen3-VL-MoE ship them), and the
model bridge Megatron-Bridge 0.6 loads them with.

Megatron-Bridge reads such a tensor whole and caches it until every expert of the layer is
loaded; megastart reads each expert's block. ``bench loader --arch qwen3_moe_packed`` measures
the two side by side (the ``bridge`` strategy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
"""How the packed tensors' names end."""


def is_packed(names: Any) -> bool:
    """Whether a checkpoint with these tensor names stores its routed experts packed (how
    Megatron-Bridge 0.6 chooses its packed mappings: from the checkpoint's keys)."""
    return any(name.endswith(PACKED) for name in names)


def pack_experts(directory: Path, shards: int = 4) -> None:
    """Rewrite the per-expert checkpoint in ``directory`` (``experts.<e>.gate_proj``, ``up_proj``,
    ``down_proj``) with each layer's experts packed as ``transformers`` holds them: gate rows
    then up rows in ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_file = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(directory / file, "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in tensors if ".mlp.experts." in n]:
        prefix, _, rest = name.partition(".mlp.experts.")
        expert, projection, _ = rest.split(".")
        experts.setdefault(prefix, {}).setdefault(int(expert), {})[projection] = tensors.pop(name)
    for prefix, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        tensors[prefix + PACKED[0]] = torch.stack(
            [torch.cat([p["gate_proj"], p["up_proj"]]) for p in order]
        )
        tensors[prefix + PACKED[1]] = torch.stack([p["down_proj"] for p in order])
    for file in files:
        (directory / file).unlink()
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors.pop(n) for n in names[i::shards]}
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def bridge_with_packed_experts(auto: Any) -> Any:
    """The ``AutoBridge``'s model bridge with the routed-expert mappings Megatron-Bridge 0.6
    gives Qwen3.5-MoE and Qwen3-VL-MoE for packed checkpoints (``_moe_routed_expert_mappings``
    with ``experts_packed``): fused tensors into both expert layouts, grouped and sequential."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import (
        FusedExpertMapping,
        FusedGatedExpertMapping,
    )

    base = auto._model_bridge
    experts = "decoder.layers.*.mlp.experts"
    gate_up, down = (f"model.layers.*{suffix}" for suffix in PACKED)

    class Bridge(type(base)):  # type: ignore[misc]
        def mapping_registry(self) -> Any:
            mappings = super().mapping_registry().get_all_mappings()
            kept = [m for m in mappings if not m.megatron_param.startswith(experts + ".")]
            return MegatronMappingRegistry(
                *kept,
                FusedGatedExpertMapping(f"{experts}.linear_fc1.weight*", gate_up),
                FusedExpertMapping(f"{experts}.linear_fc2.weight*", down),
                FusedGatedExpertMapping(f"{experts}.local_experts.*.linear_fc1.weight", gate_up),
                FusedExpertMapping(f"{experts}.local_experts.*.linear_fc2.weight", down),
            )

    bridge = Bridge()
    bridge.hf_config = base.hf_config
    return bridge
