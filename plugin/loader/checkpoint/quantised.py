"""Quantised checkpoints are never cast: found from the config and the headers alone.

Read as stored and converted to the parameters' dtype, an FP8 weight loses its
``weight_scale_inv`` (differences up to 448 per element) and a GPTQ ``qweight`` is
packed integers. So a quantised checkpoint is named here, before any transfer.
One form the loader dequantises itself: DeepSeek-V3's FP8 block scaling
(``quant_method: fp8`` with ``weight_block_size``, every float8 weight with a
float32 ``weight_scale_inv`` per block; :mod:`megastart.loader.mapping.dequantise`). Two
packed forms it dequantises where the host's Megatron-Bridge would, as its hook does
(:mod:`megastart.loader.mapping.unpack`): gpt-oss's MXFP4 (``X_blocks`` / ``X_scales``) and
compressed-tensors' INT4 ``pack-quantized`` (Kimi-K2.5's ``weight_packed`` /
``weight_scale``). Any other is left whole to a host whose own loader dequantises it or
refused on every rank (:func:`megastart.loader.api.load_for_engine`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megastart.loader.checkpoint.errors import QuantisedCheckpoint

__all__ = [
    "INT4",
    "MXFP4",
    "Quantisation",
    "QuantisedCheckpoint",
    "find_quantisation",
    "logical_shape",
]

_CONFIG_KEYS = ("quantization_config", "compression_config")
SCALE_SUFFIX = "_scale_inv"
"""An FP8 weight ``X``'s block scales are ``X + SCALE_SUFFIX`` (DeepSeek-V3's names)."""
_SCALE_SUFFIXES = {"_scale_inv": "fp8", "_scale": "scaled weights"}
MXFP4 = "mxfp4"
INT4 = "int4"
PACKED_SUFFIXES = {MXFP4: ("_blocks", "_scales"), INT4: ("_packed", "_scale")}
"""Per packing, the suffixes of a weight's stored values and of its scales, after the name the
mappings use (``...experts.gate_up_proj``, ``...down_proj.weight``)."""
_GPTQ_AWQ = (".qweight", ".qzeros", ".g_idx")
_FLOATS = {"float16", "bfloat16", "float32", "float64"}
_INTEGER = {"int8", "uint8", "int16", "int32", "int64"}


@dataclass(frozen=True, slots=True)
class Quantisation:
    """How a checkpoint is quantised, and what shows it."""

    method: str
    """``quantization_config.quant_method`` (``"fp8"``, ``"gptq"``, ...), or what the
    tensors show where the config says nothing (``"fp8"``, ``"gptq/awq"``, ...)."""
    evidence: str
    """Where it shows: the config's key, or one tensor with its dtype or companion."""
    weight_block: tuple[int, int] | None = None
    """Rows and columns of one scale block where the loader dequantises the checkpoint
    itself (FP8 block scaling); ``None``: it does not."""
    packing: str = ""
    """:data:`MXFP4` or :data:`INT4`: dequantised where the host's Megatron-Bridge's hook
    dequantises it (:func:`megastart.loader.mapping.bridge.dequantises`); ``""``: not packed."""

    @property
    def suffixes(self) -> tuple[str, str]:
        """A weight's suffixes of its stored values and of its scales."""
        return PACKED_SUFFIXES.get(self.packing, ("", SCALE_SUFFIX))

    def scale_of(self, name: str, dtype: str) -> str:
        """The scales of the stored weight ``name`` (of ``dtype``); ``""``: none."""
        values, scales = self.suffixes
        if self.packing:
            return name.removesuffix(values) + scales if name.endswith(values) else ""
        return name + scales if dtype.startswith("float8") else ""

    def weight_of(self, name: str) -> str | None:
        """The stored weight whose scales ``name`` are, or ``None``."""
        values, scales = self.suffixes
        return name.removesuffix(scales) + values if name.endswith(scales) else None

    def refusal(self, checkpoint: str) -> QuantisedCheckpoint:
        """The error that refuses it, naming the method and the fix."""
        return QuantisedCheckpoint(
            f"checkpoint {checkpoint!r} is quantised ({self.method}: {self.evidence}); "
            "rank0_loader dequantises only FP8 block-scaled checkpoints (quant_method fp8 "
            "with weight_block_size, a float32 weight_scale_inv for every float8 weight), and "
            "gpt-oss's MXFP4 and Kimi-K2.5's INT4 ones where the host's Megatron-Bridge "
            "(GPTOSSBridge, KimiK25VLBridge) loads them; it never casts quantised weights without "
            "their scales, whatever rank0_loader.strict says. Load a bf16/fp16 copy of the "
            "model (dequantise it once, e.g. with transformers' from_pretrained and "
            "save_pretrained), or block the plugin for this run "
            "(MEGASTART_BLOCKLIST=rank0_loader) if your host's own loader dequantises it",
            self.method,
        )


def find_quantisation(
    config: Mapping[str, Any], tensors: Mapping[str, tuple[str, tuple[int, ...]]]
) -> Quantisation | None:
    """The checkpoint's quantisation, from ``config.json`` and each tensor's dtype (``torch``
    names) and shape, by tensor name; ``None`` for a checkpoint of plain floating-point weights."""
    dtypes = {name: dtype for name, (dtype, _) in tensors.items()}
    text = config.get("text_config")  # a multimodal model's (Kimi-K2.5's) may hold it
    for key in _CONFIG_KEYS:
        section = config.get(key) or (text.get(key) if isinstance(text, Mapping) else None)
        if section:
            method = section.get("quant_method") if isinstance(section, Mapping) else None
            found = Quantisation(str(method or "unknown"), f"config.json has {key}")
            return (
                _block_scaled_fp8(found, section, tensors, dtypes)
                or _packed_groups(found, section, tensors)
                or found
            )
    return next(filter(None, (rule(name, dtypes) for rule in _RULES for name in dtypes)), None)


def _block_scaled_fp8(
    found: Quantisation,
    section: Any,
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    dtypes: Mapping[str, str],
) -> Quantisation | None:
    """``found`` with its block where every float8 tensor is a 2-D weight with float32 block
    scales of the configured block; ``None`` where anything else shows (then it is refused)."""
    block = section.get("weight_block_size") if isinstance(section, Mapping) else None
    if (
        found.method != "fp8"
        or section.get("fmt", "e4m3") != "e4m3"
        or not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        return None
    rows, cols = block
    for name, (dtype, shape) in tensors.items():
        if _packed(name, dtypes) or _integer(name, dtypes):
            return None
        weight = tensors.get(name.removesuffix(SCALE_SUFFIX))
        if name.endswith(SCALE_SUFFIX) and not (weight and weight[0].startswith("float8")):
            return None  # a scale for a weight that is not FP8: not this format
        if not dtype.startswith("float8"):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        wanted = tuple(-(-n // b) for n, b in zip(shape, block, strict=False))
        if dtype != "float8_e4m3fn" or len(shape) != 2 or scale != ("float32", wanted):
            return None
    return Quantisation("fp8", f"{found.evidence} (blocks of {rows}x{cols})", (rows, cols))


def _packed_groups(
    found: Quantisation, section: Any, tensors: Mapping[str, tuple[str, tuple[int, ...]]]
) -> Quantisation | None:
    """``found`` as :data:`MXFP4` (``quant_method: mxfp4``: every ``X_blocks`` uint8
    ``[..., G, 16]`` with uint8 ``X_scales`` ``[..., G]``) or :data:`INT4` (compressed-tensors'
    ``pack-quantized``: every ``X_packed`` int32 ``[out, in / 8]`` with ``X_scale``
    ``[out, G]``, ``in / G`` a multiple of 8, and ``X_shape``), where every tensor that is not
    floating point is one of those; ``None`` where anything else shows."""
    if found.method == MXFP4:
        packing = MXFP4
    elif found.method == "compressed-tensors" and section.get("format") == "pack-quantized":
        packing = INT4
    else:
        return None
    values, scales = PACKED_SUFFIXES[packing]
    weights = 0
    for name, (dtype, shape) in tensors.items():
        base = name.removesuffix(values)
        if base == name:
            base = name.removesuffix(scales)
            plain = base == name and dtype in _FLOATS
            if plain or (packing == INT4 and name.endswith("_shape") and dtype == "int32"):
                continue
            if tensors.get(base + values) is None:
                return None  # a scale without its weight, or a tensor of another kind
            continue
        scale = tensors.get(base + scales)
        if scale is None or not _groups_fit(packing, dtype, shape, *scale):
            return None
        weights += 1
    if not weights:
        return None
    return Quantisation(found.method, f"{found.evidence} ({packing})", packing=packing)


def _groups_fit(
    packing: str, dtype: str, shape: tuple[int, ...], scale_dtype: str, scale: tuple[int, ...]
) -> bool:
    if packing == MXFP4:
        return (
            dtype == scale_dtype == "uint8"
            and len(shape) >= 2
            and shape[-1] == 16
            and tuple(shape[:-1]) == tuple(scale)
        )
    return (
        dtype == "int32"
        and scale_dtype in _FLOATS
        and len(shape) == len(scale) == 2
        and shape[0] == scale[0]
        and scale[1] > 0
        and shape[1] * 8 % scale[1] == 0
        and shape[1] * 8 // scale[1] % 8 == 0  # a group is whole int32 words
    )


def logical_shape(packing: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a packed weight's values, as its mapping sees it once dequantised."""
    if packing == MXFP4:
        return (*shape[:-2], shape[-2] * 32)
    return (*shape[:-1], shape[-1] * 8)


def _float8(name: str, dtypes: Mapping[str, str]) -> Quantisation | None:
    dtype = dtypes[name]
    return (
        Quantisation("fp8", f"tensor {name!r} is {dtype}") if dtype.startswith("float8") else None
    )


def _scale(name: str, dtypes: Mapping[str, str]) -> Quantisation | None:
    for suffix, method in _SCALE_SUFFIXES.items():
        weight = name.removesuffix(suffix)
        if weight != name and weight in dtypes:
            return Quantisation(method, f"weight {weight!r} has a scale {name!r}")
    return None


def _packed(name: str, dtypes: Mapping[str, str]) -> Quantisation | None:
    if name.endswith(_GPTQ_AWQ):
        return Quantisation("gptq/awq", f"tensor {name!r} is a packed-integer companion")
    return None


def _integer(name: str, dtypes: Mapping[str, str]) -> Quantisation | None:
    if dtypes[name] in _INTEGER and name.endswith(".weight"):
        return Quantisation("integer weights", f"weight {name!r} is {dtypes[name]}")
    return None


_RULES = (_float8, _scale, _packed, _integer)
"""In the order they name a checkpoint: the strongest evidence first."""
