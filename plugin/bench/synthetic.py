"""Real models' checkpoints and a rank's parameters, from ``config.json`` alone.

Synthetic but complete: every tensor's name, shape and dtype as the hub's files hold
them (DeepSeek-V3 with its FP8 scales is 91,991 tensors), and the parameters of a rank
of any layout, as Megatron-core names and shards them. ``megastart bench plan`` plans
on them; tests check them against the hub's files and plan worlds of thousands of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        num_nextn_predict_layers=1,
        vocab_size=129280,
        tie_word_embeddings=False,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    ),
    "dense-70b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "qwen3-235b-a22b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}
"""The models' ``config.json`` (the fields the checkpoint's tensors follow from)."""


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor-, pipeline- and expert-parallel sizes."""

    tp: int
    pp: int
    ep: int


def world_demands(config: dict[str, Any], meta: Any, layout: Any, world: int) -> list[Any]:
    """Every rank's demands, in Megatron's rank order (TP fastest, then data/expert parallel,
    then pipeline): rank ``r`` of stage ``r // (world / pp)`` and expert-parallel rank
    ``(r // tp) % ep``."""
    from megastart.loader.mapping.mappings import mapping_for
    from megastart.loader.mapping.needs import resolve_needs

    table = mapping_for(meta.architectures[0])
    assert table is not None
    shard = layout_shard(meta.config, layout)
    per_stage = world // layout.pp
    made: dict[tuple[int, int], list[Any]] = {}
    by_rank = []
    for rank in range(world):
        key = (rank // per_stage, (rank // layout.tp) % layout.ep)
        if key not in made:
            params = rank_parameters(config, layout, *key)
            needs = resolve_needs(params, table, meta, shard)
            made[key] = [d for need in needs for d in need.demands()]
        by_rank.append(made[key])
    return by_rank


def layout_shard(config: dict[str, Any], layout: Layout) -> Any:
    """Tensor-parallel rank 0's :class:`~megastart.loader.mapping.transforms.Shard` of ``layout``."""
    from megastart.loader.mapping.transforms import Shard

    heads = config["num_attention_heads"]
    return Shard(
        tp_rank=0,
        tp_size=layout.tp,
        num_heads=heads,
        num_query_groups=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        expert_tp_rank=0,
        expert_tp_size=layout.tp,
    )


def synthetic_checkpoint(config: dict[str, Any]) -> Any:
    """The model's checkpoint metadata as the hub's files hold it (one shard per layer)."""
    from megastart.loader.checkpoint import ITEMSIZE, CheckpointMeta, TensorEntry
    from megastart.loader.checkpoint.quantised import find_quantisation

    tensors: dict[str, TensorEntry] = {}
    offsets: dict[str, int] = {}
    for name, shape, dtype in hf_tensors(config):
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        file = f"model-{layer}.safetensors"
        start = offsets.get(file, 0)
        size = math.prod(shape) * ITEMSIZE[dtype]
        tensors[name] = TensorEntry(name, file, dtype, shape, start, start + size)
        offsets[file] = start + size
    quantisation = find_quantisation(config, {n: (e.dtype, e.shape) for n, e in tensors.items()})
    return CheckpointMeta(
        "synthetic",
        config,
        tensors,
        "safetensors",
        tuple(config["architectures"]),
        {},
        quantisation,
    )


def hf_tensors(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """Every checkpoint tensor: name, shape, dtype (FP8 projections with their scales)."""
    h, fp8 = config["hidden_size"], "quantization_config" in config
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], h), "bfloat16")
    ]
    out.append(("lm_head.weight", (config["vocab_size"], h), "bfloat16"))
    out.append(("model.norm.weight", (h,), "bfloat16"))

    def linear(name: str, rows: int, cols: int) -> None:
        if fp8:
            out.append((name, (rows, cols), "float8_e4m3fn"))
            out.append((name + "_scale_inv", (-(-rows // 128), -(-cols // 128)), "float32"))
        else:
            out.append((name, (rows, cols), "bfloat16"))

    def mlp(prefix: str, inner: int) -> None:
        linear(prefix + "gate_proj.weight", inner, h)
        linear(prefix + "up_proj.weight", inner, h)
        linear(prefix + "down_proj.weight", h, inner)

    layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "bfloat16")]
        out += [(p + "post_attention_layernorm.weight", (h,), "bfloat16")]
        heads = config["num_attention_heads"]
        if "kv_lora_rank" in config:  # MLA
            q_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
            linear(p + "self_attn.q_a_proj.weight", config["q_lora_rank"], h)
            out.append((p + "self_attn.q_a_layernorm.weight", (config["q_lora_rank"],), "bfloat16"))
            linear(p + "self_attn.q_b_proj.weight", heads * q_dim, config["q_lora_rank"])
            rank = config["kv_lora_rank"]
            linear(p + "self_attn.kv_a_proj_with_mqa.weight", rank + config["qk_rope_head_dim"], h)
            out.append((p + "self_attn.kv_a_layernorm.weight", (rank,), "bfloat16"))
            kv_rows = heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
            linear(p + "self_attn.kv_b_proj.weight", kv_rows, rank)
            linear(p + "self_attn.o_proj.weight", h, heads * config["v_head_dim"])
        else:
            d, kv = config["head_dim"], config["num_key_value_heads"]
            linear(p + "self_attn.q_proj.weight", heads * d, h)
            linear(p + "self_attn.k_proj.weight", kv * d, h)
            linear(p + "self_attn.v_proj.weight", kv * d, h)
            linear(p + "self_attn.o_proj.weight", h, heads * d)
            if _qk_norm(config):
                out += [(p + f"self_attn.{n}_norm.weight", (d,), "bfloat16") for n in "qk"]
        experts = expert_count(config)
        if i < config.get("first_k_dense_replace", 0) or not experts:
            mlp(p + "mlp.", config["intermediate_size"])
            continue
        out.append((p + "mlp.gate.weight", (experts, h), "bfloat16"))
        if "n_routed_experts" in config:
            out.append((p + "mlp.gate.e_score_correction_bias", (experts,), "float32"))
            mlp(
                p + "mlp.shared_experts.",
                config["moe_intermediate_size"] * config["n_shared_experts"],
            )
        for j in range(experts):
            mlp(p + f"mlp.experts.{j}.", config["moe_intermediate_size"])
    if config.get("num_nextn_predict_layers"):  # the MTP layer's own tensors
        p = f"model.layers.{config['num_hidden_layers']}."
        out += [
            (p + n, (h,), "bfloat16")
            for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")
        ]
        out.append((p + "eh_proj.weight", (h, 2 * h), "bfloat16"))
    return out


def rank_parameters(
    config: dict[str, Any], layout: Layout, stage: int = 0, expert_rank: int = 0
) -> list[Any]:
    """The parameters of a rank of pipeline stage ``stage`` and expert-parallel rank
    ``expert_rank`` for ``layout``, with canonical names and local shapes: the embedding on
    the first stage, the final norm and head on the last."""
    from megastart.loader.mapping.needs import ParamInfo

    h, tp = config["hidden_size"], layout.tp
    layers = config["num_hidden_layers"]
    per_stage = -(-layers // layout.pp)
    heads = config["num_attention_heads"]
    vocab = -(-config["vocab_size"] // (128 * tp)) * 128 * tp
    out: list[tuple[str, tuple[int, ...]]] = []
    if stage == 0:
        out.append(("embedding.word_embeddings.weight", (vocab // tp, h)))
    if stage == layout.pp - 1:
        out += [("decoder.final_layernorm.weight", (h,)), ("output_layer.weight", (vocab // tp, h))]
    experts = expert_count(config)
    for i in range(stage * per_stage, min(layers, (stage + 1) * per_stage)):
        p = f"decoder.layers.{i}."
        out.append((p + "input_layernorm.weight", (h,)))
        a = p + "self_attention."
        if "kv_lora_rank" in config:
            q_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
            rank = config["kv_lora_rank"]
            out += [
                (a + "linear_q_down_proj.weight", (config["q_lora_rank"] // tp, h)),
                (a + "q_layernorm.weight", (config["q_lora_rank"],)),
                (a + "linear_q_up_proj.weight", (heads * q_dim // tp, config["q_lora_rank"])),
                (a + "linear_kv_down_proj.weight", ((rank + config["qk_rope_head_dim"]) // tp, h)),
                (a + "kv_layernorm.weight", (rank,)),
                (
                    a + "linear_kv_up_proj.weight",
                    (heads * (config["qk_nope_head_dim"] + config["v_head_dim"]) // tp, rank),
                ),
                (a + "linear_proj.weight", (h, heads * config["v_head_dim"] // tp)),
            ]
        else:
            d, kv = config["head_dim"], config["num_key_value_heads"]
            out += [
                (a + "linear_qkv.weight", ((heads + 2 * kv) * d // tp, h)),
                (a + "linear_proj.weight", (h, heads * d // tp)),
            ]
            if _qk_norm(config):
                out += [(a + "q_layernorm.weight", (d,)), (a + "k_layernorm.weight", (d,))]
        out.append((p + "pre_mlp_layernorm.weight", (h,)))
        if i < config.get("first_k_dense_replace", 0) or not experts:
            inner = config["intermediate_size"] // tp
            out += [
                (p + "mlp.linear_fc1.weight", (2 * inner, h)),
                (p + "mlp.linear_fc2.weight", (h, inner)),
            ]
            continue
        out.append((p + "mlp.router.weight", (experts, h)))
        if "n_routed_experts" in config:
            out.append((p + "mlp.router.expert_bias", (experts,)))
            inner = config["moe_intermediate_size"] * config["n_shared_experts"] // tp
            out += [
                (p + "mlp.shared_experts.linear_fc1.weight", (2 * inner, h)),
                (p + "mlp.shared_experts.linear_fc2.weight", (h, inner)),
            ]
        inner = config["moe_intermediate_size"] // tp
        per_rank = experts // layout.ep
        for j in range(expert_rank * per_rank, (expert_rank + 1) * per_rank):
            e = p + f"mlp.experts.local_experts.{j}."
            out += [
                (e + "linear_fc1.weight", (2 * inner, h)),
                (e + "linear_fc2.weight", (h, inner)),
            ]
    return [ParamInfo(0, name, name, shape, "bfloat16") for name, shape in out]


def _qk_norm(config: dict[str, Any]) -> bool:
    """Whether attention normalises queries and keys per head (Qwen3)."""
    return str(config["model_type"]).startswith("qwen3")


def expert_count(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer, in each family's spelling (0: dense)."""
    from megastart.loader.mapping.experts import EXPERT_COUNT_KEYS

    return int(next((config[k] for k in EXPERT_COUNT_KEYS if config.get(k)), 0))
