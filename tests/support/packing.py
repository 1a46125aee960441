"""Checkpoints whose routed experts are stored fused, as Qwen3.6, Qwen3-VL-MoE and GLM-4.5's
hub releases store them: one ``experts.gate_up_proj`` and one ``experts.down_proj`` tensor per
layer, with every expert along dim 0.

:func:`pack_experts` rewrites a per-expert checkpoint from the tensors ``transformers``' own
MoE class holds in memory (``[E, 2I, H]`` gate then up, ``[E, H, I]``), in one of the three
layouts Megatron-Bridge's ``FusedGatedExpertMapping`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

LAYOUTS = ("E,2I,H", "E,H,2I", "E,2,I,H")
"""How ``gate_up_proj`` is stored: as transformers holds it, transposed (Qwen3-VL-MoE's hub
release), or with gate and up on a dim of their own."""


def pack_experts(directory: Path, layout: str = "E,2I,H", shards: int = 2) -> None:
    """Rewrite the checkpoint in ``directory`` with fused experts in ``layout``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
        fused = tensors[name]
        if layout == "E,H,2I":
            fused = fused.transpose(1, 2)
        elif layout == "E,2,I,H":
            fused = fused.view(fused.shape[0], 2, fused.shape[1] // 2, fused.shape[2])
        elif layout != "E,2I,H":
            raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
        tensors[name] = fused.contiguous()
    for old in directory.glob("model*.safetensors*"):
        old.unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def fused_shape(directory: Path, layer: int = 0) -> tuple[int, ...]:
    """The stored shape of layer ``layer``'s ``gate_up_proj``."""
    from safetensors import safe_open

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
    with safe_open(directory / index["weight_map"][name], "pt") as f:
        return tuple(f.get_slice(name).get_shape())
