"""What each rank runs in the tests of INT4 releases, where no model can be built (Kimi-K2.5's
vision tower is the hub's remote code): its bridge's hook and own mapping on a routed
expert's HF tensors, beside megastart's translation of the same mapping placing row blocks of
the packed tensors, each dequantised as it is copied, on real Megatron-core layers of the
parameters' local shapes."""

from __future__ import annotations

from typing import Any

import torch

from support.bridge_ranks import import_megatron_bridge
from support.layout_ranks import HIDDEN, config
from support.loader_ranks import megatron
from support.quantise import int4_packed


def kimi_k25_int4_expert(intermediate: int) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """Kimi-K2.5's expert 3 of layer 1 (``linear_fc1`` from ``gate_proj`` and ``up_proj``,
    ``linear_fc2`` from ``down_proj``), at expert TP 2, both from INT4 ``weight_packed`` /
    ``weight_scale``: the bridge's hook dequantising whole tensors and its mapping splitting
    them, and megastart's translation, from three uneven row blocks of each packed tensor."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megastart.loader.checkpoint.quantised import INT4, logical_shape
    from megastart.loader.mapping.bridge import bridge_table
    from megastart.loader.mapping.transforms import TRANSFORMS, Rows, Shard
    from megastart.loader.mapping.unpack import Packed

    import_megatron_bridge()
    from megatron.bridge.models.kimi_vl.kimi_k25_vl_bridge import KimiK25VLBridge

    generator = torch.Generator().manual_seed(0)
    expert = "language_model.model.layers.1.mlp.experts.3."
    shapes = {"gate_proj": (intermediate, HIDDEN), "up_proj": (intermediate, HIDDEN)}
    shapes["down_proj"] = (HIDDEN, intermediate)
    hf: dict[str, torch.Tensor] = {}
    for projection, shape in shapes.items():
        weight = torch.randn(*shape, generator=generator).bfloat16()
        for suffix, tensor in int4_packed(weight).items():
            hf[f"{expert}{projection}.weight{suffix}"] = tensor
    out = []
    tp, rank = 2, torch.distributed.get_rank()
    with megatron({"tp": tp}):
        init = dict(config=config(), init_method=torch.nn.init.zeros_, bias=False, is_expert=True)
        fc1 = ColumnParallelLinear(HIDDEN, 2 * intermediate, gather_output=False, **init)
        fc2 = RowParallelLinear(
            intermediate, HIDDEN, input_is_parallel=True, skip_bias_add=False, **init
        )
        bridge = KimiK25VLBridge()
        registry = bridge.mapping_registry()
        local_expert = "language_model.decoder.layers.1.mlp.experts.local_experts.3."
        shard = Shard(rank, tp, 8, 4, 16, expert_tp_rank=rank, expert_tp_size=tp)
        for module, param in ((fc1, "linear_fc1.weight"), (fc2, "linear_fc2.weight")):
            canonical = local_expert + param
            mapping = registry.megatron_to_hf_lookup(canonical)
            theirs = mapping.hf_to_megatron(
                bridge.maybe_modify_loaded_hf_weight(mapping.hf_param, hf), module
            )
            rule = bridge_table(
                bridge, [(canonical, module, False)], (), tied=False, stored=_dtype(hf)
            ).by_name[canonical]
            local = tuple(module.weight.shape)
            transform = TRANSFORMS[rule.transform]
            named = [(n, logical_shape(INT4, tuple(hf[n + "_packed"].shape))) for n in rule.hf]
            assert not transform.check(named, local, shard), rule
            ours = torch.full(local, float("nan"))
            for index, name in enumerate(rule.hf):
                values, scales = hf[name + "_packed"], hf[name + "_scale"]
                total = values.shape[0]
                for start, stop in ((0, total // 3), (total // 3, total - 1), (total - 1, total)):
                    held = Packed.whole(values[start:stop], scales[start:stop], INT4)
                    for first, last, piece in transform.blocks(
                        index, held, Rows(start, stop, total), local, shard
                    ):
                        ours[first:last] = piece.dequantised()
            out.append((theirs.float(), ours, rule.transform))
    return out


def _dtype(hf: dict[str, torch.Tensor]) -> Any:
    return lambda name: str(hf[name].dtype).removeprefix("torch.") if name in hf else None
