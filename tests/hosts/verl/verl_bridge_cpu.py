"""verl 0.9's default engine (``vanilla_mbridge: False``: Megatron-Bridge builds the
model from its provider and loads it with ``load_hf_weights``) on CPU over gloo, as
verl's actor and reference workers build it.

Runs inside a rank of :class:`megastart.harness.launch.RankPool`, after
:func:`megastart.harness.cpu.initialize_megatron` (the demo's CPU shims for
Megatron-core). Test-only shims on top, each because this machine has Python
3.11 and no GPU:

- Megatron-Bridge is imported as :mod:`support.te_stub` imports it: Python 3.12's
  ``typing.override``, and a Transformer Engine stub (version 0.0.0, so every
  Transformer Engine path stays off) after megatron-core's modules that probe for
  it were imported without it;
- the provider's layer spec is Megatron-Bridge's own ``local_layer_spec`` (its
  default is Transformer Engine's), the model is initialised on the CPU, and
  gradient-accumulation fusion (Apex's CUDA extension) is off, all set through
  verl's ``override_transformer_config``, which verl applies to the provider;
- verl's memory logging asks ``torch.cuda.mem_get_info`` (as in :mod:`verl_cpu`);
- Megatron-Bridge wraps the actor's model in Megatron's DDP inside a side CUDA
  stream (``megatron.training.models.dist_utils._ddp_wrap``); on CPU that
  stream is a no-op (:func:`no_cuda_streams`).
"""

from __future__ import annotations

from typing import Any

from support.te_stub import import_with_te_stub
from verl_cpu import TP, configure_megastart, parameters


def import_megatron_bridge() -> None:
    """Import verl's Megatron-Bridge module (and Megatron-Bridge) with the shims above."""
    import_with_te_stub("verl.models.mcore.bridge")


class _NoStream:
    """What ``_ddp_wrap`` does with a CUDA stream, done on the CPU: nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


def no_cuda_streams() -> None:
    import contextlib

    import torch

    torch.cuda.Stream = _NoStream  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda device=None: _NoStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]


def build_engine(checkpoint: str, *, forward_only: bool, value_model: bool = False) -> Any:
    """verl's LM-head engine (the value-head one for a critic) for ``checkpoint`` with verl's
    default engine config (bf16, Megatron-Bridge, the distributed optimizer) at TP=2, not yet initialised."""
    import torch
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.megatron import transformer_impl

    torch.cuda.mem_get_info = lambda device=None: (0, 0)
    no_cuda_streams()
    engine_config = McoreEngineConfig(
        tensor_model_parallel_size=TP,
        forward_only=forward_only,
        override_transformer_config={
            "transformer_layer_spec": local_layer_spec,
            "use_cpu_initialization": True,
            # Megatron's torch norms (no Transformer Engine) refuse sequence parallelism.
            "sequence_parallel": False,
            # Megatron-Bridge's default; it needs Apex's CUDA extension.
            "gradient_accumulation_fusion": False,
        },
    )
    assert engine_config.vanilla_mbridge is False  # verl 0.9's default: Megatron-Bridge
    engine_class, model_type = (
        (transformer_impl.MegatronEngineWithValueHead, "value_model")
        if value_model
        else (transformer_impl.MegatronEngineWithLMHead, "language_model")
    )
    return engine_class(
        HFModelConfig(path=checkpoint, load_tokenizer=False, model_type=model_type),
        engine_config,
        McoreOptimizerConfig(lr=1e-4),
        CheckpointConfig(),
    )


def loaded_weights(checkpoint: str, *, role: str, **env: str) -> dict[str, Any]:
    """The weights of the ``role`` engine after verl's model build and HF load.

    ``"ref"``: forward-only, through verl's ``initialize``; ``"critic"``: the same with
    verl's value-head engine. ``"actor"``: trainable (the model wrapped in Megatron's DDP),
    through the two calls ``initialize`` makes before it builds the optimizer, which
    Megatron cannot do on CPU.
    """
    from megastart.harness.cpu import initialize_megatron

    import_megatron_bridge()
    configure_megastart(**env)
    initialize_megatron(tp=TP)
    engine = build_engine(checkpoint, forward_only=role != "actor", value_model=role == "critic")
    if role != "actor":
        engine.initialize()
    else:
        engine._build_tf_config()
        engine.module = engine._build_megatron_module()
    return parameters(engine)
