"""What each rank runs in the Megatron-Bridge tests: a model built by Megatron-Bridge's own
provider on CPU over gloo (the shims of verl's Megatron-Bridge tests), loaded once by the
bridge's ``load_hf_weights`` and once by megastart with the bridge's registry, every
parameter set to NaN before each load so that nothing left untouched passes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from importlib import import_module
from importlib.util import find_spec
from typing import Any

import torch

from megastart.harness.model import cpu_block_spec
from support.loader_ranks import megatron
from support.pyrun import started_with
from support.te_stub import STUBS, import_with_te_stub


def import_megatron_bridge() -> Any:
    """``megatron.bridge``: as users import it where Transformer Engine is installed (the GPU
    machine), else with :mod:`support.te_stub`'s shims."""
    if STUBS not in sys.path and find_spec("transformer_engine") is not None:
        return import_module("megatron.bridge")
    return import_with_te_stub("megatron.bridge")


def build(
    checkpoint: str,
    layout: dict[str, int],
    dtype: str = "float32",
    device: str = "cpu",
    bridge: Any = None,
) -> tuple[Any, list[Any]]:
    """The checkpoint's ``AutoBridge`` (``bridge``, where the host made it) and this rank's
    chunks, from Megatron-Bridge's provider: on the CPU with Megatron's local layer spec; on
    ``"cuda"`` with the provider's own (Transformer Engine's) and grouped-GEMM experts,
    initialised on the GPU."""
    if bridge is None:
        bridge = import_megatron_bridge().AutoBridge.from_hf_pretrained(checkpoint)
    provider = bridge.to_megatron_provider(load_weights=False)
    own = OWN_CPU_SPECS.get(
        getattr(getattr(provider, "transformer_layer_spec", None), "__name__", "")
    )
    if device == "cpu":
        if own is None:
            provider.transformer_layer_spec = cpu_block_spec
        if hasattr(provider, "hybrid_stack_spec"):  # Mamba hybrids: megatron-core's local spec
            provider.hybrid_stack_spec = local_hybrid_stack_spec
        for fused in CPU_OFF:
            if hasattr(provider, fused):
                setattr(provider, fused, False)
        provider.moe_token_dispatcher_type = "allgather"
    else:  # the provider's own dispatcher (alltoall: its shared-expert overlap needs it)
        provider.moe_grouped_gemm = bool(getattr(provider, "num_moe_experts", None))
    provider.tensor_model_parallel_size = layout.get("tp", 1)
    provider.pipeline_model_parallel_size = layout.get("pp", 1)
    provider.virtual_pipeline_model_parallel_size = layout.get("vpp")
    provider.expert_model_parallel_size = layout.get("ep", 1)
    provider.expert_tensor_parallel_size = layout.get("etp", layout.get("tp", 1))
    provider.sequence_parallel = False
    provider.gradient_accumulation_fusion = False
    provider.params_dtype = getattr(torch, dtype)
    provider.bf16 = dtype == "bfloat16"
    provider.finalize()
    with (
        torch_final_norm(device == "cpu" and hasattr(provider, "hybrid_stack_spec")),
        without_te(own if device == "cpu" else None),
        kept_env("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"),
    ):
        chunks = provider.provide_distributed_model(
            wrap_with_ddp=False,
            use_cpu_initialization=device == "cpu",
            mixed_precision_wrapper=None,
        )
    return bridge, chunks


def kept_env(*names: str) -> AbstractContextManager[None]:
    """``names`` unset while the block builds a model, as in a fresh process, and as they were
    before afterwards: megatron-core's models set the attention backend's variables there and
    assert them in the next model a rank builds (a pooled rank builds many, not all here)."""
    return started_with(dict.fromkeys(names))


OWN_CPU_SPECS = {
    "get_ernie45_vl_decoder_block_spec": (
        "megatron.bridge.models.ernie_vl.modeling_ernie45_vl.ernie_decoder_layer_spec"
    ),
}
"""Providers' own layer specs kept on the CPU (megatron-core's would lack their layers: Ernie-
4.5-VL's text and vision expert pools), by name, and the module whose ``HAVE_TE`` picks
Transformer Engine's classes or megatron-core's local ones (no fused input norms then:
``linear_qkv.layer_norm_weight`` and a dense layer's ``linear_fc1.layer_norm_weight`` are
absent from both loads)."""


@contextmanager
def without_te(module: str | None) -> Iterator[None]:
    """While building a model: ``module``'s ``HAVE_TE`` off (the stub makes it true)."""
    if module is None:
        yield
        return
    spec = import_module(module)
    saved = spec.HAVE_TE
    spec.HAVE_TE = False
    try:
        yield
    finally:
        spec.HAVE_TE = saved


@contextmanager
def torch_final_norm(on: bool) -> Iterator[None]:
    """While building a hybrid model on the CPU: its stack's final norm, which megatron-core
    makes with Transformer Engine's ``TENorm`` whatever the spec, as torch's."""
    if not on:
        yield
        return
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    saved = hybrid_block.TENorm
    hybrid_block.TENorm = WrappedTorchNorm
    try:
        yield
    finally:
        hybrid_block.TENorm = saved


def local_hybrid_stack_spec() -> Any:
    """megatron-core's hybrid stack without Transformer Engine: ModelOpt's local spec (plain
    column/row-parallel linears, separate norms, local attention) with torch's norms in place
    of its TE ones; its Mamba mixer builds with :mod:`support.stubs`' ``mamba_ssm``."""
    from megatron.core.post_training.modelopt.hybrid import model_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    saved = model_specs.Norm
    model_specs.Norm = WrappedTorchNorm
    try:
        return model_specs.get_hybrid_stack_modelopt_spec(local_core_attention=True)
    finally:
        model_specs.Norm = saved


CPU_OFF = (
    "gradient_accumulation_fusion",
    "apply_rope_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
    "moe_grouped_gemm",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    "moe_shared_expert_overlap",
)
"""The provider's fused kernels, which need CUDA or Transformer Engine."""


def state(chunks: list[Any]) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of this rank, by chunk and name."""
    out = {}
    for index, chunk in enumerate(chunks):
        for name, tensor in (*chunk.named_parameters(), *chunk.named_buffers()):
            out[f"{index}:{name}"] = tensor.detach().clone()
    return out


def poison(chunks: list[Any]) -> None:
    with torch.no_grad():
        for chunk in chunks:
            for tensor in (*chunk.parameters(), *chunk.buffers()):
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))


def differences(theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> list[str]:
    """The names one side lacks, and those whose tensors differ (NaN equal to NaN)."""
    missing = [f"{n} (only one side has it)" for n in sorted(theirs.keys() ^ ours.keys())]
    return missing + [
        n
        for n in sorted(theirs.keys() & ours.keys())
        if theirs[n].shape != ours[n].shape
        or not torch.equal(theirs[n].nan_to_num(7.0), ours[n].nan_to_num(7.0))
    ]


def bridge_and_megastart(
    checkpoint: str,
    layout: dict[str, int],
    dtype: str = "float32",
    custom: Callable[[Any], Any] | None = None,
    bucket_mb: float | None = None,
) -> tuple[dict, dict, Any]:
    """This rank's state after Megatron-Bridge's load and after megastart's, and megastart's
    report (``None``: left to the bridge). ``custom(auto)``: the model bridge both loads go
    through instead of the ``AutoBridge``'s; ``bucket_mb``: megastart's bucket size."""
    # megatron-core before Megatron set-up, with Transformer Engine blocked: a rank of a pool made
    # after the parent imported the bridge has the stub on its path (megatron-core would take TE's)
    import_megatron_bridge()
    with megatron(layout):
        bridge, chunks = build(checkpoint, layout, dtype)
        poison(chunks)
        if custom is None:
            bridge.load_hf_weights(chunks, checkpoint)
        else:
            auto, bridge = bridge, custom(bridge)
            bridge.load_weights_hf_to_megatron(auto.hf_pretrained, chunks)
        theirs = state(chunks)
        poison(chunks)
        report = load_by_registry(chunks, bridge, checkpoint, bucket_mb=bucket_mb)
        return theirs, state(chunks), report


def load_by_registry(
    chunks: list[Any],
    bridge: Any,
    checkpoint: str,
    device: str = "cpu",
    bucket_mb: float | None = None,
) -> Any:
    """megastart's load of ``chunks`` through ``bridge``'s registry, as verl's and NeMo-RL's
    hooks call it (``load_for_engine``): its report, ``None`` where it left the load to the
    bridge."""
    from megatron.core import parallel_state

    from megastart.loader.api import load_for_engine
    from megastart.loader.settings import PLUGIN, Rank0LoaderSettings
    from megastart.records import EngineContext
    from megastart.settings import CoreSettings, Settings

    sections = {} if bucket_mb is None else {PLUGIN: Rank0LoaderSettings(bucket_mb=bucket_mb)}

    engine = EngineContext(
        host="test",
        host_version="0",
        model_chunks=tuple(chunks),
        parallel_state=parallel_state,
        device=device,
        hf_bridge=bridge,
        settings=Settings(CoreSettings(), sections) if sections else None,
    )
    return load_for_engine(engine, checkpoint)


def tables_agree(checkpoint: str, layout: dict[str, int]) -> dict[str, tuple[Any, Any]]:
    """Per canonical parameter of this rank where the two differ: (HF tensors, transform) from
    the bridge's registry and from megastart's built-in table."""
    from megastart.loader.checkpoint import read_metadata
    from megastart.loader.mapping.model import local_needs

    meta = read_metadata(checkpoint, allow_pickle=False)
    import_megatron_bridge()  # before Megatron set-up, as in bridge_and_megastart
    with megatron(layout):
        bridge, chunks = build(checkpoint, layout)
        by_bridge = local_needs(chunks, meta, bridge=bridge)[3]
        by_table = local_needs(chunks, meta)[3]
    theirs = {n.param.name: (n.hf, n.transform) for n in by_bridge}
    ours = {n.param.name: (n.hf, n.transform) for n in by_table}
    return {
        k: (theirs.get(k), ours.get(k))
        for k in theirs.keys() | ours.keys()
        if theirs.get(k) != ours.get(k)
    }


def leaves_to_the_bridge(
    checkpoint: str, model_bridge: Any, source: str | None = None
) -> tuple[Any, list[str]]:
    """``load_for_engine`` of ``source`` (default: the checkpoint) with ``model_bridge`` as the
    host's bridge on TP2: what it returned and the lines this rank logged."""
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megastart").addHandler(handler)
    import_megatron_bridge()  # before Megatron set-up, as in bridge_and_megastart
    try:
        with megatron({"tp": 2}):
            auto, chunks = build(checkpoint, {"tp": 2})
            return load_by_registry(chunks, model_bridge(auto), source or checkpoint), lines
    finally:
        logging.getLogger("megastart").removeHandler(handler)


def bridge_with_a_mapping_of_its_own(auto: Any) -> Any:
    """The checkpoint's model bridge, with one mapping of a class of its own (as Gemma's
    zero-centred norms are an AutoMapping that adds one)."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    class ShiftedNormMapping(AutoMapping):
        def hf_to_megatron(self, hf_weights: Any, megatron_module: Any) -> Any:
            return super().hf_to_megatron(hf_weights + 1, megatron_module)

    base = auto._model_bridge

    class Bridge(type(base)):  # type: ignore[misc]
        def mapping_registry(self) -> Any:
            mappings = super().mapping_registry().get_all_mappings()
            norm = "decoder.final_layernorm.weight"
            kept = [m for m in mappings if m.megatron_param != norm]
            return MegatronMappingRegistry(*kept, ShiftedNormMapping(norm, "model.norm.weight"))

    bridge = Bridge()
    bridge.hf_config = base.hf_config
    return bridge


def bridge_with_a_hook_of_its_own(auto: Any) -> Any:
    """The checkpoint's model bridge, changing each loaded weight (scaling it)."""
    base = auto._model_bridge

    class Bridge(type(base)):  # type: ignore[misc]
        def maybe_modify_loaded_hf_weight(self, hf_param: Any, hf_state_dict: Any) -> Any:
            return super().maybe_modify_loaded_hf_weight(hf_param, hf_state_dict) * 2

    bridge = Bridge()
    bridge.hf_config = base.hf_config
    return bridge


def unknown_subclass(auto: Any) -> Any:
    """The checkpoint's model bridge replaced by a subclass of its registered class that
    changes how it builds its conversion tasks (here: not at all, which megastart cannot see)."""
    base = auto._model_bridge

    class PatchedBridge(type(base)):  # type: ignore[misc]
        def build_conversion_tasks(self, *args: Any, **kwargs: Any) -> Any:
            return super().build_conversion_tasks(*args, **kwargs)

    bridge = PatchedBridge()
    bridge.hf_config = base.hf_config
    return bridge


def the_auto_bridges_model_bridge(auto: Any) -> Any:
    return auto._model_bridge
