"""Hook specifications: the contract between megastart's hosts and its plugins.

A host (through its engine adapter) calls these hooks at three points of a
training job's start. Plugins implement them with ``@megastart.hookimpl`` and
register through the ``megastart`` entry-point group.

Every hook is **collective**: all training ranks call it together, in the same
order. An implementation therefore must

- issue the same collectives on every rank, in the same order;
- bound every collective with a timeout;
- turn a failure on one rank into an error on every rank, and raise it
  (never swallow it and "fall back": a half-done collective leaves the
  communicators in an unknown state);
- never touch a process group it did not create or obtain from the
  ``parallel_state`` in the context (other programs share the registry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pluggy import HookimplMarker, HookspecMarker

if TYPE_CHECKING:
    from megastart.records import EngineContext, LoadReport

PROJECT = "megastart"

hookspec = HookspecMarker(PROJECT)

hookimpl = HookimplMarker(PROJECT)
"""Marker for hook implementations; use it as ``@megastart.hookimpl``."""

# -------------------------------------------------------------------------
# Model loading
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def on_model_load(engine: EngineContext, checkpoint: str) -> LoadReport | None:
    """Called where the host would load Hugging Face weights into its freshly
    built Megatron model.

    Stops at first non-None result, see :ref:`firstresult`. When every
    implementation returns ``None``, the host's own loader runs.

    Runs on every training rank, together, after the model chunks are built
    (parameters allocated, on their device) and before the optimizer sees
    them. On a restart it runs too: the recover checkpoint overwrites the
    weights afterwards (see ``post_recover_load``). Besides the hosts' own
    loaders, Megatron-Bridge's (``AutoBridge.load_hf_weights``,
    ``to_megatron_provider(load_weights=True)``) and mbridge's
    (``Bridge.load_weights``) call it; one load gives one call, from the
    adapter nearest the host.

    :param engine: this rank's engine; ``engine.model_chunks`` are the chunks to
        fill in place (GPT decoders, or multimodal models whose towers are
        parameters of the chunk like the decoder's).
    :param checkpoint: the HF checkpoint directory (``config.json`` and
        ``*.safetensors``).
    :returns: a :class:`~megastart.records.LoadReport` when this implementation
        loaded every parameter of every chunk (for a value model: every one
        but those the report names in ``left_to_host``); ``None`` to let the
        next implementation (and finally the host) load. The decision to
        return ``None`` must be the same on every rank and taken before any
        bulk collective.

    **Value models.** ``engine.value_model`` is true for a critic or a reward
    model: the same decoder, with a one-output value head as the last stage's
    ``output_layer`` (``[1, hidden]``, neither vocabulary-parallel nor tied to
    the embedding). The backbone comes from the checkpoint as for any model.
    The head is the host's, initialised by it, unless the checkpoint holds a
    reward head of exactly its shape (``score.weight`` of a
    ``*ForSequenceClassification`` / ``*ForTokenClassification`` checkpoint, a
    ``reward_head.weight``, or a one-row ``lm_head.weight``, which verl's own
    loaders take too); then the head is read from it. An implementation that
    reads no such head must leave the head's parameters untouched and name
    them in ``LoadReport.left_to_host``. A vocabulary ``lm_head.weight`` (or,
    with tied embeddings, the embedding) never goes into a value head. An
    implementation that does not handle value models returns ``None`` for
    them.

    An implementation must not leave parameters half-written: it either fills
    every element of every local parameter it owns or raises on every rank. It
    must not keep process groups or communicator buffers alive after returning.
    """


# -------------------------------------------------------------------------
# Restart
# -------------------------------------------------------------------------


@hookspec
def post_recover_load(engine: EngineContext, checkpoint: str) -> None:
    """Called right after the host restored a recover (resume) checkpoint.

    Runs on every training rank, together, after the weights and optimizer
    state are restored and, where the host colocates its rollout engine, after
    that engine was paused and offloaded; before the weights are pushed to the
    rollout engine. GPU memory is light here, which makes it the place to
    allocate what the first step would otherwise allocate at its peak.

    :param engine: this rank's engine (``engine.is_restart`` is true).
    :param checkpoint: the recover checkpoint's path, as the host names it.

    Hosts without an adapter of their own reach it through Megatron-LM's and
    Megatron-Bridge's ``load_checkpoint`` when it returns an iteration past
    zero (a resume); a bare ``dist_checkpointing.load`` never calls it.

    An implementation must not change parameters or optimizer state, and must
    not issue collectives on groups shared with the rollout engine (e.g. the
    weight-update group).
    """


# -------------------------------------------------------------------------
# Training
# -------------------------------------------------------------------------


@hookspec
def pre_first_step(engine: EngineContext) -> None:
    """Called once per process, right before the first training step.

    Runs on every training rank, together, on a fresh start and on a restart
    alike, before the host's first forward/backward, which may be a
    forward-only pass (a log-prob pass: verl's first ``compute_log_prob``,
    AReaL's first ``compute_logp``) as well as a training one (``ppo_update``).
    Hosts without an adapter of their own reach it through megatron-core's
    schedules: before the first call in the process of any function
    ``get_forward_backward_func()`` returns, however the host cached it. Never
    while a CUDA graph is being captured. Once per Megatron world: a process
    that destroys its model-parallel state and builds a new one
    (``destroy_model_parallel``) calls it again before the new world's first
    step.

    :param engine: this rank's engine; ``engine.ddp_config`` is the DDP config
        where the host wrapped the model in megatron-core's DDP.

    An implementation must not change parameters or optimizer state.
    """
