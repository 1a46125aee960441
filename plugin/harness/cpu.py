"""Megatron-core on CPU over gloo: parallel state plus the shims it needs without a GPU.

Use inside a rank of a :class:`megastart.harness.launch.RankPool` (``torch.distributed``
already initialised over gloo)::

    def rank_fn():
        initialize_megatron(tp=2, pp=2)
        try:
            ...  # build chunks, load, forward
        finally:
            destroy_megatron()

The shims (see DESIGN.md, "Testing without GPUs") are test and demo support
only; library code must never rely on them:

- ``torch.cuda.current_device()`` returns ``"cpu"``: Megatron passes it as
  ``device=`` when it allocates buffers.
- ``torch.Tensor.cuda`` returns the tensor itself: with pipeline parallelism and
  tied embeddings Megatron moves the shared output weight with ``.cuda()``.
- The RNG tracker is the inference one (no CUDA RNG state).
- ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None``: without
  Transformer Engine, megatron-core 0.16 would still route the MoE router's
  GEMM through it.
- ``megatron.core.transformer.multi_latent_attention.HAVE_TE = False`` where its
  Transformer Engine is not installed: multi-latent attention would test its
  layers against TE's placeholder classes.

:func:`destroy_megatron` undoes everything, so the same pool can run another
layout next.
"""

from __future__ import annotations

from typing import Any

_SAVED: list[tuple[Any, str, Any]] = []
"""(owner, attribute, original value) of every shim in place, to restore them."""

_GROUPS_BEFORE: set[Any] = set()
"""The process groups that existed before :func:`initialize_megatron`: the ones
:func:`destroy_megatron` leaves alone."""


def initialize_megatron(
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    device: str = "cpu",
) -> None:
    """Initialise Megatron's model-parallel state on this rank, with the CPU shims.

    Collective over WORLD: every rank of the pool calls it with the same sizes.
    ``tp * pp * cp`` must divide the world size (the rest is data parallel).

    :param tp: tensor-parallel size.
    :param pp: pipeline-parallel size.
    :param vpp: virtual pipeline stages per rank (interleaved schedule), or None.
    :param cp: context-parallel size.
    :param ep: expert-parallel size.
    :param etp: expert tensor-parallel size (None: same as ``tp``).
    :param seed: seeds torch and Megatron's RNG tracker, so that two ranks
        building the same layout get the same random weights.
    :param device: ``"cpu"`` (the shims, Megatron's inference RNG tracker), or ``"cuda"``
        for models built on the GPU (no shims, Megatron's own CUDA RNG tracker).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_megatron: torch.distributed is not initialised; "
            "call it inside a rank of megastart.harness.launch.RankPool"
        )
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "initialize_megatron: Megatron's parallel state is already initialised on "
            f"rank {dist.get_rank()}; a previous task did not call destroy_megatron()"
        )
    if device == "cpu":
        _apply_shims()
    _GROUPS_BEFORE.update(_process_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(seed)
    # The inference tracker keeps no CUDA RNG state; force_reset drops the one a
    # previous layout in this process left behind.
    megatron_random.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=device == "cpu", force_reset_rng=True
    )


def destroy_megatron() -> None:
    """Destroy Megatron's parallel state and process groups, remove the shims. Safe to call twice.

    ``destroy_model_parallel`` only drops Megatron's references to its groups;
    each gloo group keeps its threads and sockets until destroyed, so a pool
    that runs many layouts would pile up a thousand threads per rank.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _GROUPS_BEFORE:
        for group in _process_groups() - _GROUPS_BEFORE:
            dist.destroy_process_group(group)
        _GROUPS_BEFORE.clear()
    remove_shims()


def remove_shims() -> None:
    """Undo the CPU shims, keeping Megatron's parallel state: a model built on CPU and moved
    to a GPU (``megastart bench loader --device cuda``) then runs CUDA code unshimmed."""
    while _SAVED:
        owner, name, original = _SAVED.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def _process_groups() -> set[Any]:
    """Every live process group of this process, the default one included."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def _apply_shims() -> None:
    import importlib.util

    import torch
    from megatron.core.transformer.moe import moe_utils

    _patch(torch.cuda, "current_device", lambda: "cpu")
    _patch(torch.Tensor, "cuda", _tensor_stays_on_cpu)
    # megatron-core 0.16 defines this name only when Transformer Engine imports, yet the
    # router's GEMM reads it unconditionally (NameError without TE).
    _patch(moe_utils, "te_general_gemm", None)
    # Multi-latent attention counts Transformer Engine as present when megatron-core's TE
    # extension module imports, which it does without TE (its classes are placeholders).
    from megatron.core.transformer import multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is None:
        _patch(mla, "HAVE_TE", False)


_ABSENT = object()
"""The original value of a shimmed attribute that did not exist before."""


def _patch(owner: Any, name: str, value: Any) -> None:
    _SAVED.append((owner, name, getattr(owner, name, _ABSENT)))
    setattr(owner, name, value)


def _tensor_stays_on_cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self
