"""Mapping classes of one Megatron-Bridge bridge's own, as data: each (by module and class)
is either a transform of megastart's, or the standard class whose translation it takes,
after picking one row of dim 0 where it does (an expert of stacked ``[E, ...]`` tensors,
a row of a stacked bias, an element of a stacked scale).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MODELS = "megatron.bridge.models."

BRIDGE_CLASSES: dict[str, str | Callable[[Any], str]] = {
    # MiniMax-M2's Q/K norms over all heads: a TP shard, replicated where key heads < TP
    f"{_MODELS}minimax_m2.minimax_m2_bridge._FullDimQKNormMapping": "column_shards",
    # Ernie-4.5's: the standard classes (theirs change only the export), a squeezed bias
    **{
        f"{_MODELS}ernie.ernie_45_bridge._PPSafe{base}": base
        for base in ("AutoMapping", "ReplicatedMapping", "GatedMLPMapping")
    },
    f"{_MODELS}ernie.ernie_45_bridge._SqueezeBiasMapping": "squeezed",
    # Ernie-4.5-VL's vision experts: the standard classes, their HF experts offset in resolve
    f"{_MODELS}ernie_vl.ernie45_vl_bridge._OffsetGatedMLPMapping": "GatedMLPMapping",
    f"{_MODELS}ernie_vl.ernie45_vl_bridge._OffsetRowParallelMapping": "RowParallelMapping",
    # ... and the text (row 0) or vision (row 1) expert bias of one [2, E] tensor
    f"{_MODELS}ernie_vl.ernie45_vl_bridge._ConcatBiasMapping": "AutoMapping",
    # gpt-oss's experts: expert e of [E, ...] tensors, gate/up interleaved by row, down
    # transposed by the bridge's hook (gpt_oss_bridge), biases replicated per expert
    f"{_MODELS}gpt_oss.gpt_oss_bridge.GPTOSSMLPGateUpProjMapping": "even_odd_gate_up",
    f"{_MODELS}gpt_oss.gpt_oss_bridge.GPTOSSMLPDownProjMapping": "AutoMapping",
    # Step-3.5's stacked experts: expert e of [E, ...] tensors, then as the standard class
    f"{_MODELS}stepfun.step35_bridge.StackedExpertAutoMapping": "AutoMapping",
    f"{_MODELS}stepfun.step35_bridge.StackedExpertGatedMLPMapping": "GatedMLPMapping",
    # Gemma 4's QKV, whose V (or K and V) its hook derives where absent (hooks.derived_qkv)
    f"{_MODELS}gemma.gemma4_bridge._Gemma4QKVMapping": "QKVMapping",
    f"{_MODELS}gemma.gemma4_bridge._Gemma4DenseQKVMapping": "QKVMapping",
    # MiMo-V2-Flash's QKV with V heads narrower than Q and K (bridge_layouts.asymmetric_qkv)
    f"{_MODELS}mimo_v2_flash.mimo_v2_flash_bridge.MiMoV2FlashQKVMapping": "MiMoV2FlashQKVMapping",
    # DeepSeek-V4: compressor and indexer weights replicated (optional on export only), and
    # the hyper-connections' three alphas, each one element of a stacked [3] scale
    f"{_MODELS}deepseek.deepseek_v4_bridge._ReplicatedOptional": "ReplicatedMapping",
    f"{_MODELS}deepseek.deepseek_v4_bridge._HCAlphaMapping": "rows:0:1",
    f"{_MODELS}deepseek.deepseek_v4_bridge._HCAlphaSecondaryMapping": lambda mapping: (
        f"rows:{mapping._index}:{mapping._index + 1}"
    ),
}
"""Mapping classes of one bridge's own (by module and class): a transform (or a function of
the mapping that names it), or the standard class whose translation they take."""

_ONE_EXPERT = {
    "FusedExpertMapping",
    "StackedExpertAutoMapping",
    "StackedExpertGatedMLPMapping",
    "GPTOSSMLPGateUpProjMapping",
    "GPTOSSMLPDownProjMapping",
}
"""Classes that take expert ``e``'s slice of ``[E, ...]`` tensors, then do their base's work."""

_ROW = {"_ConcatBiasMapping": lambda mapping: ("text", "vision").index(mapping._slice_name)}
"""Classes that take one row of a stacked tensor, by the mapping's own data."""


def own_class(mapping: Any) -> str:
    """The standard class or transform ``mapping``'s class stands for (its own name if none)."""
    kind = type(mapping).__name__
    own = BRIDGE_CLASSES.get(f"{type(mapping).__module__}.{kind}", kind)
    return own if isinstance(own, str) else own(mapping)


def picked_row(mapping: Any, canonical: str) -> int | None:
    """The dim-0 index ``mapping`` takes of its HF tensors before its work, or ``None``."""
    kind = type(mapping).__name__
    if kind in _ONE_EXPERT:
        return expert_number(canonical)
    if kind in _ROW:
        return int(_ROW[kind](mapping))
    return None


def expert_number(canonical: str) -> int:
    """The (global) expert a fused mapping takes from dim 0, found as the bridge finds it."""
    from megatron.bridge.utils.common_utils import extract_expert_number_from_param

    return int(extract_expert_number_from_param(canonical))
