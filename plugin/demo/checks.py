"""What the demo checks before it starts any rank: the layout fits the model, the model is mapped.

These read only ``config.json`` (no torch), so a bad ``--tp`` or an unmapped
architecture fails in a second, with the numbers and the fix, instead of
after four ranks have imported Megatron.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megastart.errors import SettingsError


class DemoError(SettingsError):
    """The demo cannot run with these arguments; the message says why and what to change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    ranks: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    def describe(self) -> str:
        return f"{self.ranks} ranks = TP{self.tp} x PP{self.pp} x DP{self.dp}"


_SHAPE_KEYS = ("num_attention_heads", "intermediate_size", "num_hidden_layers", "hidden_size")
"""config.json keys the demo's model and layout are made from."""


def check_layout(layout: Layout, config: Mapping[str, Any], checkpoint: str) -> None:
    """Raise :class:`DemoError` if ``layout`` does not divide the model ``config`` describes."""
    if min(layout.ranks, layout.tp, layout.pp) < 1:
        raise DemoError(f"--ranks, --tp and --pp must be >= 1, got {layout}")
    missing = [key for key in _SHAPE_KEYS if not isinstance(config.get(key), int)]
    if missing:
        raise DemoError(
            f"{checkpoint}: config.json lacks {', '.join(missing)} (or not as integers), which "
            "the demo needs to build the model; write the config with transformers' save_pretrained"
        )
    heads = config["num_attention_heads"]
    divided_by_tp = {
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "intermediate_size": config["intermediate_size"],
    }
    layers = config["num_hidden_layers"]
    problems = [
        f"--tp {layout.tp} does not divide {key}={value}"
        for key, value in divided_by_tp.items()
        if value % layout.tp
    ]
    if layers % layout.pp:
        problems.append(f"--pp {layout.pp} does not divide num_hidden_layers={layers}")
    if problems:
        tp_choices = [
            t for t in _divisors(heads) if all(v % t == 0 for v in divided_by_tp.values())
        ]
        raise DemoError(
            f"the layout does not divide the model of {checkpoint} (config.json): "
            + "; ".join(problems)
            + f". Valid --tp: {tp_choices}; valid --pp: {_divisors(layers)}"
        )
    if layout.ranks % (layout.tp * layout.pp):
        raise DemoError(
            f"--ranks {layout.ranks} is not a multiple of --tp {layout.tp} x --pp {layout.pp} "
            f"= {layout.tp * layout.pp}; use --ranks {layout.tp * layout.pp} (or a multiple of it)"
        )


def check_architecture(config: Mapping[str, Any], checkpoint: str, *, loader_enabled: bool) -> None:
    """Raise :class:`DemoError` if the demo cannot build, or megastart cannot load, this model."""
    from megastart.harness.config import SUPPORTED_MODEL_TYPES

    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DemoError(
            f"{checkpoint}: config.json has model_type={model_type!r}; the demo builds Megatron "
            f"models for {', '.join(SUPPORTED_MODEL_TYPES)}. Pass a checkpoint of one of these, "
            "or leave out --checkpoint to use the demo's own"
        )
    if not loader_enabled:
        raise DemoError(
            "the rank0_loader plugin is blocked or megastart is disabled "
            "(MEGASTART_BLOCKLIST / MEGASTART_DISABLE / megastart.enabled), and the demo host has "
            "no loader of its own; unset them to run the demo"
        )
    from megastart.loader.mapping.mappings import known_architectures, mapping_for

    architectures = list(config.get("architectures") or [])
    if not any(arch in known_architectures() for arch in architectures) and any(
        mapping_for(arch) is not None for arch in architectures
    ):
        raise DemoError(
            f"{checkpoint}: config.json names architectures {architectures}: a reward model's "
            "checkpoint, which loads into a value model (a critic), while the demo trains a "
            "language model; pass a causal LM's checkpoint"
        )
    if not any(mapping_for(arch) is not None for arch in architectures):
        raise DemoError(
            f"{checkpoint}: config.json names architectures {architectures}, for which megastart "
            f"has no mapping (mapped: {', '.join(known_architectures())}); rank0_loader would hand "
            "it back to the host's own loader. Register a mapping table through the entry-point "
            "group 'megastart.mappings', or pass a checkpoint of a mapped architecture"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
