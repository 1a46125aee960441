"""rank0_loader for value models (critics, reward models) built as verl builds them: the
backbone matches ``transformers``, the value head keeps the host's initialisation unless
the checkpoint holds a reward head (real ranks, gloo, TP2 x PP2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from support.critic_ranks import load_critic_and_forward, reference_hidden_states

from megastart.harness.checkpoints import make_checkpoint

TP2_PP2 = {"tp": 2, "pp": 2}


def tensor_bytes(directory: str, names: set[str] | None = None) -> int:
    """Bytes of the checkpoint's tensors (``names`` only, if given)."""
    total = 0
    for path in Path(directory).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if names is None or name in names:
                    tensor = f.get_tensor(name)
                    total += tensor.numel() * tensor.element_size()
    return total


def last_stage(results: list[Any]) -> list[Any]:
    return [r for r in results if r[2] is not None]


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("qwen2", True)], ids=["llama-untied", "qwen2-tied"]
)
def test_critic_loads_its_backbone_and_keeps_the_hosts_value_head(
    rank_pools: Any, tmp_path: Path, arch: str, tied: bool
) -> None:
    """From a causal LM's checkpoint: every backbone parameter from the checkpoint, the head
    untouched (neither the vocabulary LM head nor, tied, the embedding goes into it)."""
    directory = str(make_checkpoint(arch, tmp_path, tie_word_embeddings=tied))
    hidden, _ = reference_hidden_states(directory)
    results = rank_pools[4].run(load_critic_and_forward, directory, TP2_PP2)
    heads = last_stage(results)
    assert len(heads) == 2  # both TP ranks of the last stage hold the (replicated) head
    for _, _, before, after in heads:
        assert torch.equal(after, before)
    expected = hidden @ heads[0][2].T  # transformers' last hidden states through the same head
    for rank, (report, values, _, _) in enumerate(results):
        diff = (values - expected).abs().max().item()
        assert diff <= 1e-4, f"rank {rank}: max abs value difference {diff:.3g}"
        assert report.left_to_host == ("output_layer.weight",)
    read = results[0][0].bytes_read
    assert read == tensor_bytes(directory) - (
        0 if tied else tensor_bytes(directory, {"lm_head.weight"})
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_critic_from_a_reward_checkpoint_takes_its_score_head(
    rank_pools: Any, tmp_path: Path, arch: str
) -> None:
    """From a ``*ForSequenceClassification`` checkpoint (one label): the head is ``score.weight``
    and the critic's values are the reward model's per-token scores."""
    directory = str(make_checkpoint(arch, tmp_path, reward_model=True))
    hidden, reward_model = reference_hidden_states(directory)
    score = reward_model.score.weight.detach()
    results = rank_pools[4].run(load_critic_and_forward, directory, TP2_PP2)
    for _, _, before, after in last_stage(results):
        assert torch.equal(after, score) and not torch.equal(before, score)
    with torch.no_grad():
        expected = reward_model.score(hidden).float()
    for rank, (report, values, _, _) in enumerate(results):
        diff = (values - expected).abs().max().item()
        assert diff <= 1e-4, f"rank {rank}: max abs value difference {diff:.3g}"
        assert report.left_to_host == ()
    assert results[0][0].bytes_read == tensor_bytes(directory)
