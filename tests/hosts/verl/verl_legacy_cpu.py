"""verl 0.7's real legacy Megatron workers on CPU over gloo, built from verl's own
``ppo_megatron_trainer`` config the way its trainer builds them.

Runs inside a rank of :class:`megastart.harness.launch.RankPool`, after
:func:`megastart.harness.cpu.initialize_megatron` (the worker then finds
torch.distributed and Megatron's parallel state initialised and uses them).
Test-only shims on top of the demo's CPU shims and those of :mod:`verl_cpu`:

- verl's own model builder (``use_mbridge=false``) asks for Transformer Engine's
  layer spec; here it gets Megatron-core's local spec, and the local spec's two
  layer norms are also reachable under Transformer Engine's fused names
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), the only
  names verl's legacy loader writes;
- verl's model builder moves the model to ``f"{device_name}:{device_id}"``, and
  on CPU the id is ``"cpu"`` (``torch.cpu.current_device()``): here the builder's
  id is 0 (verl's loaders, which allocate on the bare id, keep ``"cpu"``);
- verl empties the device cache after building, asking the device how much it
  reserved; ``torch.cpu`` has no caching allocator: nothing reserved, nothing to free;
- the legacy critic's value head (``LinearForLastLayer``) comes from a verl package
  that imports flash-attn, which has no CPU build: ``stubs/flash_attn`` is on
  ``sys.path`` while a critic is built (every function in it raises if called).

The ``*_on_rank`` functions are what the tests run on every rank.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import verl_cpu

TP = verl_cpu.TP

STUBS = str(Path(__file__).parent / "stubs")


def save_tiny_qwen2_with_tokenizer(path: Path, *, reward_model: bool = False) -> None:
    """:func:`verl_cpu.save_tiny_qwen2` plus a word-level tokenizer over its 256 ids:
    the legacy workers load the tokenizer before the model."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    verl_cpu.save_tiny_qwen2(path, reward_model=reward_model)
    vocab = {f"t{i}": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t3"
    ).save_pretrained(path)


def worker_config(checkpoint: str, *, use_mbridge: bool) -> Any:
    """verl's ``ppo_megatron_trainer`` config at TP=2 for ``checkpoint`` (bf16)."""
    from hydra import compose, initialize_config_dir
    from verl_configs import VERL_CONFIG_DIR

    section = "actor_rollout_ref"
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose(
            "ppo_megatron_trainer",
            overrides=[
                f"critic.model.path={checkpoint}",
                f"critic.megatron.tensor_model_parallel_size={TP}",
                f"critic.megatron.use_mbridge={use_mbridge}",
                "critic.ppo_micro_batch_size_per_gpu=1",
                "+critic.megatron.override_transformer_config.use_cpu_initialization=True",
                "+critic.megatron.override_transformer_config.sequence_parallel=False",
                f"{section}.model.path={checkpoint}",
                f"{section}.actor.megatron.tensor_model_parallel_size={TP}",
                f"{section}.ref.megatron.tensor_model_parallel_size={TP}",
                f"{section}.actor.megatron.use_mbridge={use_mbridge}",
                f"{section}.actor.ppo_micro_batch_size_per_gpu=1",
                f"{section}.rollout.log_prob_micro_batch_size_per_gpu=1",
                f"{section}.ref.log_prob_micro_batch_size_per_gpu=1",
                f"+{section}.actor.megatron.override_transformer_config.use_cpu_initialization=True",
                # Megatron's torch norms (no Transformer Engine) refuse sequence parallelism.
                f"+{section}.actor.megatron.override_transformer_config.sequence_parallel=False",
            ],
        )


def use_local_spec_in_verl() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from verl.models.mcore.model_initializer import DenseModel

    def local_spec(self: Any, vp_stage: int | None = None) -> Any:
        return get_gpt_decoder_block_spec(
            self.tfconfig, use_transformer_engine=False, vp_stage=vp_stage
        )

    build = DenseModel.initialize

    def with_fused_norm_names(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = build(self, *args, **kwargs)
        for layer in model.decoder.layers:
            layer.self_attention.linear_qkv.layer_norm_weight = layer.input_layernorm.weight
            layer.mlp.linear_fc1.layer_norm_weight = layer.pre_mlp_layernorm.weight
        return model

    DenseModel.get_transformer_layer_spec = local_spec
    DenseModel.initialize = with_fused_norm_names


def use_cpu_as_verls_device() -> None:
    import torch
    from verl.utils import megatron_utils

    torch.cuda.mem_get_info = lambda device=None: (0, 0)
    megatron_utils.get_device_id = lambda: 0
    torch.cpu.memory_reserved = torch.cpu.memory_allocated = lambda device=None: 0
    torch.cpu.empty_cache = lambda: None


# -- run on every rank ------------------------------------------------------------


def prepared_config(checkpoint: str, *, use_mbridge: bool, **env: str) -> Any:
    """This rank made ready to build a worker (settings from ``env``, the probe's calls
    cleared, Megatron initialised, the shims on), and the workers' config."""
    import megastart_verl_probe

    from megastart.harness.cpu import initialize_megatron

    verl_cpu.configure_megastart(**env)
    megastart_verl_probe.CALLS.clear()
    initialize_megatron(tp=TP)
    use_cpu_as_verls_device()
    if use_mbridge:
        verl_cpu.use_local_spec_in_mbridge()
    else:
        use_local_spec_in_verl()
    return worker_config(checkpoint, use_mbridge=use_mbridge)


def worker(checkpoint: str, role: str, *, use_mbridge: bool, **env: str) -> Any:
    """verl's ``ActorRolloutRefWorker`` for ``role``, after its own ``init_model``."""
    from verl.workers.megatron_workers import ActorRolloutRefWorker

    config = prepared_config(checkpoint, use_mbridge=use_mbridge, **env)
    built = ActorRolloutRefWorker(config.actor_rollout_ref, role=role)
    built.init_model()
    return built


def parameters(model: Any) -> dict[str, Any]:
    from verl.utils.megatron_utils import unwrap_model

    (chunk,) = unwrap_model(model)
    return {name: param.detach().float().clone() for name, param in chunk.named_parameters()}


def load_on_rank(checkpoint: str, *, use_mbridge: bool, **env: str) -> dict[str, Any]:
    """A reference worker through ``init_model``; what the hooks saw and what the weights hold."""
    import megastart_verl_probe
    from megatron.core import parallel_state

    from megastart.engines import adapters
    from megastart.harness.cpu import destroy_megatron

    try:
        ref = worker(checkpoint, "ref", use_mbridge=use_mbridge, **env)
        return {
            "attached": {name: a.attached for name, a in adapters().items()},
            "calls": list(megastart_verl_probe.CALLS),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "params": parameters(ref.ref_module),
        }
    finally:
        destroy_megatron()


def reference_weights(checkpoint: str, **env: str) -> dict[str, Any]:
    """The weights of a reference worker (verl's legacy loader) after ``init_model``."""
    return parameters(worker(checkpoint, "ref", use_mbridge=False, **env).ref_module)


@contextmanager
def flash_attn_stub() -> Iterator[None]:
    sys.path.insert(0, STUBS)
    try:
        yield
    finally:
        sys.path.remove(STUBS)


def critic_model(checkpoint: str, *, use_mbridge: bool, **env: str) -> tuple[Any, dict[str, Any]]:
    """verl's ``CriticWorker.init_model`` until Megatron's optimizer stops it on CPU
    (it allocates on ``cuda``), after the HF load: the critic's model chunks as verl
    built and loaded them, and where verl stopped."""
    from verl.utils import megatron_utils
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.megatron_workers import CriticWorker

    config = prepared_config(checkpoint, use_mbridge=use_mbridge, **env)
    built: list[Any] = []
    make = megatron_utils.make_megatron_module

    def keeping_the_model(*args: Any, **kwargs: Any) -> Any:
        module, tf_config = make(*args, **kwargs)
        built.append(module)
        return module, tf_config

    megatron_utils.make_megatron_module = keeping_the_model
    try:
        with flash_attn_stub():
            CriticWorker(omega_conf_to_dataclass(config.critic)).init_model()
    except AssertionError as e:  # "Torch not compiled with CUDA enabled"
        (module,) = built
        return module, where_it_stopped(e)
    finally:
        megatron_utils.make_megatron_module = make
    raise AssertionError("CriticWorker.init_model ran to the end on CPU; expected a CUDA stop")


def critic_weights(checkpoint: str, **env: str) -> dict[str, Any]:
    """The weights of a critic after verl's legacy loader (``use_mbridge=false``) or a plugin."""
    return parameters(critic_model(checkpoint, use_mbridge=False, **env)[0])


def critic_on_rank(checkpoint: str, *, use_mbridge: bool, **env: str) -> dict[str, Any]:
    """A critic worker's ``init_model``: the hooks seen, its weights, where verl stopped."""
    import megastart_verl_probe
    from megatron.core import parallel_state

    from megastart.harness.cpu import destroy_megatron

    try:
        model, stop = critic_model(checkpoint, use_mbridge=use_mbridge, **env)
        return {
            "calls": list(megastart_verl_probe.CALLS),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "params": parameters(model),
            "stop": stop,
        }
    finally:
        destroy_megatron()


def tiny_batch() -> Any:
    """Two prompt+response sequences in the legacy workers' input format (``DataProto``)."""
    import torch
    from verl import DataProto

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 256, (2, 8), generator=generator)
    return DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(8).expand(2, 8).clone(),
            "responses": input_ids[:, 4:],
        }
    )


def where_it_stopped(error: BaseException) -> dict[str, Any]:
    """File and function of the frames where verl's code stopped on CPU."""
    import traceback

    import verl

    package = str(Path(verl.__file__).parent)
    frames = traceback.extract_tb(error.__traceback__)
    caller = [f for f in frames if "/torch/" not in f.filename][-1]
    return {
        "error": f"{type(error).__name__}: {error}",
        "innermost": (frames[-1].filename, frames[-1].name),
        "torch_called_from": (caller.filename, caller.name),
        "verl_functions": [f.name for f in frames if f.filename.startswith(package)],
    }


def first_steps_on_rank(checkpoint: str, **env: str) -> dict[str, Any]:
    """Two ``compute_ref_log_prob`` calls of a reference worker: the hooks seen, and
    where verl's step stopped on CPU."""
    import megastart_verl_probe

    from megastart.harness.cpu import destroy_megatron

    stops = []
    try:
        ref = worker(checkpoint, "ref", use_mbridge=False, **env)
        for _ in range(2):
            try:
                ref.compute_ref_log_prob(tiny_batch())
            except (AssertionError, RuntimeError) as e:
                stops.append(where_it_stopped(e))
        return {"calls": list(megastart_verl_probe.CALLS), "stops": stops}
    finally:
        destroy_megatron()


def actor_on_rank(checkpoint: str, **env: str) -> dict[str, Any]:
    """An actor worker's ``init_model``: the hooks seen before verl stopped on CPU."""
    import megastart_verl_probe

    from megastart.harness.cpu import destroy_megatron

    try:
        try:
            worker(checkpoint, "actor", use_mbridge=False, **env)
        except AssertionError as e:  # "Torch not compiled with CUDA enabled"
            return {"calls": list(megastart_verl_probe.CALLS), "stop": where_it_stopped(e)}
        return {"calls": list(megastart_verl_probe.CALLS), "stop": None}
    finally:
        destroy_megatron()
