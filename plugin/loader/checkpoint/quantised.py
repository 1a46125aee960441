"""Quantised checkpoints are never cast: found from the config and the headers alone.

Read as stored and converted to the parameters' dtype, an FP8 weight loses its
``weight_scale_inv`` (differences up to 448 per element) and a GPTQ ``qweight`` is
packed integers. So a quantised checkpoint is named here, before any transfer.
One form the loader dequantises itself: DeepSeek-V3's FP8 block scaling
(``quant_method: fp8`` with ``weight_block_size``, every float8 weight with a
float32 ``weight_scale_inv`` per block; :mod:`megastart.loader.dequantise`). Any
other is left whole to a host whose own loader dequantises it or refused on every
rank (:func:`megastart.loader.api.load_for_engine`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megastart.loader.checkpoint.errors import QuantisedCheckpoint

__all__ = ["Quantisation", "QuantisedCheckpoint", "find_quantisation"]

_CONFIG_KEYS = ("quantization_config", "compression_config")
SCALE_SUFFIX = "_scale_inv"
"""An FP8 weight ``X``'s block scales are ``X + SCALE_SUFFIX`` (DeepSeek-V3's names)."""
_SCALE_SUFFIXES = {"_scale_inv": "fp8", "_scale": "scaled weights"}
_GPTQ_AWQ = (".qweight", ".qzeros", ".g_idx")
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

    def refusal(self, checkpoint: str) -> QuantisedCheckpoint:
        """The error that refuses it, naming the method and the fix."""
        return QuantisedCheckpoint(
            f"checkpoint {checkpoint!r} is quantised ({self.method}: {self.evidence}); "
            "rank0_loader dequantises only FP8 block-scaled checkpoints (quant_method fp8 "
            "with weight_block_size, a float32 weight_scale_inv for every float8 weight) and "
            "never casts quantised weights without "
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
    for key in _CONFIG_KEYS:
        section = config.get(key)
        if section:
            method = section.get("quant_method") if isinstance(section, Mapping) else None
            found = Quantisation(str(method or "unknown"), f"config.json has {key}")
            return _block_scaled_fp8(found, section, tensors, dtypes) or found
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
