"""What each rank runs in the tests of per-weight hooks and the layouts that came with them,
on tensors (:mod:`support.layout_ranks`' pattern): the bridge's own hook and resolved mapping,
``hf_to_megatron`` scattering over the TP group, beside megastart's translation of the same
bridge placing row blocks of the same HF tensors (in the dtype they travel in), each tensor
it plans read once, on a real Megatron-core layer of the parameter's local shape."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from support.bridge_ranks import import_megatron_bridge
from support.layout_ranks import HIDDEN, MAMBA, holder
from support.loader_ranks import megatron

Compared = tuple[torch.Tensor, torch.Tensor, str, tuple[str, ...]]
"""The bridge's parameter, megastart's, the transform's name and the HF tensors it read."""


def ours(
    rule: Any, hf: dict[str, torch.Tensor], local: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The local parameter as megastart's transform places ``rule``'s HF tensors, each read
    once, from three uneven row blocks (one block where the transform takes it whole)."""
    from megastart.loader.mapping.transforms import TRANSFORMS, Rows, Shard

    rank, tp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shard = Shard(rank, tp, 8, 4, 16)
    transform = TRANSFORMS[rule.transform]
    named = [(n, tuple(hf[n].shape)) for n in rule.hf]
    problems = transform.check(named, local, shard)
    assert not problems, problems
    out = torch.full(local, float("nan"), dtype=dtype)
    for index, name in enumerate(rule.hf):
        whole = hf[name].to(dtype)
        total = whole.shape[0]
        cuts = [(0, total)] if rule.transform.startswith("permuted") else _cuts(total)
        for start, stop in cuts:
            rows = Rows(start, stop, total)
            for first, last, piece in transform.blocks(
                index, whole[start:stop], rows, local, shard
            ):
                out[first:last] = piece
    return out


def _cuts(total: int) -> list[tuple[int, int]]:
    return [(0, total // 3), (total // 3, total - 1), (total - 1, total)]


def translated(bridge: Any, canonical: str, module: Any, hf: dict[str, torch.Tensor]) -> Any:
    """megastart's rule for ``canonical`` from ``bridge``, with ``hf`` the checkpoint."""
    from megastart.loader.mapping.bridge import bridge_table

    def stored(name: str) -> str | None:
        return str(hf[name].dtype).removeprefix("torch.") if name in hf else None

    table = bridge_table(bridge, [(canonical, module, False)], (), tied=False, stored=stored)
    return table.by_name[canonical]


def compared(bridge: Any, canonical: str, module: Any, hf: dict[str, torch.Tensor]) -> Compared:
    """The bridge's load of ``canonical`` (its hook, then its mapping) and megastart's."""
    mapping = bridge.mapping_registry().megatron_to_hf_lookup(canonical)
    theirs = mapping.hf_to_megatron(
        bridge.maybe_modify_loaded_hf_weight(mapping.hf_param, hf), module
    )
    rule = translated(bridge, canonical, module, hf)
    weight = module.weight
    return theirs, ours(rule, hf, tuple(weight.shape), weight.dtype), rule.transform, rule.hf


def gemma4_qkv(absent: str) -> Compared:
    """Gemma 4's dense ``linear_qkv`` at TP2 on a layer whose checkpoint lacks ``absent``
    (``"v"``: V is K; ``"kv"``: K and V are zero), 8 heads in 4 groups of 16."""
    import_megatron_bridge()
    from megatron.bridge.models.gemma.gemma4_bridge import Gemma4Bridge

    with megatron({"tp": 2}):
        module = holder("linear", (8 + 2 * 4) * 16, torch.float32, gate=False)
        bridge = Gemma4Bridge()
        bridge.hf_config = SimpleNamespace(
            num_attention_heads=8,
            num_key_value_heads=4,
            num_global_key_value_heads=4,
            layer_types=["sliding_attention"],
            enable_moe_block=False,
        )
        generator = torch.Generator().manual_seed(0)
        layer = "model.layers.0.self_attn."
        hf = {layer + "q_proj.weight": torch.randn(8 * 16, HIDDEN, generator=generator)}
        if absent == "v":
            hf[layer + "k_proj.weight"] = torch.randn(4 * 16, HIDDEN, generator=generator)
        return compared(bridge, "decoder.layers.0.self_attention.linear_qkv.weight", module, hf)


def mimo_v2_flash_qkv() -> Compared:
    """MiMo-V2-Flash's ``linear_qkv`` at TP2: Q and K heads of 16, V heads of 8."""
    import_megatron_bridge()
    from megatron.bridge.models.mimo_v2_flash import mimo_v2_flash_bridge as mimo

    with megatron({"tp": 2}):
        module = holder("linear", 8 * 16 + 4 * 16 + 4 * 8, torch.float32, gate=False)
        module.config.v_head_dim = 8
        layer = "model.layers.0.self_attn."
        mapping = mimo.MiMoV2FlashQKVMapping(
            "decoder.layers.0.self_attention.linear_qkv.weight",
            q=layer + "q_proj.weight",
            k=layer + "k_proj.weight",
            v=layer + "v_proj.weight",
        )
        generator = torch.Generator().manual_seed(0)
        hf = {
            layer + "q_proj.weight": torch.randn(8 * 16, HIDDEN, generator=generator),
            layer + "k_proj.weight": torch.randn(4 * 16, HIDDEN, generator=generator),
            layer + "v_proj.weight": torch.randn(4 * 8, HIDDEN, generator=generator),
        }
        return compared(_one_mapping(mapping), mapping.megatron_param, module, hf)


def mamba_in_proj() -> Compared:
    """Mamba's ``in_proj`` at TP2 (``MambaInProjMapping``): 2 groups, 8 heads of 4, state 6."""
    import_megatron_bridge()
    from megatron.bridge.models.conversion.param_mapping import MambaInProjMapping

    inner = MAMBA["mamba_num_heads"] * MAMBA["mamba_head_dim"]
    rows = 2 * inner + 2 * MAMBA["mamba_num_groups"] * MAMBA["mamba_state_dim"]
    rows += MAMBA["mamba_num_heads"]
    with megatron({"tp": 2}):
        module = holder("linear", rows, torch.float32, gate=False)
        mapping = MambaInProjMapping(
            "decoder.layers.0.mixer.in_proj.weight", "backbone.layers.0.mixer.in_proj.weight"
        )
        hf = {mapping.hf_param: torch.randn(rows, HIDDEN, generator=torch.Generator())}
        return compared(_one_mapping(mapping), mapping.megatron_param, module, hf)


def permuted_projector() -> Compared:
    """Gemma 3 VL's projector (``AutoMapping`` with ``permute_dims=(1, 0)``) at TP2, held by a
    column-parallel layer: the stored ``[in, out]`` turned, then cut by rows."""
    import_megatron_bridge()
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    with megatron({"tp": 2}):
        module = holder("linear", 96, torch.float32, gate=False)
        mapping = AutoMapping(
            "multi_modal_projector.proj.weight",
            "multi_modal_projector.mm_input_projection_weight",
            permute_dims=(1, 0),
        )
        hf = {mapping.hf_param: torch.randn(HIDDEN, 96, generator=torch.Generator())}
        return compared(_one_mapping(mapping), mapping.megatron_param, module, hf)


def _one_mapping(mapping: Any) -> Any:
    from support.layout_ranks import _bridge

    return _bridge("", mapping)


def deepseek_v4_parts() -> list[Compared]:
    """DeepSeek-V4's own mapping classes and hook, on tensors at TP2 (megatron-core 0.19.2 has
    no ``dsv4_hybrid`` attention variant: no DeepSeek-V4 model builds here): the three
    hyper-connection alphas, each an element of ``hc_attn_scale [3]``, and the CSA indexer's
    weights projection stored under its legacy name, which the hook reads instead."""
    import_megatron_bridge()
    from megatron.bridge.models.deepseek.deepseek_v4_bridge import DeepSeekV4Bridge

    bridge = DeepSeekV4Bridge()
    bridge.hf_config = SimpleNamespace(num_nextn_predict_layers=0)
    generator = torch.Generator().manual_seed(0)
    out = []
    with megatron({"tp": 2}):
        alphas = torch.nn.Module()
        for name in ("alpha_pre", "alpha_post", "alpha_res"):
            setattr(alphas, name, torch.nn.Parameter(torch.zeros(1)))
        hf = {"layers.0.hc_attn_scale": torch.randn(3, generator=generator)}
        for name in ("alpha_pre", "alpha_post", "alpha_res"):
            canonical = f"decoder.layers.0.self_attention_hyper_connection.{name}"
            alphas.weight = getattr(alphas, name)  # what compared() reads the shape of
            out.append(compared(bridge, canonical, alphas, hf))
        indexer = torch.nn.Linear(HIDDEN, 8, bias=False)
        legacy = {"layers.0.attn.indexer.weights_proj.weight": torch.randn(8, HIDDEN)}
        canonical = "decoder.layers.0.self_attention.core_attention.indexer.linear_weights_proj"
        out.append(compared(bridge, canonical + ".weight", indexer, legacy))
    return out
