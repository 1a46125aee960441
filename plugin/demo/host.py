"""The demo's host: a small Megatron-core training job on CPU that calls megastart's hooks
where verl or AReaL would.

Rank functions for a :class:`megastart.harness.launch.RankPool`, one per step, so the
parent can time each step and mark it on the memory plot. A rank keeps its
model between steps in :data:`_STATE`. The host builds an
:class:`~megastart.records.EngineContext` and calls the hooks through
:func:`megastart.manager.call_hook`, so what runs is whatever megastart plugins
are installed and enabled (blocklist and settings apply). It has no loader and
no warmup of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HOST = "demo"

_STATE: dict[str, Any] = {}
"""This rank's checkpoint, HF config and model chunks, from :func:`start` until :func:`finish`."""


def start(checkpoint: str, tp: int, pp: int) -> None:
    """Initialise Megatron for TP x PP (the rest is data parallel) and read the HF config."""
    import warnings

    # Megatron announces its fallbacks without Transformer Engine / Apex, and
    # torch.distributed.checkpoint its deprecations, once per rank: noise here.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers import AutoConfig

    from megastart.harness.cpu import initialize_megatron
    from megastart.manager import get_settings

    initialize_megatron(tp=tp, pp=pp)
    _STATE.update(checkpoint=checkpoint, hf_config=AutoConfig.from_pretrained(checkpoint))
    get_settings()  # load megastart's plugins now, as a host does when it attaches


def build_model() -> None:
    """Build this rank's chunks with random weights, in fp32 (the dtype CPU training needs)."""
    import torch

    from megastart.harness.model import build_gpt_chunks

    _STATE.pop("chunks", None)
    _STATE["chunks"] = build_gpt_chunks(_STATE["hf_config"], dtype=torch.float32)


def load_weights() -> dict[str, Any]:
    """``on_model_load``: the installed plugins load the HF checkpoint into the chunks."""
    from dataclasses import asdict

    from megastart.manager import call_hook

    report = call_hook(
        "on_model_load", engine=_engine(is_restart=False), checkpoint=_STATE["checkpoint"]
    )
    if report is None:
        raise RuntimeError(
            f"no megastart plugin loaded {_STATE['checkpoint']!r} (megastart disabled, rank0_loader "
            "blocked, or its architecture unmapped) and the demo host has no loader of its own"
        )
    return asdict(report)


def logits(input_ids: torch.Tensor) -> torch.Tensor | None:
    """The model's fp32 logits for ``input_ids`` (on rank 0; ``None`` elsewhere)."""
    import torch.distributed as dist

    from megastart.harness.model import forward_logits

    out = forward_logits(_STATE["chunks"], input_ids)
    return out if dist.get_rank() == 0 else None


def save_recover_checkpoint(directory: str) -> None:
    """What the host writes while training: a Megatron distributed checkpoint of the model."""
    from megastart.demo.restart import save_checkpoint

    save_checkpoint(_STATE["chunks"], directory)


class _Model:
    """What owns this rank's model for :mod:`megastart.restart` (held weakly there)."""


def restore_recover_checkpoint(directory: str) -> dict[str, Any]:
    """The restart, as verl's and AReaL's: a freshly built model, the HF load through
    ``on_model_load``, then the distributed checkpoint over it. Where
    ``rank0_loader.skip_hf_load_on_resume`` is on (the default) the HF load waits, and the
    resume, which restores every parameter, replaces it. Says which, and what was not read."""
    from megastart.demo.restart import restore_checkpoint
    from megastart.loader.settings import resolved
    from megastart.restart import DEFERRALS, Deferred, last_skipped, skip_wanted

    build_model()
    model = _Model()
    if skip_wanted():
        deferred = Deferred(
            host=HOST,
            checkpoint=_STATE["checkpoint"],
            load=load_weights,
            chunks=lambda: _STATE["chunks"],
            timeout_s=resolved().timeout_s,
        )
        DEFERRALS.defer(model, deferred)
    else:
        load_weights()
    with DEFERRALS.resuming(model, directory, restores_optimizer=True) as skipped:
        restore_checkpoint(_STATE["chunks"], directory)
    skip = last_skipped() if skipped else None
    return {
        "hf_load": "skipped" if skip else "loaded",
        "bytes_not_read": skip.bytes_not_read if skip else 0,
        "parameters_restored": skip.parameters if skip else None,
    }


def post_recover_load(directory: str) -> dict[str, Any]:
    """``post_recover_load``: which plugins ran, and what the warmup did if it ran here."""
    return _run_hook("post_recover_load", engine=_engine(is_restart=True), checkpoint=directory)


def pre_first_step() -> dict[str, Any]:
    """``pre_first_step``: which plugins ran, and what the warmup did if it ran here."""
    return _run_hook("pre_first_step", engine=_engine(is_restart=True))


def train() -> dict[str, Any]:
    """One real training step (see :mod:`megastart.demo.train`)."""
    from megastart.demo.train import train_step

    return train_step(_STATE["chunks"])


def finish() -> None:
    """Drop the model and Megatron's parallel state; return the freed heap to the OS."""
    from megastart.bench.memory import release_free_memory
    from megastart.harness.cpu import destroy_megatron

    _STATE.clear()
    destroy_megatron()
    release_free_memory()


def _engine(*, is_restart: bool) -> Any:
    import torch
    from megatron.core import parallel_state

    from megastart import __version__
    from megastart.manager import get_settings
    from megastart.records import EngineContext

    return EngineContext(
        host=HOST,
        host_version=__version__,
        model_chunks=_STATE["chunks"],
        parallel_state=parallel_state,
        device=torch.device("cpu"),
        dtype=torch.float32,
        hf_config=_STATE["hf_config"],
        is_restart=is_restart,
        settings=get_settings(),
    )


def _run_hook(name: str, **kwargs: Any) -> dict[str, Any]:
    """Call hook ``name``; the plugins that implement it and the warmup report, if one was made."""
    from dataclasses import asdict

    from megastart.manager import call_hook, get_plugin_manager

    pm = get_plugin_manager()
    plugins = [impl.plugin_name for impl in reversed(getattr(pm.hook, name).get_hookimpls())]
    if pm.get_plugin("comm_warmup") is None:  # blocked or disabled: never imported
        call_hook(name, **kwargs)
        return {"plugins": plugins, "warmup": None}
    from megastart.warmup.api import last_report

    before = last_report()
    call_hook(name, **kwargs)
    after = last_report()
    ran = after is not None and after is not before
    return {"plugins": plugins, "warmup": asdict(after) if ran else None}
