"""The comm_warmup plugin through megastart's hooks: once per process, at the hook
``when`` selects, with the operations the engine's model config selects."""

from __future__ import annotations

from typing import Any

import pytest

from megastart.harness.launch import RankPool

SETTINGS = {"timeout_s": 30.0, "message_bytes": (4096, 65536)}


def run_hooks(when: str) -> list[str]:
    """post_recover_load, then pre_first_step, on a tiny pipeline-parallel GPTModel;
    the warmup summaries logged on rank 0."""
    import logging

    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megastart import EngineContext, manager
    from megastart.harness.cpu import destroy_megatron, initialize_megatron
    from megastart.settings import CoreSettings, Settings
    from megastart.warmup.api import reset_state
    from megastart.warmup.settings import CommWarmupSettings

    initialize_megatron(pp=2)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("megastart")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        config = TransformerConfig(  # batch_p2p_comm defaults to True: batched p2p only
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
            use_cpu_initialization=True,
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=256,
            max_sequence_length=32,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
        )
        settings = Settings(
            core=CoreSettings(),
            sections={"comm_warmup": CommWarmupSettings(when=when, **SETTINGS)},
        )
        engine = EngineContext(
            host="test",
            host_version="0",
            model_chunks=[model],
            parallel_state=parallel_state,
            device="cpu",
            is_restart=True,
            settings=settings,
        )
        manager.call_hook("post_recover_load", engine=engine, checkpoint="/recover/step_10")
        manager.call_hook("pre_first_step", engine=engine)
        return [message for message in logged if "comm_warmup (" in message]
    finally:
        logger.removeHandler(handler)
        reset_state()
        destroy_megatron()


@pytest.fixture(scope="module")
def pool() -> Any:
    with RankPool(2, timeout_s=300) as pool:
        yield pool


@pytest.mark.parametrize(
    ("when", "trigger"),
    [
        ("both", "post_recover_load"),
        ("post_recover", "post_recover_load"),
        ("first_step", "pre_first_step"),
    ],
)
def test_warmup_runs_once_at_the_selected_hook(pool: RankPool, when: str, trigger: str) -> None:
    rank0, rank1 = pool.run(run_hooks, when)
    assert rank1 == []  # logged once, on rank 0
    assert len(rank0) == 1
    # The model's config selects batched p2p: no pair over WORLD. tp and dp_cp have one
    # rank each, and the step still issues collectives on them.
    expected = f"comm_warmup ({trigger}): 6 groups [tp, dp_cp, pp, embedding, mp, dist_opt]"
    assert expected in rank0[0]
