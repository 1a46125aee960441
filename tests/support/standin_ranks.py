"""What each rank runs in the slime and ROLL adapter tests: their host modules are the
stand-ins of :mod:`support.standins` (see its README: the commits they mirror), imported after
megastart was activated, as ``AUTOWRAPT_BOOTSTRAP`` activates it at start-up."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from support.library_ranks import attached, recording
from support.loader_ranks import TOKENS, build, megatron
from support.pyrun import started_with

STANDINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standins")


@contextmanager
def standins(**env: str) -> Iterator[None]:
    """The stand-ins importable (and their versions found), megastart configured from ``env``."""
    from megastart.manager import reset

    if STANDINS not in sys.path:
        sys.path.insert(0, STANDINS)
        importlib.invalidate_caches()
    with started_with(env):
        reset()
        try:
            yield
        finally:
            reset()


def slime_hf_start(checkpoint: str, layout: dict[str, int], **env: str) -> dict[str, Any]:
    """slime's start from an HF directory (``--load`` is one): ``load_checkpoint`` of the model
    in megatron-core's DDP. The hooks called, what slime's own loader did, the logits."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megastart.demo.train import cuda_factories_on_cpu
    from megastart.harness.model import forward_logits

    with standins(**env), recording() as recorder, megatron(layout):
        from slime.backends.megatron_utils import checkpoint as slime_checkpoint
        from slime.backends.megatron_utils.hf_to_megatron import LOADED_BY_SLIME

        LOADED_BY_SLIME.clear()
        chunks = build(checkpoint)
        with cuda_factories_on_cpu():
            ddp = DistributedDataParallel(
                chunks[0].config, DistributedDataParallelConfig(), chunks[0]
            )
        slime_checkpoint.ARGS.load = checkpoint
        iteration, _ = slime_checkpoint.load_checkpoint([ddp], None, None, None, False)
        return {
            "calls": recorder.calls,
            "iteration": iteration,
            "slime_loaded": list(LOADED_BY_SLIME),
            "logits": forward_logits(chunks, TOKENS),
            "attached": attached(),
        }


def roll_from_pretrained(checkpoint: str, layout: dict[str, int], **env: str) -> dict[str, Any]:
    """ROLL's ``McaGPTModel.from_pretrained`` of an HF directory: the hooks called, the stages
    ROLL's converter converted itself, the logits of the models it returned."""
    from megastart.harness.model import forward_logits

    with standins(**env), recording() as recorder, megatron(layout):
        from mcore_adapter.models.converter.model_converter import CONVERTED
        from mcore_adapter.models.model_factory import McaGPTModel

        CONVERTED.clear()
        models = McaGPTModel.from_pretrained(checkpoint)
        return {
            "calls": recorder.calls,
            "converted": list(CONVERTED),
            "logits": forward_logits(models.models, TOKENS),
            "attached": attached(),
        }
