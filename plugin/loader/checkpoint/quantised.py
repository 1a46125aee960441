"""Quantised checkpoints are never cast: found from the config and the headers alone.

Read as stored and converted to the parameters' dtype, an FP8 weight loses its
``weight_scale_inv`` (differences up to 448 per element) and a GPTQ ``qweight`` is
packed integers. So a quantised checkpoint is named here, before any transfer, and
the loader either leaves it whole to a host whose own loader dequantises it or
refuses it on every rank (:func:`megastart.loader.api.load_for_engine`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megastart.loader.checkpoint.errors import QuantisedCheckpoint

__all__ = ["Quantisation", "QuantisedCheckpoint", "find_quantisation"]

_CONFIG_KEYS = ("quantization_config", "compression_config")
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

    def refusal(self, checkpoint: str) -> QuantisedCheckpoint:
        """The error that refuses it, naming the method and the fix."""
        return QuantisedCheckpoint(
            f"checkpoint {checkpoint!r} is quantised ({self.method}: {self.evidence}); "
            "rank0_loader does not dequantise it and never casts quantised weights without "
            "their scales, whatever rank0_loader.strict says. Load a bf16/fp16 copy of the "
            "model (dequantise it once, e.g. with transformers' from_pretrained and "
            "save_pretrained), or block the plugin for this run "
            "(MEGASTART_BLOCKLIST=rank0_loader) if your host's own loader dequantises it",
            self.method,
        )


def find_quantisation(config: Mapping[str, Any], dtypes: Mapping[str, str]) -> Quantisation | None:
    """The checkpoint's quantisation, from ``config.json`` and each tensor's dtype (``torch``
    names, by tensor name); ``None`` for a checkpoint of plain floating-point weights."""
    for key in _CONFIG_KEYS:
        section = config.get(key)
        if section:
            method = section.get("quant_method") if isinstance(section, Mapping) else None
            return Quantisation(str(method or "unknown"), f"config.json has {key}")
    return next(filter(None, (rule(name, dtypes) for rule in _RULES for name in dtypes)), None)


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
