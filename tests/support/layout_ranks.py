"""What each rank runs in the tests of config-dependent layouts (gated attention, gated delta
nets, Mamba's convolution, zero-centred norms) where no model can be built on CPU (the gated
delta net's and Mamba's layer specs are Transformer Engine's): the bridge's own resolved
mapping and its ``hf_to_megatron`` scatter over the TP group, beside megastart's translation of
the same mapping placing row blocks of the same HF tensors, on a real Megatron-core layer of
the parameter's local shape."""

from __future__ import annotations

from typing import Any

import torch

from support.bridge_ranks import import_megatron_bridge
from support.loader_ranks import megatron

HIDDEN = 64
GDN = dict(
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
)
"""Two value heads per key head, value and key head dims that differ: every offset counts."""
MAMBA = dict(mamba_num_groups=2, mamba_num_heads=8, mamba_head_dim=4, mamba_state_dim=6)


def config(gate: bool = True) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=16,
        attention_output_gate=gate,
        use_cpu_initialization=True,
        tensor_model_parallel_size=torch.distributed.get_world_size(),
        **GDN,
        **MAMBA,
    )


def holder(kind: str, rows: int, dtype: torch.dtype, gate: bool = True) -> Any:
    """A module of the Megatron type that holds the parameter (of ``rows`` before the TP split),
    with the config the bridge's merge reads."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    cfg = config(gate)
    if kind == "conv1d":  # the gated delta net's depthwise convolution, TP-local channels
        rows //= torch.distributed.get_world_size()
        module: Any = torch.nn.Conv1d(rows, rows, 4, groups=rows, bias=False, dtype=dtype)
    elif kind == "norm":
        module = torch.nn.RMSNorm(rows, dtype=dtype)
    else:
        module = ColumnParallelLinear(
            HIDDEN, rows, config=cfg, init_method=torch.nn.init.zeros_, bias=False
        )
        module.weight.data = module.weight.data.to(dtype)
    module.config = cfg
    return module


def theirs_and_ours(
    bridge_class: str, canonical: str, kind: str, full_rows: int, stored: str, param: str
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Rank's parameter as the bridge's mapping makes it and as megastart's translation makes
    it (from three uneven row blocks of each HF tensor, in the dtype the stream carries them
    in), and the transform's name."""
    from megastart.loader.mapping.bridge import bridge_table
    from megastart.loader.mapping.transforms import TRANSFORMS, Rows, Shard, travels_as_stored

    import_megatron_bridge()
    from megatron.bridge.models.conversion import param_mapping

    with megatron({"tp": torch.distributed.get_world_size()}):
        tp = torch.distributed.get_world_size()
        rank = torch.distributed.get_rank()
        module = holder(
            kind, full_rows, getattr(torch, param), gate=bridge_class != "Qwen3VLBridge"
        )
        local = tuple(module.weight.shape)
        mapping = _mapping(bridge_class, canonical, param_mapping)
        hf = _hf_tensors(mapping, getattr(torch, stored))
        table = bridge_table(
            _bridge(bridge_class, mapping),
            [(canonical, module, False)],
            (),
            tied=False,
            stored=lambda name: stored,
        )
        rule = table.by_name[canonical]
        names = list(rule.hf)
        argument = hf[names[0]] if isinstance(mapping.hf_param, str) else _by_key(mapping, hf)
        theirs = mapping.hf_to_megatron(argument, module)
        ours = torch.full(local, float("nan"), dtype=getattr(torch, param))
        shard = Shard(rank, tp, 8, 4, 16)
        transform = TRANSFORMS[rule.transform]
        assert not transform.check([(n, tuple(hf[n].shape)) for n in names], local, shard)
        for index, name in enumerate(names):  # in the dtype it travels in
            whole = hf[name] if travels_as_stored(rule.transform) else hf[name].to(ours.dtype)
            total = whole.shape[0]
            for start, stop in ((0, total // 3), (total // 3, total - 1), (total - 1, total)):
                rows = Rows(start, stop, total)
                for first, last, piece in transform.blocks(
                    index, whole[start:stop], rows, local, shard
                ):
                    ours[first:last] = piece
        return theirs.to(ours.dtype), ours, rule.transform


def _mapping(bridge_class: str, canonical: str, param_mapping: Any) -> Any:
    """The bridge's own mapping of ``canonical`` (``bridge_class`` a bridge, or a mapping class
    built as the bridges build it)."""
    if bridge_class == "MambaConv1dMapping":
        return param_mapping.MambaConv1dMapping(canonical, "model.layers.0.mixer.conv1d.weight")
    return _bridge(bridge_class, None).mapping_registry().megatron_to_hf_lookup(canonical)


def _bridge(bridge_class: str, mapping: Any) -> Any:
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.qwen import qwen3_next_bridge, qwen35_bridge
    from megatron.bridge.models.qwen_vl import qwen3_vl_bridge
    from megatron.bridge.models.stepfun import step35_bridge

    classes = {
        "Qwen3NextBridge": qwen3_next_bridge.Qwen3NextBridge,
        "Qwen35Bridge": qwen35_bridge.Qwen35Bridge,
        "Qwen3VLBridge": qwen3_vl_bridge.Qwen3VLBridge,  # its ViT's fused qkv
        "Step35Bridge": step35_bridge.Step35Bridge,
    }
    if bridge_class in classes:
        return classes[bridge_class]()

    class OneMapping(MegatronModelBridge):  # type: ignore[misc]
        def mapping_registry(self) -> Any:
            return MegatronMappingRegistry(mapping)

        def provider_bridge(self, hf_pretrained: Any) -> Any:
            raise NotImplementedError

    return OneMapping()


def _hf_tensors(mapping: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random HF tensors of the shapes the mapping's HF side has for :func:`config`."""
    generator = torch.Generator().manual_seed(0)
    scalar_gate = not isinstance(mapping.hf_param, str) and "g" in mapping.hf_param
    kd, vd = GDN["linear_key_head_dim"], GDN["linear_value_head_dim"]
    qk, v = GDN["linear_num_key_heads"] * kd, GDN["linear_num_value_heads"] * vd
    heads_v = GDN["linear_num_value_heads"]
    mamba_x = MAMBA["mamba_num_heads"] * MAMBA["mamba_head_dim"]
    mamba_bc = MAMBA["mamba_state_dim"] * MAMBA["mamba_num_groups"]
    shapes = {
        "in_proj_qkvz": (2 * qk + 2 * v, HIDDEN),
        "in_proj_ba": (2 * heads_v, HIDDEN),
        "in_proj_qkv": (2 * qk + v, HIDDEN),
        "in_proj_z": (v, HIDDEN),
        "in_proj_b": (heads_v, HIDDEN),
        "in_proj_a": (heads_v, HIDDEN),
        "linear_attn.conv1d": (2 * qk + v, 1, 4),
        "mixer.conv1d": (mamba_x + 2 * mamba_bc, 1, 4),
        "q_proj": (8 * 16 * (1 if scalar_gate else 2), HIDDEN),  # [q, gate] per head without g
        "g_proj": (8, HIDDEN),
        "k_proj": (4 * 16, HIDDEN),
        "v_proj": (4 * 16, HIDDEN),
        "linear_attn.norm": (kd,),
        "attn.qkv": ((8 + 2 * 4) * 16, HIDDEN),
    }
    names = [mapping.hf_param] if isinstance(mapping.hf_param, str) else mapping.hf_param.values()
    out = {}
    for name in names:
        shape = next(s for key, s in shapes.items() if f"{key}." in name)
        out[name] = (torch.randn(shape, generator=generator) + 1).to(dtype)
    return out


def _by_key(mapping: Any, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: hf[name] for key, name in mapping.hf_param.items()}


def full_dim_norm(which: str, key_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M2's ``_FullDimRMSNorm`` (``which``: ``q`` or ``k``) at TP2 with ``key_heads``
    key heads: the rows its own ``sharded_state_dict`` says this rank holds of a random HF
    norm, and what megastart's translation of the bridge's mapping places."""
    from megastart.loader.mapping.bridge import bridge_table
    from megastart.loader.mapping.transforms import TRANSFORMS, Shard

    import_megatron_bridge()
    from megatron.bridge.models.minimax_m2 import minimax_m2_bridge, minimax_m2_provider
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    with megatron({"tp": 2}):
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=8,
            num_query_groups=key_heads,
            kv_channels=16,
            tensor_model_parallel_size=2,
            use_cpu_initialization=True,
        )
        norm_class = {"q": minimax_m2_provider.FullDimQNorm, "k": minimax_m2_provider.FullDimKNorm}
        module = norm_class[which](16, cfg)
        canonical = f"decoder.layers.0.self_attention.{which}_layernorm.weight"
        mapping = minimax_m2_bridge._FullDimQKNormMapping(
            canonical, f"self_attn.{which}_norm.weight"
        )
        heads = 8 if which == "q" else key_heads
        full = torch.randn(heads * 16, generator=torch.Generator().manual_seed(0))
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        declared = module.sharded_state_dict("", (), {"dp_cp_group": group})["weight"]
        start = declared.global_offset[0]
        expected = full[start : start + module.weight.shape[0]]
        rule = bridge_table(
            _bridge("", mapping), [(canonical, module, False)], (), tied=False
        ).by_name[canonical]
        local = tuple(module.weight.shape)
        shard = Shard(torch.distributed.get_rank(), 2, 8, key_heads, 16)
        transform = TRANSFORMS[rule.transform]
        assert not transform.check([(rule.hf[0], tuple(full.shape))], local, shard)
        ours = torch.full(local, float("nan"))
        for first, stop, piece in transform.pieces([full], local, shard):
            ours[first:stop] = piece
        return expected, ours


def mimo_input_proj() -> tuple[torch.Tensor, torch.Tensor, str]:
    """MiMo's MTP ``eh_proj`` at TP2: the bridge's hook and mapping on a random HF
    ``input_proj``, and megastart's translation placing it from three row blocks."""
    from megastart.loader.mapping.bridge import bridge_table
    from megastart.loader.mapping.transforms import TRANSFORMS, Rows, Shard

    import_megatron_bridge()
    from megatron.bridge.models.mimo.mimo_bridge import MimoBridge

    with megatron({"tp": 2}):
        module = holder("linear", 2 * HIDDEN, torch.float32)
        canonical, name = "mtp.layers.0.eh_proj.weight", "model.mtp_layers.0.input_proj.weight"
        bridge = MimoBridge()
        mapping = bridge.mapping_registry().megatron_to_hf_lookup(canonical)
        whole = torch.randn(2 * HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(0))
        theirs = mapping.hf_to_megatron(
            bridge.maybe_modify_loaded_hf_weight(name, {name: whole}), module
        )
        rule = bridge_table(bridge, [(canonical, module, False)], (), tied=False).by_name[canonical]
        local = tuple(module.weight.shape)
        shard = Shard(torch.distributed.get_rank(), 2, 8, 4, 16)
        transform = TRANSFORMS[rule.transform]
        assert rule.hf == (name,) and not transform.check(
            [(name, tuple(whole.shape))], local, shard
        )
        ours = torch.full(local, float("nan"))
        total = whole.shape[0]
        for start, stop in ((0, 50), (50, 51), (51, total)):
            for first, last, piece in transform.blocks(
                0, whole[start:stop], Rows(start, stop, total), local, shard
            ):
                ours[first:last] = piece
        return theirs, ours, rule.transform


def gpt_oss_experts(intermediate: int) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """gpt-oss's expert 3 (``linear_fc1`` / ``linear_fc2`` weights and biases, sequential
    experts) at TP2 with expert TP 1: the bridge's hook and mapping on bf16-layout HF tensors
    (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]`` as transformers writes them), and
    megastart's translation placing each from row blocks of two experts."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from transformers import GptOssConfig

    from megastart.loader.mapping.bridge import bridge_table
    from megastart.loader.mapping.transforms import TRANSFORMS, Rows, Shard

    import_megatron_bridge()
    from megatron.bridge.models.gpt_oss.gpt_oss_bridge import GPTOSSBridge

    experts, hidden = 4, HIDDEN
    hf_config = GptOssConfig(hidden_size=hidden, intermediate_size=intermediate)
    generator = torch.Generator().manual_seed(0)
    layer = "model.layers.0.mlp.experts."
    hf = {
        layer + "gate_up_proj": torch.randn(experts, hidden, 2 * intermediate, generator=generator),
        layer + "gate_up_proj_bias": torch.randn(experts, 2 * intermediate, generator=generator),
        layer + "down_proj": torch.randn(experts, intermediate, hidden, generator=generator),
        layer + "down_proj_bias": torch.randn(experts, hidden, generator=generator),
    }
    out = []
    with megatron({"tp": 2, "etp": 1}):
        cfg = config()
        init = dict(config=cfg, init_method=torch.nn.init.zeros_, bias=True, is_expert=True)
        fc1 = ColumnParallelLinear(hidden, 2 * intermediate, gather_output=False, **init)
        fc2 = RowParallelLinear(
            intermediate, hidden, input_is_parallel=True, skip_bias_add=False, **init
        )
        bridge = GPTOSSBridge()
        bridge.hf_pretrained = SimpleNamespace(config=hf_config)  # what its hook reads
        registry = bridge.mapping_registry()
        expert = "decoder.layers.0.mlp.experts.local_experts.3."
        shard = Shard(torch.distributed.get_rank(), 2, 8, 4, 16, expert_tp_rank=0, expert_tp_size=1)
        for module, param in (
            (fc1, "linear_fc1.weight"),
            (fc1, "linear_fc1.bias"),
            (fc2, "linear_fc2.weight"),
            (fc2, "linear_fc2.bias"),
        ):
            canonical = expert + param
            mapping = registry.megatron_to_hf_lookup(canonical)
            name = mapping.hf_param
            theirs = mapping.hf_to_megatron(bridge.maybe_modify_loaded_hf_weight(name, hf), module)
            rule = bridge_table(bridge, [(canonical, module, False)], (), tied=False).by_name[
                canonical
            ]
            local = tuple(getattr(module, param.split(".")[1]).shape)
            transform = TRANSFORMS[rule.transform]
            assert not transform.check([(name, tuple(hf[name].shape))], local, shard), rule
            ours = torch.full(local, float("nan"))
            for start, stop in ((0, 2), (2, 4)):
                for first, last, piece in transform.blocks(
                    0, hf[name][start:stop], Rows(start, stop, experts), local, shard
                ):
                    ours[first:last] = piece
            out.append((theirs, ours, rule.transform))
    return out
