"""rank0_loader on mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) with expert parallelism.

Every layout is checked against ground truth: the loaded Megatron model's logits
equal the ``transformers`` model's (real ranks over gloo, Megatron's MoE forward
on CPU with sequential experts). The grouped-GEMM naming
(``experts.linear_fc1.weight{i}``), which needs Transformer Engine to build, is
checked on names and shapes through the plan.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.loader_ranks import (
    build,
    load_as_nodes,
    load_expecting_error,
    megatron,
    reference_logits,
    settings,
)

from megastart.errors import PlanError
from megastart.loader.checkpoint import CheckpointMeta, read_metadata
from megastart.loader.mapping.experts import global_expert_name
from megastart.loader.mapping.mappings import mapping_for
from megastart.loader.mapping.needs import ParamInfo, resolve_needs
from megastart.loader.mapping.transforms import Shard
from megastart.loader.stream.stream import BUFFERS

LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "ep2": (2, {"ep": 2}),
    "tp2_ep2": (4, {"tp": 2, "ep": 2}),
    "tp2_ep2_etp1": (2, {"tp": 2, "ep": 2, "etp": 1}),
    "pp2_ep2": (4, {"pp": 2, "ep": 2}),
    "dp2_ep2": (4, {"ep": 2}),
}

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3-MoE with tied embeddings; Qwen2-MoE with a dense layer between MoE layers
    # (mlp_only_layers) and its gated shared expert; Mixtral's block_sparse_moe names.
    "qwen3_moe": ("qwen3_moe", {"tie_word_embeddings": True}),
    "qwen2_moe": ("qwen2_moe", {"mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``name -> (directory, transformers logits)`` of :data:`MODELS` (and variants), each made once."""
    from megastart.harness.checkpoints import make_checkpoint

    cache: dict[str, tuple[str, torch.Tensor]] = {}

    def get(name: str, **overrides: Any) -> tuple[str, torch.Tensor]:
        arch, fields = MODELS.get(name, (name, {}))
        key = f"{name}-{sorted(overrides.items())}"
        if key not in cache:
            directory = make_checkpoint(arch, tmp_path_factory.mktemp(name), **fields, **overrides)
            cache[key] = (str(directory), reference_logits(directory))
        return cache[key]

    return get


@pytest.fixture
def damaged(checkpoints: Any, tmp_path: Path) -> Any:
    """``name -> directory``: a private copy of a checkpoint that a test may edit."""
    import shutil

    def copy(name: str) -> Path:
        return Path(shutil.copytree(checkpoints(name)[0], tmp_path / name))

    return copy


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_logits_match_transformers(
    rank_pools: Any, checkpoints: Any, model: str, layout: str
) -> None:
    """On nodes of two ranks: the 4-rank layouts span the reader's node and a second one."""
    world, parallel = LAYOUTS[layout]
    directory, expected = checkpoints(model)
    results = rank_pools[world].run(load_as_nodes, directory, parallel, 2, {})
    for rank, (_, logits) in enumerate(results):
        diff = (logits - expected).abs().max().item()
        assert diff <= 1e-4, f"rank {rank}: max abs logit difference {diff:.3g}"
    report = results[0][0]
    assert report.tensors == len(read_metadata(directory, allow_pickle=False).tensors)


def test_world_of_eight_tp2_pp2_ep2(rank_pools: Any, checkpoints: Any) -> None:
    directory, expected = checkpoints("qwen2_moe")
    results = rank_pools[8].run(load_as_nodes, directory, {"tp": 2, "pp": 2, "ep": 2}, 2, {})
    for rank, (_, logits) in enumerate(results):
        assert (logits - expected).abs().max().item() <= 1e-4, f"rank {rank}"


# --- a rank copies only its own experts and holds at most a bucket of anyone else's ---------


def load_measuring_peak(
    checkpoint: str, layout: dict[str, int], bucket_mb: float
) -> tuple[int, int]:
    """This rank's global rank and its peak memory growth (bytes) while loading.

    A first load imports and initialises what a load needs once. Then free heap
    memory goes back to the OS, the kernel's peak RSS (``VmHWM``) is reset
    (``clear_refs``), and the second load's peak counts every page it touched
    beyond the model's parameters.
    """
    import torch.distributed as dist

    from megastart import load_hf_checkpoint
    from megastart.bench.memory import release_free_memory

    with megatron(layout):
        chunks = build(checkpoint)
        load_hf_checkpoint(chunks, checkpoint, settings=settings(bucket_mb=bucket_mb))
        release_free_memory()
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_bytes("VmRSS")
        load_hf_checkpoint(chunks, checkpoint, settings=settings(bucket_mb=bucket_mb))
        return dist.get_rank(), _status_bytes("VmHWM") - before


def _status_bytes(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert found, field
    return int(found[1]) * 1024


def test_no_rank_holds_more_than_a_bucket_of_other_ranks_experts(checkpoints: Any) -> None:
    """In ranks of their own: a peak of resident memory measured in a process that ran the
    other tests' loads before would count their allocator's state."""
    from megastart.harness.launch import RankPool

    directory, _ = checkpoints("qwen3_moe", num_experts=16, moe_intermediate_size=512)
    meta = read_metadata(directory, allow_pickle=False)
    expert_bytes = sum(e.end - e.start for n, e in meta.tensors.items() if ".experts." in n)
    bucket = 2**19
    others = expert_bytes // 2  # EP2: half of the experts belong to the other EP rank
    assert others >= 16 * bucket
    # The plan's Python objects, gloo's groups, a transform's output (an expert's fc1 is
    # 256 KiB): the reader's peak measured 2.3-2.6 MiB beside 1.5 MiB of slots.
    slack = 2 * 2**20
    assert BUFFERS * bucket + slack <= others / 2, "the bound would not see another EP rank's half"
    with RankPool(2, timeout_s=120) as pool:
        grown = pool.run(load_measuring_peak, directory, {"ep": 2}, bucket / 2**20)
    for rank, grew in grown:
        # The node's shared slots, which both ranks map (RSS counts them in each).
        assert grew <= BUFFERS * bucket + slack, f"rank {rank} grew by {grew / 2**20:.1f} MiB"


def meta_of(directory: str) -> CheckpointMeta:
    return read_metadata(directory, allow_pickle=False)


def expert_params(
    meta: CheckpointMeta, *, ep_rank: int, ep: int, etp: int, grouped: bool
) -> list[ParamInfo]:
    """This EP rank's routed-expert parameters as Megatron names them, made canonical as the loader does."""
    hidden = meta.config["hidden_size"]
    ffn = meta.config["moe_intermediate_size"]
    experts = meta.config.get("num_experts") or meta.config["num_local_experts"]
    local = experts // ep
    params = []
    for layer in range(meta.config["num_hidden_layers"]):
        for j in range(local):
            for fc, shape in (
                ("linear_fc1", (2 * ffn // etp, hidden)),
                ("linear_fc2", (hidden, ffn // etp)),
            ):
                prefix = f"decoder.layers.{layer}.mlp.experts."
                name = prefix + (f"{fc}.weight{j}" if grouped else f"local_experts.{j}.{fc}.weight")
                params.append(
                    ParamInfo(0, name, global_expert_name(name, ep_rank * local), shape, "float32")
                )
    return params


def shard(meta: CheckpointMeta, *, tp: int, etp: int, etp_rank: int) -> Shard:
    heads = meta.config["num_attention_heads"]
    return Shard(
        tp_rank=0,
        tp_size=tp,
        num_heads=heads,
        num_query_groups=meta.config["num_key_value_heads"],
        head_dim=meta.config["head_dim"],
        expert_tp_rank=etp_rank,
        expert_tp_size=etp,
    )


def test_grouped_gemm_and_sequential_names_need_the_same_tensors_of_their_own_experts(
    checkpoints: Any,
) -> None:
    meta = meta_of(checkpoints("qwen3_moe")[0])
    table = mapping_for("Qwen3MoeForCausalLM")
    experts_of_rank_1 = {"2", "3"}  # 4 experts, EP2
    needs = {
        grouped: resolve_needs(
            expert_params(meta, ep_rank=1, ep=2, etp=2, grouped=grouped),
            table,
            meta,
            shard(meta, tp=2, etp=2, etp_rank=1),
        )
        for grouped in (False, True)
    }
    assert [(n.hf, n.transform) for n in needs[False]] == [(n.hf, n.transform) for n in needs[True]]
    used = {re.search(r"\.experts\.(\d+)\.", name)[1] for need in needs[True] for name in need.hf}
    assert used == experts_of_rank_1
    first = needs[True][0]
    assert first.param.local_name == "decoder.layers.0.mlp.experts.linear_fc1.weight0"
    assert first.hf == (
        "model.layers.0.mlp.experts.2.gate_proj.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight",
    )


def test_experts_are_split_over_expert_tensor_parallel_not_tensor_parallel(
    checkpoints: Any,
) -> None:
    """TP2 with ETP1: each expert whole on its EP rank; a TP-split expert shape is refused."""
    meta = meta_of(checkpoints("mixtral")[0])
    table = mapping_for("MixtralForCausalLM")
    meta.config["moe_intermediate_size"] = meta.config["intermediate_size"]  # Mixtral's expert size
    etp1 = shard(meta, tp=2, etp=1, etp_rank=0)
    resolve_needs(expert_params(meta, ep_rank=0, ep=2, etp=1, grouped=False), table, meta, etp1)
    with pytest.raises(PlanError) as refused:
        resolve_needs(expert_params(meta, ep_rank=0, ep=2, etp=2, grouped=False), table, meta, etp1)
    assert (
        "shape mismatch: HF tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight' has shape "
        "[128, 64], expected [64, 64] (expert-tensor-parallel rank 0 of 1) for Megatron parameter "
        "'decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight'"
    ) in str(refused.value)


def test_global_expert_names() -> None:
    assert (
        global_expert_name("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight", 4)
        == "decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight"
    )
    assert (
        global_expert_name("decoder.layers.3.mlp.experts.linear_fc1.weight1", 4)
        == "decoder.layers.3.mlp.experts.linear_fc1.weight5"
    )
    assert (  # gpt-oss's grouped experts have biases, numbered like their weights
        global_expert_name("decoder.layers.3.mlp.experts.linear_fc2.bias1", 4)
        == "decoder.layers.3.mlp.experts.linear_fc2.bias5"
    )
    for pool in ("text", "vision"):  # Ernie-4.5-VL's two pools, each numbered from 0 per rank
        local = f"language_model.decoder.layers.1.mlp.{pool}_moe_layer.experts.local_experts.1"
        assert global_expert_name(f"{local}.linear_fc1.weight", 4) == (
            f"{local[:-1]}5.linear_fc1.weight"
        )
    unchanged = "decoder.layers.3.mlp.shared_experts.linear_fc1.weight"
    assert global_expert_name(unchanged, 4) == unchanged


# --- errors, on every rank, naming the expert, the sizes and the fix -------------------------


def same_on_every_rank(messages: list[str]) -> str:
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("CollectiveError: rank0_loader: "), messages[0]
    return messages[0]


def edit_tensors(directory: Path, edit: Any) -> None:
    """Apply ``edit`` to every shard's tensors (the index is kept: names stay in their shard)."""
    import json

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(directory / file)
        edit(tensors)
        save_file(tensors, directory / file, metadata={"format": "pt"})
        index["weight_map"] = {
            n: f for n, f in index["weight_map"].items() if f != file or n in tensors
        }
    index_path.write_text(json.dumps(index))


def test_missing_expert_names_the_expert_and_the_parameter(rank_pools: Any, damaged: Any) -> None:
    directory = damaged("qwen3_moe")
    gone = "model.layers.1.mlp.experts.3.down_proj.weight"
    edit_tensors(directory, lambda tensors: tensors.pop(gone, None))
    message = same_on_every_rank(
        rank_pools[2].run(load_expecting_error, str(directory), {"ep": 2}, {})
    )
    assert f"['{gone}'] missing from checkpoint" in message
    # EP rank 1 holds experts 2 and 3: its local expert 1 is global expert 3.
    assert (
        "'decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight' "
        "(global name 'decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight'" in message
    )


def test_router_shape_mismatch_names_tensor_parameter_and_shapes(
    rank_pools: Any, damaged: Any
) -> None:
    directory = damaged("mixtral")
    router = "model.layers.2.block_sparse_moe.gate.weight"
    edit_tensors(
        directory, lambda t: t.update({router: t[router][:3].clone()}) if router in t else None
    )
    message = same_on_every_rank(
        rank_pools[2].run(load_expecting_error, str(directory), {"ep": 2}, {})
    )
    assert f"HF tensor '{router}' has shape [3, 64], expected [4, 64]" in message
    assert "Megatron parameter 'decoder.layers.2.mlp.router.weight'" in message


@pytest.mark.parametrize(
    ("model", "three"),
    [("qwen2_moe", {"num_experts": 3}), ("deepseek_v3", {"n_routed_experts": 3, "n_group": 1})],
)
def test_expert_count_that_ep_does_not_divide_is_refused_with_the_sizes_that_work(
    rank_pools: Any, checkpoints: Any, model: str, three: dict[str, Any]
) -> None:
    three_experts, _ = checkpoints(model, **three)
    built_from, _ = checkpoints(model)
    message = same_on_every_rank(
        rank_pools[2].run(load_expecting_error, three_experts, {"ep": 2}, {}, built_from)
    )
    assert (
        "has 3 experts per MoE layer (config.json), which expert-parallel size 2 does not divide"
        in message
    )
    assert "Choose an expert-parallel size among [1, 3]" in message


def test_model_built_with_another_top_k_is_refused(rank_pools: Any, checkpoints: Any) -> None:
    directory, _ = checkpoints("qwen3_moe")
    top3, _ = checkpoints("qwen3_moe", num_experts_per_tok=3)
    message = same_on_every_rank(
        rank_pools[2].run(load_expecting_error, directory, {"ep": 2}, {}, top3)
    )
    assert "num_experts_per_tok=2 in config.json but moe_router_topk=3 in Megatron" in message
