"""Megatron-Bridge mappings whose layout depends on the model's config: gated attention's QKV,
the gated delta net's input projection and convolution, Mamba's input projection and
convolution, MiMo-V2-Flash's QKV with narrower V heads, and zero-centred norms, each as the
:mod:`~megastart.loader.mapping.interleave` transform that reproduces its merge.

The dims come from the ``TransformerConfig`` the bridge's own merge reads
(``mapping._get_config(module)``), so both see the same numbers.
"""

from __future__ import annotations

from typing import Any

from megastart.loader.mapping import interleave

CONFIGURED = {
    "GDNLinearMapping": ("qkvz", "ba"),
    "GDNLinearMappingSeparate": ("qkv", "z", "b", "a"),
    "GDNConv1dMapping": (),
    "MambaConv1dMapping": (),
    "MambaInProjMapping": (),
    "ConcatenatedQKVMapping": (),
    "QKVGMapping": ("q", "k", "v", "g"),
    "MiMoV2FlashQKVMapping": ("q", "k", "v"),
}
"""Mapping classes (by exact class) :func:`configured` translates, and the order of their HF
inputs (``()``: one)."""


def configured(kind: str, mapping: Any, module: Any) -> str | None:
    """The transform name for one of :data:`CONFIGURED`, from the module's config (``None``:
    a config this translation does not cover)."""
    config = mapping._get_config(module)
    if kind == "MambaConv1dMapping":
        return mamba_conv1d(config)
    if kind == "MambaInProjMapping":
        return mamba_in_proj(config)
    if kind == "ConcatenatedQKVMapping":
        return concatenated_qkv(config)
    if kind == "QKVGMapping":
        return qkv_scalar_gate(config)
    if kind == "MiMoV2FlashQKVMapping":
        return asymmetric_qkv(config)
    dims = (
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    if kind == "GDNLinearMapping":
        return interleave.gdn_in_proj(*dims)
    if kind == "GDNLinearMappingSeparate":
        return interleave.gdn_in_proj_separate(*dims)
    return interleave.gdn_conv1d(*dims)


def gated_qkv(mapping: Any, module: Any) -> str | None:
    """``QKVMapping``'s layout with an output gate (``attention_output_gate``), or ``None``."""
    config = mapping._get_config(module)
    if not getattr(config, "attention_output_gate", False):
        return None
    heads = config.num_attention_heads
    head_dim = config.kv_channels or config.hidden_size // heads
    return interleave.gated_qkv(heads, config.num_query_groups or heads, head_dim)


def concatenated_qkv(config: Any) -> str | None:
    """A fused ``[Q; K; V]`` (a ViT's ``qkv``, ``ConcatenatedQKVMapping``) as Megatron's QKV:
    per group, its query heads, then its key and value head (``None`` with an output gate,
    which the bridge's merge would apply to a ``Q`` split without it)."""
    if getattr(config, "attention_output_gate", False):
        return None
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    per = heads // groups
    return interleave.spec(
        groups,
        True,
        [
            interleave.Component(0, per * d, 0, per * d),
            interleave.Component(0, d, heads * d, d),
            interleave.Component(0, d, heads * d + groups * d, d),
        ],
    )


def qkv_scalar_gate(config: Any) -> str | None:
    """``QKVGMapping`` where Megatron-Core has no head-wise gate (``attention_output_gate``:
    each head's scalar gate expanded over its dims); ``None`` otherwise (the bridge then
    appends the gate rows after the QKV and splits the two together over TP)."""
    if not getattr(config, "attention_output_gate", False):
        return None
    heads = config.num_attention_heads
    head_dim = config.kv_channels or config.hidden_size // heads
    return interleave.gated_qkv_scalar(heads, config.num_query_groups or heads, head_dim)


def asymmetric_qkv(config: Any) -> str:
    """MiMo-V2-Flash's QKV (``MiMoV2FlashQKVMapping``): per group its query heads and its K
    head of ``kv_channels`` rows, then its V head of ``v_head_dim`` rows."""
    heads, groups = config.num_attention_heads, config.num_query_groups
    qk, v = config.kv_channels, config.v_head_dim
    per = heads // groups
    return interleave.spec(
        groups,
        True,
        [
            interleave.Component(0, per * qk, 0, per * qk),
            interleave.Component(1, qk, 0, qk),
            interleave.Component(2, v, 0, v),
        ],
    )


def mamba_conv1d(config: Any) -> str:
    """Mamba's ``conv1d``: ``[x; B; C]`` channels, each split over TP (``MambaConv1dMapping``):
    per group, its heads' ``x`` channels and its ``B`` and ``C`` state channels."""
    groups = config.mamba_num_groups
    x = config.mamba_num_heads * config.mamba_head_dim
    state = config.mamba_state_dim
    per = x // groups
    return interleave.spec(
        groups,
        False,
        [
            interleave.Component(0, per, 0, per),
            interleave.Component(0, state, x, state),
            interleave.Component(0, state, x + state * groups, state),
        ],
    )


def mamba_in_proj(config: Any) -> str:
    """Mamba's ``in_proj`` (``MambaInProjMapping``): HF's ``[z; x; B; C; dt]`` rows, each split
    over TP, as ``[z; x; B; C; dt]`` of the rank's share: per group (TP divides Mamba's groups)
    its heads' ``z`` and ``x`` rows, its ``B`` and ``C`` state rows and its heads' ``dt``."""
    groups, heads = config.mamba_num_groups, config.mamba_num_heads
    inner, state = heads * config.mamba_head_dim, config.mamba_state_dim
    per, dt = inner // groups, heads // groups
    return interleave.spec(
        groups,
        False,
        [
            interleave.Component(0, per, 0, per),
            interleave.Component(0, per, inner, per),
            interleave.Component(0, state, 2 * inner, state),
            interleave.Component(0, state, 2 * inner + groups * state, state),
            interleave.Component(0, dt, 2 * (inner + groups * state), dt),
        ],
    )


def zero_centred(inner: str, stored: str | None) -> str | None:
    """``RMSNorm2ZeroCenteredRMSNormMapping``'s transform: ``inner`` minus one in the stored
    dtype, then cast (the bridge subtracts before it casts; the tensor travels as stored), or
    ``None`` where the checkpoint has no plain dtype for it (a packed or quantised tensor)."""
    if stored is None:
        return None
    return f"zero_centred:{stored}:{inner}"
