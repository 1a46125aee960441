"""The plan on names and shapes alone: mapping tables (local and Transformer-Engine names),
validation messages, buckets, and registration of further tables through entry points."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from support.pyrun import run_python

from megastart.errors import PlanError
from megastart.loader.checkpoint import CheckpointMeta, TensorEntry
from megastart.loader.mapping.mappings import QWEN3, mapping_for
from megastart.loader.mapping.needs import (
    Need,
    ParamInfo,
    check_config,
    left_to_host,
    resolve_needs,
)
from megastart.loader.mapping.transforms import TRANSFORMS, Shard
from megastart.loader.plan.buckets import (
    Plan,
    build_plan,
    demands_once,
    packed,
    unused_tensors,
)
from megastart.loader.plan.verify import Coverage

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


def critic_params(tp: int) -> list[ParamInfo]:
    """A value model's shard as verl builds it: the LM head replaced by a one-output head."""
    params = [p for p in megatron_params(tp, te_spec=False) if p.name != "output_layer.weight"]
    return [
        *params,
        ParamInfo(0, "output_layer.weight", "output_layer.weight", (1, HIDDEN), "float32"),
    ]


def reward_checkpoint(head: tuple[int, ...] = (1, HIDDEN)) -> CheckpointMeta:
    """A ``*ForSequenceClassification`` checkpoint: the decoder and ``score.weight``, no LM head."""
    shapes = hf_shapes()
    del shapes["lm_head.weight"]
    meta = checkpoint({**shapes, "score.weight": head})
    meta.config["architectures"] = ["Qwen3ForSequenceClassification"]
    return meta


@pytest.mark.parametrize("tied", [False, True])
def test_value_head_without_a_reward_head_in_the_checkpoint_is_left_to_the_host(tied: bool) -> None:
    shapes = hf_shapes()
    if tied:
        del shapes["lm_head.weight"]
    meta = checkpoint(shapes)
    meta.config["tie_word_embeddings"] = tied
    params = critic_params(2)
    needs = resolve_needs(params, QWEN3, meta, shard(2), value_model=True)
    assert [p.name for p in left_to_host(params, needs)] == ["output_layer.weight"]
    assert all(n.param.name != "output_layer.weight" for n in needs)
    # neither the vocabulary LM head nor the embedding is copied into it; neither is "unused"
    assert unused_tensors([[(n.hf, "float32") for n in needs]], meta, QWEN3, value_model=True) == []


def test_value_head_reads_the_score_head_of_a_reward_checkpoint() -> None:
    meta = reward_checkpoint()
    table = mapping_for("Qwen3ForSequenceClassification")
    assert table is QWEN3
    params = critic_params(2)
    needs = resolve_needs(params, table, meta, shard(2, rank=1), value_model=True)
    head = {n.param.name: n for n in needs}["output_layer.weight"]
    assert (head.hf, head.transform) == (("score.weight",), "replicated")
    assert left_to_host(params, needs) == []


def test_a_score_head_of_another_shape_is_not_a_value_head() -> None:
    params = critic_params(1)
    needs = resolve_needs(params, QWEN3, reward_checkpoint((2, HIDDEN)), shard(1), value_model=True)
    assert [p.name for p in left_to_host(params, needs)] == ["output_layer.weight"]


def test_value_model_does_not_need_the_checkpoint_tied_like_the_model() -> None:
    megatron = {"share_embeddings_and_output_weights": False}
    tied = {"tie_word_embeddings": True}
    check_config(QWEN3, tied, megatron, checkpoint="/ckpt", value_model=True)
    with pytest.raises(PlanError, match=r"tie_word_embeddings=True in config\.json"):
        check_config(QWEN3, tied, megatron, checkpoint="/ckpt")


def test_value_model_whose_output_layer_is_the_lm_head_is_refused() -> None:
    with pytest.raises(PlanError, match=r"'output_layer.weight' .*is not a value head"):
        resolve_needs(
            megatron_params(1, te_spec=False),
            QWEN3,
            checkpoint(hf_shapes()),
            shard(1),
            value_model=True,
        )


def test_reward_checkpoint_loaded_as_a_language_model_names_its_reward_head() -> None:
    with pytest.raises(
        PlanError, match=r"\['lm_head.weight'\] missing .*reward head \['score.weight'\]"
    ):
        resolve_needs(megatron_params(1, te_spec=False), QWEN3, reward_checkpoint(), shard(1))


def needs_and_plan(tp: int, bucket_bytes: int) -> tuple[CheckpointMeta, list[list[Need]], Plan]:
    meta = checkpoint(hf_shapes())
    needs = [
        resolve_needs(megatron_params(tp, te_spec=False), QWEN3, meta, shard(tp, r))
        for r in range(tp)
    ]
    demands = [[(n.hf, "float32") for n in rank_needs] for rank_needs in needs]
    return meta, needs, build_plan(demands, meta, bucket_bytes=bucket_bytes)


def test_no_bucket_exceeds_the_size_tensors_larger_travel_as_row_blocks() -> None:
    bucket_bytes = FFN * HIDDEN * 4 // 3  # a third of a gate/up tensor; the embedding is 9 of them
    meta, _, plan = needs_and_plan(2, bucket_bytes)
    assert plan == needs_and_plan(2, bucket_bytes)[2]  # deterministic
    assert max(b.nbytes for b in plan.buckets) <= bucket_bytes
    slots = [slot for bucket in plan.buckets for slot in bucket.slots]
    assert all(slot.dtype == "float32" and slot.offset % 64 == 0 for slot in slots)
    assert list(dict.fromkeys(slot.name for slot in slots)) == list(meta.tensors)  # front to back
    for name, entry in meta.tensors.items():
        rows = [slot.rows for slot in slots if slot.name == name]
        assert [(r.start, r.stop) for r in rows] == list(
            zip([0] + [r.stop for r in rows[:-1]], [r.stop for r in rows], strict=True)
        ) and rows[-1].stop == entry.shape[0], name  # consecutive, every row once
    embedding = [s for s in slots if s.name == "model.embed_tokens.weight"]
    assert len(embedding) == -(-VOCAB * HIDDEN * 4 // bucket_bytes)


@pytest.mark.parametrize("tp", [1, 2])
def test_row_blocks_load_exactly_what_whole_tensors_load(tp: int) -> None:
    """Each rank's parameters from row blocks in small buckets equal the whole-tensor transforms'."""
    torch = pytest.importorskip("torch")
    meta, needs, plan = needs_and_plan(tp, bucket_bytes=1000)
    generator = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(e.shape, generator=generator) for n, e in meta.tensors.items()}
    for rank, rank_needs in enumerate(needs):
        expected = {n.param.name: torch.full(n.param.shape, torch.nan) for n in rank_needs}
        for need in rank_needs:
            transform = TRANSFORMS[need.transform]
            for first, stop, block in transform.pieces(
                [hf[n] for n in need.hf], need.param.shape, shard(tp, rank)
            ):
                expected[need.param.name][first:stop] = block
        loaded = {name: torch.full_like(t, torch.nan) for name, t in expected.items()}
        coverage = Coverage()
        for slot in (slot for bucket in plan.buckets for slot in bucket.slots):
            rows = hf[slot.name][
                slot.rows.start : slot.rows.stop
            ].clone()  # what the bucket carries
            for need in rank_needs:
                if slot.name not in need.hf:
                    continue
                blocks = TRANSFORMS[need.transform].blocks(
                    need.hf.index(slot.name), rows, slot.rows, need.param.shape, shard(tp, rank)
                )
                for first, stop, block in blocks:
                    loaded[need.param.name][first:stop] = block
                    coverage.record(need.param, first, stop)
        coverage.check([n.param for n in rank_needs])
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), (rank, name)


def test_each_bucket_goes_to_the_reader_and_the_ranks_that_need_it_only() -> None:
    """Rank 1 shares stage 0 with the reader (TP peers); rank 2 is stage 1."""
    meta = checkpoint(hf_shapes())
    stage = [
        [n for n in meta.tensors if "layers.0." in n or "embed" in n],
        [
            n
            for n in meta.tensors
            if "layers.1." in n or n in ("model.norm.weight", "lm_head.weight")
        ],
    ]
    demands = [[((n,), "float32") for n in names] for names in (stage[0], stage[0], stage[1])]
    plan = build_plan(demands, meta, bucket_bytes=FFN * HIDDEN * 4)
    assert plan.receiver_sets == [(0, 1), (0, 2)]
    assert {bucket.positions for bucket in plan.buckets} == {(0, 1), (0, 2)}
    for bucket in plan.buckets:
        for slot in bucket.slots:
            needed_by = (0, *[r for r in (1, 2) if slot.name in {n for (n,), _ in demands[r]}])
            assert bucket.positions == needed_by, slot.name
    assert max(b.nbytes for b in plan.buckets) <= FFN * HIDDEN * 4


def test_replicas_demands_arrive_as_one_object_and_plan_as_separate_ones() -> None:
    """Ranks that shared the same demands (TP and DP replicas) get one list between them;
    the plan, the receiver sets and the unused tensors are the same as from copies, with and
    without the reader in every bucket."""
    meta = checkpoint(hf_shapes())
    first = [((n,), "float32") for n in meta.tensors if "layers.0." in n or "embed" in n]
    second = [((n,), "bfloat16") for n in meta.tensors if "layers.1." in n]
    pickled = [packed(d, meta) for d in (first, first, second, first, second)] + [b""]
    shared = demands_once(pickled, meta)
    assert shared[0] is shared[1] is shared[3] and shared[2] is shared[4]
    assert shared[0] == first and shared[2] == second and shared[5] == []
    copies = [list(d) for d in shared]
    assert copies[0] is not copies[1]
    table = mapping_for("Qwen3ForCausalLM")
    assert unused_tensors(shared, meta, table) == unused_tensors(copies, meta, table)
    for to_reader in (True, False):
        assert build_plan(shared, meta, bucket_bytes=4096, to_reader=to_reader) == build_plan(
            copies, meta, bucket_bytes=4096, to_reader=to_reader
        )
    assert build_plan(shared, meta, bucket_bytes=4096, to_reader=False).receiver_sets == [
        (0, 1, 3),
        (2, 4),
    ]


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
            from megastart.loader.mapping.mappings import DENSE_DECODER_RULES, MappingTable
            TABLE = MappingTable(("ToyForCausalLM",), DENSE_DECODER_RULES)
            """
        )
    )
    proc = run_python(
        """
        from megastart.loader.mapping.mappings import mapping_for
        print(mapping_for("ToyForCausalLM").architectures, mapping_for("LlamaForCausalLM") is not None)
        """,
        env={"PYTHONPATH": str(site)},
    )
    assert proc.stdout.strip() == "('ToyForCausalLM',) True"
    assert mapping_for("ToyForCausalLM") is None  # not registered in this process


def test_unused_tensors_grows_linearly_with_the_tensor_count() -> None:
    """A 100B+ checkpoint (Qwen3-235B-A22B: 36,945 tensors) is checked for leftovers in a
    fraction of a second. The work is counted as its growth: eight times the tensors must
    cost about eight times the work; a set rebuilt per tensor (as once) costs 64 times."""
    import time

    def work(count: int) -> float:
        names = [
            f"model.layers.{i // 64}.mlp.experts.{i % 64}.up_proj.weight" for i in range(count)
        ]
        meta = CheckpointMeta(
            "/ckpt",
            {},
            {n: TensorEntry(n, "a.safetensors", "bfloat16", (1,), 0, 2) for n in names},
            "safetensors",
        )
        demands = [[((n,), "bfloat16") for n in names[rank::8]] for rank in range(8)]
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            assert unused_tensors(demands, meta, QWEN3, value_model=True) == []
            best = min(best, time.process_time() - start)
        return best

    small, large = work(36_945 // 8), work(36_945)
    assert large < 20 * max(small, 1e-3), (small, large)
