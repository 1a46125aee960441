"""The plan on names and shapes alone: mapping tables (local and Transformer-Engine names),
validation messages, buckets, and registration of further tables through entry points."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pyrun import run_python

from megastart.loader.checkpoint import CheckpointMeta, TensorEntry
from megastart.loader.mappings import QWEN3, mapping_for
from megastart.loader.plan import ParamInfo, PlanError, build_plan, resolve_needs, unused_tensors
from megastart.loader.transforms import Shard

HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 8, 4, 16, 96, 300, 2


def hf_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (GROUPS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (GROUPS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return shapes


def checkpoint(shapes: dict[str, tuple[int, ...]]) -> CheckpointMeta:
    """Metadata as the reader would broadcast it; tensors laid out in one file, 4 bytes each."""
    entries, offset = {}, 0
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        entries[name] = TensorEntry(
            name, "model.safetensors", "float32", shape, offset, offset + 4 * numel
        )
        offset += 4 * numel
    config = {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False}
    return CheckpointMeta("/ckpt", config, entries, "safetensors")


def megatron_params(tp: int, *, te_spec: bool) -> list[ParamInfo]:
    """Canonical names and local shapes of a Qwen3 GPTModel shard, as Megatron builds it."""
    padded = -(-VOCAB // (128 * tp)) * 128 * tp
    qkv_rows = (HEADS + 2 * GROUPS) * HEAD_DIM // tp
    names: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (padded // tp, HIDDEN),
        "decoder.final_layernorm.weight": (HIDDEN,),
        "output_layer.weight": (padded // tp, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        input_norm = (
            "self_attention.linear_qkv.layer_norm_weight" if te_spec else "input_layernorm.weight"
        )
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te_spec else "pre_mlp_layernorm.weight"
        names |= {
            p + input_norm: (HIDDEN,),
            p + "self_attention.linear_qkv.weight": (qkv_rows, HIDDEN),
            p + "self_attention.linear_proj.weight": (HIDDEN, HEADS * HEAD_DIM // tp),
            p + "self_attention.q_layernorm.weight": (HEAD_DIM,),
            p + "self_attention.k_layernorm.weight": (HEAD_DIM,),
            p + mlp_norm: (HIDDEN,),
            p + "mlp.linear_fc1.weight": (2 * FFN // tp, HIDDEN),
            p + "mlp.linear_fc2.weight": (HIDDEN, FFN // tp),
        }
    return [ParamInfo(0, n, n, s, "float32") for n, s in names.items()]


def shard(tp: int, rank: int = 0) -> Shard:
    return Shard(
        tp_rank=rank, tp_size=tp, num_heads=HEADS, num_query_groups=GROUPS, head_dim=HEAD_DIM
    )


def test_local_and_transformer_engine_names_need_the_same_tensors() -> None:
    meta = checkpoint(hf_shapes())
    local = resolve_needs(megatron_params(2, te_spec=False), QWEN3, meta, shard(2))
    te = resolve_needs(megatron_params(2, te_spec=True), QWEN3, meta, shard(2))
    assert [(n.hf, n.transform) for n in local] == [(n.hf, n.transform) for n in te]
    norms = {
        n.param.name: n.hf for n in te if "norm" in n.param.name and "layers.1." in n.param.name
    }
    assert norms["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"] == (
        "model.layers.1.input_layernorm.weight",
    )
    assert norms["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"] == (
        "model.layers.1.post_attention_layernorm.weight",
    )
    assert unused_tensors([[(n.hf, "float32") for n in te]], meta, QWEN3) == []


def test_tp_that_does_not_divide_query_groups_is_refused_with_the_sizes() -> None:
    params = megatron_params(
        1, te_spec=False
    )  # shapes do not matter: the division is checked first
    with pytest.raises(PlanError, match=r"tensor-parallel size 3 must divide the 4 query groups"):
        resolve_needs(params, QWEN3, checkpoint(hf_shapes()), shard(3))


def test_shape_mismatch_names_hf_tensor_megatron_parameter_and_both_shapes() -> None:
    shapes = hf_shapes()
    shapes["model.layers.1.mlp.down_proj.weight"] = (FFN, HIDDEN)  # transposed
    with pytest.raises(PlanError) as e:
        resolve_needs(
            megatron_params(2, te_spec=False), QWEN3, checkpoint(shapes), shard(2, rank=1)
        )
    message = str(e.value)
    assert (
        "HF tensor 'model.layers.1.mlp.down_proj.weight' has shape [96, 64], expected [64, 96]"
        in message
    )
    assert "Megatron parameter 'decoder.layers.1.mlp.linear_fc2.weight'" in message
    assert "shape [64, 48]" in message
    assert "tensor-parallel rank 1 of 2" in message


def test_missing_tensor_is_named_with_the_parameter_that_needs_it() -> None:
    shapes = hf_shapes()
    del shapes["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(
        PlanError, match=r"\['model.layers.0.self_attn.k_proj.weight'\] missing from checkpoint"
    ):
        resolve_needs(megatron_params(1, te_spec=False), QWEN3, checkpoint(shapes), shard(1))


def test_tied_checkpoint_feeds_the_output_layer_from_the_embedding() -> None:
    shapes = hf_shapes()
    del shapes["lm_head.weight"]
    meta = checkpoint(shapes)
    meta.config["tie_word_embeddings"] = True
    needs = resolve_needs(megatron_params(1, te_spec=False), QWEN3, meta, shard(1))
    assert {n.param.name: n.hf for n in needs}["output_layer.weight"] == (
        "model.embed_tokens.weight",
    )


def test_buckets_keep_fused_inputs_together_and_respect_the_size() -> None:
    meta = checkpoint(hf_shapes())
    needs_by_rank = [
        [
            (n.hf, "bfloat16")
            for n in resolve_needs(megatron_params(2, te_spec=False), QWEN3, meta, shard(2, r))
        ]
        for r in range(2)
    ]
    bucket_bytes = 2 * FFN * HIDDEN * 2  # exactly one gate/up pair in bf16
    plan = build_plan(needs_by_rank, meta, bucket_bytes=bucket_bytes)
    assert plan == build_plan(needs_by_rank, meta, bucket_bytes=bucket_bytes)  # deterministic
    where = {slot.name: i for i, bucket in enumerate(plan.buckets) for slot in bucket.slots}
    assert sorted(where) == sorted(meta.tensors)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        assert len({where[p + f"self_attn.{x}_proj.weight"] for x in "qkv"}) == 1
        assert where[p + "mlp.gate_proj.weight"] == where[p + "mlp.up_proj.weight"]
    vocab_bytes = VOCAB * HIDDEN * 2
    assert all(b.nbytes <= max(bucket_bytes, vocab_bytes) for b in plan.buckets)
    slots = [slot for bucket in plan.buckets for slot in bucket.slots]
    assert all(slot.dtype == "bfloat16" and slot.offset % 64 == 0 for slot in slots)
    assert [slot.name for slot in slots] == list(meta.tensors)  # read front to back


def test_mapping_tables_register_through_entry_points(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "toy_mapping-1.0.dist-info").mkdir(parents=True)
    (site / "toy_mapping-1.0.dist-info" / "METADATA").write_text(
        "Name: toy-mapping\nVersion: 1.0\n"
    )
    (site / "toy_mapping-1.0.dist-info" / "entry_points.txt").write_text(
        "[megastart.mappings]\ntoy = toy_mapping:TABLE\n"
    )
    (site / "toy_mapping.py").write_text(
        textwrap.dedent(
            """
            from megastart.loader.mappings import DENSE_DECODER_RULES, MappingTable
            TABLE = MappingTable(("ToyForCausalLM",), DENSE_DECODER_RULES)
            """
        )
    )
    proc = run_python(
        """
        from megastart.loader.mappings import mapping_for
        print(mapping_for("ToyForCausalLM").architectures, mapping_for("LlamaForCausalLM") is not None)
        """,
        env={"PYTHONPATH": str(site)},
    )
    assert proc.stdout.strip() == "('ToyForCausalLM',) True"
    assert mapping_for("ToyForCausalLM") is None  # not registered in this process
