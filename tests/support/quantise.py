"""Quantised copies of a test checkpoint, made as the hub's quantised models are made.

:func:`fp8_block_scaled` writes DeepSeek-V3's format (each projection as
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per block: the block's
absolute maximum / 448); :func:`dequantised` is the reference every FP8 load is
compared with: the float32 weight times its block's scale, rounded once to the
model's dtype.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEEPSEEK_BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn


def rewrite_shards(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply ``edit(tensors)`` to every shard; keep the index in step."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for shard in sorted({*index["weight_map"].values()}):
        tensors = load_file(directory / shard)
        edit(tensors)
        save_file(tensors, directory / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
    index_path.write_text(json.dumps({**index, "weight_map": weight_map}))


def is_projection(name: str) -> bool:
    """The tensors DeepSeek-V3 stores in FP8: every linear layer's weight but the router's."""
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def fp8_block_scaled(
    tensors: dict[str, torch.Tensor], block: tuple[int, int] = DEEPSEEK_BLOCK
) -> None:
    """Each projection of ``tensors`` as FP8 with its ``weight_scale_inv``, in place."""
    rows_per, cols_per = block
    for name in [n for n in tensors if is_projection(n)]:
        weight = tensors[name].float()
        rows, cols = weight.shape
        scales = torch.empty(math.ceil(rows / rows_per), math.ceil(cols / cols_per))
        quantised = torch.empty(rows, cols, dtype=FP8)
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                part = (
                    slice(i * rows_per, (i + 1) * rows_per),
                    slice(j * cols_per, (j + 1) * cols_per),
                )
                scales[i, j] = weight[part].abs().max() / torch.finfo(FP8).max
                quantised[part] = (weight[part] / scales[i, j]).to(FP8)
        tensors[name] = quantised
        tensors[f"{name}_scale_inv"] = scales


def quantise_fp8(
    directory: Path, block: tuple[int, int] = DEEPSEEK_BLOCK, *, config: bool = True
) -> None:
    """Make the checkpoint in ``directory`` FP8 block-scaled, with DeepSeek-V3's
    ``quantization_config`` (``config=False``: the tensors alone show it)."""
    rewrite_shards(directory, lambda tensors: fp8_block_scaled(tensors, block))
    if config:
        config_path = directory / "config.json"
        settings = json.loads(config_path.read_text())
        settings["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
        config_path.write_text(json.dumps(settings))


def dequantised(
    tensors: dict[str, torch.Tensor], block: tuple[int, int], dtype: torch.dtype
) -> None:
    """The reference, in place: each FP8 weight times its block's scale in float32, rounded
    once to ``dtype``; every other tensor in ``dtype``; the scales gone."""
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        scales = tensors.pop(name)
        weight = name.removesuffix("_scale_inv")
        expanded = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        rows, cols = tensors[weight].shape
        tensors[weight] = (tensors[weight].float() * expanded[:rows, :cols]).to(dtype)
    for name, tensor in tensors.items():
        tensors[name] = tensor.to(dtype)


def fp8_and_reference(source: Path, out: Path, block: tuple[int, int]) -> tuple[str, str]:
    """An FP8 copy of ``source`` and, beside it, its block dequantisation in float32 (the
    dtype the test models are built in) as a plain checkpoint."""
    fp8 = Path(shutil.copytree(source, out / "fp8"))
    quantise_fp8(fp8, block)
    reference = Path(shutil.copytree(fp8, out / "reference"))
    rewrite_shards(reference, lambda tensors: dequantised(tensors, block, torch.float32))
    config = json.loads((reference / "config.json").read_text())
    del config["quantization_config"]
    (reference / "config.json").write_text(json.dumps(config))
    return str(fp8), str(reference)


E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
"""Midpoints between E2M1's magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: a value rounds to its nearest."""
GPT_OSS_EXPERTS = {".mlp.experts.gate_up_proj": "gate", ".mlp.experts.down_proj": "down"}


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (``[..., K]``, ``K`` a multiple of 32) as MXFP4: blocks ``[..., K/32, 16]``
    (two E2M1 codes a byte, the even element in the low nibble) and E8M0 scales
    ``[..., K/32]`` (the exponent that brings each group's largest magnitude to at most 6)."""
    groups = weight.float().contiguous().reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = torch.bucketize(scaled.abs(), E2M1_BOUNDS).to(torch.uint8) | ((scaled < 0) * 8).to(
        torch.uint8
    )
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def quantise_mxfp4(directory: Path) -> None:
    """Make a bf16 gpt-oss checkpoint an MXFP4 release, as OpenAI's are: each layer's experts
    ``gate_up_proj`` (``[E, H, 2I]``) and ``down_proj`` (``[E, I, H]``) stored transposed
    as ``X_blocks`` / ``X_scales`` (``[E, 2I, H/32, 16]``, ``[E, H, I/32, 16]``), biases
    and everything else as they were, and its ``quantization_config``."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.endswith(tuple(GPT_OSS_EXPERTS))]:
            blocks, scales = mxfp4(tensors.pop(name).transpose(-1, -2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales

    rewrite_shards(directory, edit)
    config_path = directory / "config.json"
    settings = json.loads(config_path.read_text())
    settings["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    config_path.write_text(json.dumps(settings))


def int4_packed(weight: torch.Tensor, group: int = 32) -> dict[str, torch.Tensor]:
    """A 2-D ``weight`` as compressed-tensors' symmetric INT4 ``pack-quantized`` (Kimi-K2.5's
    routed experts): ``weight_packed`` (``[out, in/8]`` int32, eight codes ``q + 8`` each,
    the first in the lowest nibble), ``weight_scale`` (bf16 ``[out, in/group]``: each group's
    largest magnitude / 7) and ``weight_shape``, by suffix after ``.weight``."""
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, -1, group)
    scale = (groups.abs().amax(-1) / 7.0).clamp(min=1e-10).to(torch.bfloat16)
    codes = (groups / scale.float().unsqueeze(-1)).round().clamp(-8, 7).to(torch.int32) + 8
    codes = codes.reshape(rows, columns // 8, 8)
    packed = torch.zeros(rows, columns // 8, dtype=torch.int32)
    for i in range(8):
        packed |= codes[..., i] << (4 * i)
    return {
        "_packed": packed,
        "_scale": scale,
        "_shape": torch.tensor([rows, columns], dtype=torch.int32),
    }
