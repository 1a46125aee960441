"""verl's real ``MegatronEngine`` on CPU over gloo, built the way verl's workers build it.

Runs inside a rank of :class:`megastart.harness.launch.RankPool`, after
:func:`megastart.harness.cpu.initialize_megatron` (verl's engine then finds Megatron's
parallel state initialised and uses it). Two test-only shims on top of the
demo's CPU shims, both because Transformer Engine has no CPU build:

- mbridge builds its models with Transformer Engine's layer spec
  (``LLMBridge._get_transformer_layer_spec``); here it gets Megatron-core's
  local spec, so the model is a real ``GPTModel`` built by mbridge and wrapped
  by Megatron's DDP exactly as on a GPU;
- mbridge's Qwen2 name table knows only Transformer Engine's fused layer-norm
  names; here it also maps the local spec's two layer norms, so mbridge's own
  HF loader (verl's loader when no plugin handles the load) runs to the end;
- verl has no CPU platform (it falls back to CUDA's), and its memory logging asks
  ``torch.cuda.mem_get_info``; here that reports nothing free of nothing.

The ``*_on_rank`` functions are what the tests run on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.mbridge_cpu import use_local_spec_in_mbridge

TP = 2
"""Tensor-parallel size of the test engine (the pool's world size)."""


def save_tiny_qwen2(path: Path, *, reward_model: bool = False) -> None:
    """A random two-layer Qwen2 checkpoint (safetensors), as ``save_pretrained`` writes it:
    a causal LM, or a reward model (``Qwen2ForSequenceClassification``, one label)."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if reward_model:
        config.num_labels = 1
        transformers.Qwen2ForSequenceClassification(config).save_pretrained(path)
    else:
        transformers.Qwen2ForCausalLM(config).save_pretrained(path)


def build_engine(checkpoint: str, *, forward_only: bool, value_model: bool = False) -> Any:
    """verl's Megatron engine for ``checkpoint`` (mbridge, bf16), not yet initialised:
    the LM-head engine (actor, reference) or the value-head one (critic)."""
    from importlib import metadata

    import torch
    from packaging.version import Version
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.megatron import transformer_impl

    use_local_spec_in_mbridge()
    torch.cuda.mem_get_info = lambda device=None: (0, 0)
    engine_class, model_type = (
        (transformer_impl.MegatronEngineWithValueHead, "value_model")
        if value_model
        else (transformer_impl.MegatronEngineWithLMHead, "language_model")
    )
    # verl 0.7's HFModelConfig has no model_type: its engine tells value models by
    # their architecture's name, and 0.7 builds no Megatron critic on the engine.
    typed = (
        {"model_type": model_type} if Version(metadata.version("verl")) >= Version("0.8") else {}
    )
    return engine_class(
        HFModelConfig(path=checkpoint, load_tokenizer=False, **typed),
        McoreEngineConfig(
            tensor_model_parallel_size=TP,
            vanilla_mbridge=True,
            dtype="bfloat16",
            forward_only=forward_only,
            use_distributed_optimizer=False,
            # Megatron's torch norms (no Transformer Engine) refuse sequence parallelism.
            override_transformer_config={
                "use_cpu_initialization": True,
                "sequence_parallel": False,
            },
        ),
        McoreOptimizerConfig(lr=1e-4),
        CheckpointConfig(),
    )


def give_checkpoint_manager(engine: Any) -> None:
    """The checkpoint manager ``MegatronEngine.initialize`` builds after the optimizer,
    for a forward-only engine (model weights only).

    A trainable engine cannot be initialised on CPU (Megatron's mixed-precision
    optimizer allocates on ``cuda``), so ``initialize`` never gets this far; the
    arguments are the ones it passes, minus the optimizer.
    """
    from omegaconf import OmegaConf
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    engine.checkpoint_mananager = MegatronCheckpointManager(  # sic: verl's spelling
        config=OmegaConf.create(
            {"model": {"path": engine.model_config.local_path}, "megatron": {}}
        ),
        checkpoint_config=CheckpointConfig(save_contents=["model"], load_contents=["model"]),
        model_config=engine.model_config.hf_config,
        transformer_config=engine.tf_config,
        role="actor",
        model=engine.module,
        arch=engine.model_config.architectures[0],
        hf_config=engine.model_config.hf_config,
        param_dtype=engine.param_dtype,
        share_embeddings_and_output_weights=engine.model_config.share_embeddings_and_output_weights,
        processing_class=None,
        optimizer=None,
        optimizer_scheduler=None,
        use_distributed_optimizer=False,
        bridge=engine.bridge,
        provider=engine.provider,
        peft_cls=engine.peft_cls,
    )


# -- run on every rank ------------------------------------------------------------


def configure_megastart(**env: str) -> None:
    """This process's megastart settings come from ``env`` (MEGASTART_* names) from now on."""
    import os

    from megastart.manager import reset

    for name in [n for n in os.environ if n.startswith("MEGASTART_")]:
        del os.environ[name]
    os.environ.update(env)
    reset()


def initialized_engine(checkpoint: str, *, value_model: bool = False, **env: str) -> Any:
    """A forward-only engine through verl's own ``initialize`` (the HF load included)."""
    import megastart_verl_probe

    from megastart.harness.cpu import initialize_megatron

    configure_megastart(**env)
    megastart_verl_probe.CALLS.clear()
    initialize_megatron(tp=TP)
    engine = build_engine(checkpoint, forward_only=True, value_model=value_model)
    engine.initialize()
    return engine


def parameters(engine: Any) -> dict[str, Any]:
    from verl.utils.megatron_utils import unwrap_model

    (chunk,) = unwrap_model(engine.module)
    return {name: param.detach().float().clone() for name, param in chunk.named_parameters()}


def load_on_rank(checkpoint: str, *, value_model: bool = False, **env: str) -> dict[str, Any]:
    """Build and initialise the engine; what the hooks saw and what the weights hold."""
    import megastart_verl_probe
    from megatron.core import parallel_state

    from megastart.engines import adapters
    from megastart.harness.cpu import destroy_megatron

    try:
        engine = initialized_engine(checkpoint, value_model=value_model, **env)
        return {
            "attached": {name: a.attached for name, a in adapters().items()},
            "calls": list(megastart_verl_probe.CALLS),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "params": parameters(engine),
        }
    finally:
        destroy_megatron()


def tiny_batch() -> Any:
    """Two sequences in verl's engine input format (no padding, nested tensors)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (n,), generator=generator) for n in (5, 7)]
    data = TensorDict(
        {
            "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            "loss_mask": torch.nested.as_nested_tensor(
                [torch.ones_like(t) for t in ids], layout=torch.jagged
            ),
            "temperature": torch.tensor([1.0, 1.0]),
        },
        batch_size=2,
    )
    tu.assign_non_tensor(
        data,
        use_remove_padding=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=1,
        use_fused_kernels=False,
    )
    return data


def first_steps_on_rank(checkpoint: str, **env: str) -> dict[str, Any]:
    """Two ``infer_batch`` calls (verl's first ``compute_log_prob``): the hooks seen, and
    where verl's step stopped on CPU (file and function of the frames that failed)."""
    import traceback

    import megastart_verl_probe

    from megastart.harness.cpu import destroy_megatron

    stops = []
    try:
        engine = initialized_engine(checkpoint, **env)
        for _ in range(2):
            try:
                with engine.eval_mode(disable_auto_offload=True):
                    engine.infer_batch(tiny_batch())
            except AssertionError as e:  # "Torch not compiled with CUDA enabled"
                frames = traceback.extract_tb(e.__traceback__)
                caller = [f for f in frames if "/torch/" not in f.filename][-1]
                stops.append(
                    {
                        "error": str(e),
                        "innermost": (frames[-1].filename, frames[-1].name),
                        "torch_called_from": (caller.filename, caller.name),
                        "verl_step_ran": any(
                            f.name == "forward_backward_batch" and "verl/" in f.filename
                            for f in frames
                        ),
                    }
                )
        return {"calls": list(megastart_verl_probe.CALLS), "stops": stops}
    finally:
        destroy_megatron()


def engine_weights(checkpoint: str, **env: str) -> dict[str, Any]:
    """The weights of a forward-only engine after verl's ``initialize``."""
    return parameters(initialized_engine(checkpoint, **env))


def critic_weights(checkpoint: str, **env: str) -> dict[str, Any]:
    """The weights of a forward-only critic engine after verl's ``initialize``."""
    return parameters(initialized_engine(checkpoint, value_model=True, **env))


def loaders_on_rank(
    checkpoint: str, weights: Callable[..., dict[str, Any]] = engine_weights
) -> dict[str, Any]:
    """The weights megastart's rank0_loader writes and those verl's own loader writes
    (each as ``weights(checkpoint, **env)`` builds and loads them), and the rank-0
    summary lines of the hook calls."""
    import logging

    from megastart.harness.cpu import destroy_megatron

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("megastart")  # its level is the adapter's business
    logger.addHandler(handler)
    loaded = {}
    try:
        for loader, blocklist in {
            "rank0_loader": "comm_warmup,verl_probe",
            "verl": "rank0_loader,comm_warmup,verl_probe",
        }.items():
            try:
                loaded[loader] = weights(checkpoint, MEGASTART_BLOCKLIST=blocklist)
            finally:
                destroy_megatron()
    finally:
        logger.removeHandler(handler)
    return {"params": loaded, "log": lines}


# -- checked in the test process ----------------------------------------------------


def hf_tensor(checkpoint: str, name: str) -> Any:
    """An HF tensor as bf16 parameters hold it."""
    import torch
    from safetensors.torch import load_file

    return load_file(f"{checkpoint}/model.safetensors")[name].to(torch.bfloat16).float()


def hf_shard(checkpoint: str, name: str, tp_rank: int) -> Any:
    """This TP rank's rows of an HF tensor, as bf16 parameters hold them."""
    return hf_tensor(checkpoint, name).chunk(TP)[tp_rank]


def check_probe_handled_load(
    out: dict[str, Any], checkpoint: str, engine_class: str, *, value_model: bool = False
) -> None:
    """The probe plugin's report (mode ``handle``) replaced verl's loader on this rank:
    one ``on_model_load`` call saw the real model and context, and no weight was loaded."""
    from importlib import metadata

    import torch
    from megastart_verl_probe import FILL

    (call,) = out["calls"]
    call.pop("first_param_sum")
    assert call == {
        "hook": "on_model_load",
        "checkpoint": checkpoint,
        "host": "verl",
        "host_version": metadata.version("verl"),
        "chunk_types": ["GPTModel"],
        "parallel_state": "megatron.core.parallel_state",
        "tp": TP,
        "device": "cpu",
        "dtype": "torch.bfloat16",
        "hf_model_type": "qwen2",
        "is_restart": False,
        "mode": "handle",
        "value_model": value_model,
        "engine_class": engine_class,
    }
    for name, value in out["params"].items():
        assert torch.all(value == FILL), name  # verl's loader never ran


def check_loaded_from_hf(out: dict[str, Any], checkpoint: str) -> None:
    """A rank's embedding and output layer hold its rows of the checkpoint's."""
    import torch

    params, tp_rank = out["params"], out["tp_rank"]
    embedding = hf_shard(checkpoint, "model.embed_tokens.weight", tp_rank)
    lm_head = hf_shard(checkpoint, "lm_head.weight", tp_rank)
    assert torch.equal(params["embedding.word_embeddings.weight"], embedding)
    assert torch.equal(params["output_layer.weight"], lm_head)


def check_critic_fell_through_to_verl(out: dict[str, Any], checkpoint: str) -> None:
    """A critic's load reached ``on_model_load`` as a value model, no plugin handled it,
    and verl's own loader wrote the backbone (this rank's embedding rows)."""
    import torch

    assert [(c["hook"], c["value_model"]) for c in out["calls"]] == [("on_model_load", True)]
    embedding = hf_shard(checkpoint, "model.embed_tokens.weight", out["tp_rank"])
    assert torch.equal(out["params"]["embedding.word_embeddings.weight"], embedding)


def check_critic_from_reward_checkpoint(out: dict[str, Any], checkpoint: str) -> None:
    """A critic loaded from a reward model's checkpoint: the value head is its
    ``score.weight``, the backbone its decoder (this rank's embedding rows)."""
    import torch

    params = out["params"]
    assert torch.equal(params["output_layer.weight"], hf_tensor(checkpoint, "score.weight"))
    embedding = hf_shard(checkpoint, "model.embed_tokens.weight", out["tp_rank"])
    assert torch.equal(params["embedding.word_embeddings.weight"], embedding)


def check_same_weights_one_reader(ranks: list[dict[str, Any]]) -> str:
    """:func:`loaders_on_rank` on every rank: only rank 0 read, both loaders wrote the same
    weights, and each load made one hook call (the library adapter beneath verl's, on
    mbridge's or Megatron-Bridge's loader, passed through). Returns rank 0's summary line
    of the load."""
    import torch

    calls = [line for line in ranks[0]["log"] if line.startswith("megastart: on_model_load ")]
    assert len(calls) == 2, calls  # one per load: megastart's, then verl's own
    (summary,) = [
        line for line in calls if line.startswith("megastart: on_model_load rank0_loader:")
    ]
    assert "read by rank(s) [0]" in summary
    for out in ranks:
        ours, verls = out["params"]["rank0_loader"], out["params"]["verl"]
        assert ours.keys() == verls.keys()
        for name in ours:
            assert torch.equal(ours[name], verls[name]), name
    return summary


def recover_on_rank(checkpoint: str, recover_dir: str, **env: str) -> dict[str, Any]:
    """Save a recover checkpoint through verl, overwrite the weights, resume through
    verl's ``load_checkpoint``: the hooks seen, and the first weight's sum as saved."""
    import megastart_verl_probe
    from verl.utils.megatron_utils import unwrap_model

    from megastart.harness.cpu import destroy_megatron

    try:
        engine = initialized_engine(checkpoint, **env)
        give_checkpoint_manager(engine)
        engine.save_checkpoint(recover_dir, global_step=1)
        (chunk,) = unwrap_model(engine.module)
        saved_sum = float(next(chunk.parameters()).float().sum())
        for param in chunk.parameters():
            param.data.fill_(3.0)
        engine.load_checkpoint(recover_dir)
        return {"calls": list(megastart_verl_probe.CALLS), "saved_sum": saved_sum}
    finally:
        destroy_megatron()
