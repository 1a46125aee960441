"""A critic as verl builds one (the checkpoint's decoder, a value head for its LM head), and
its ground truth: what each rank runs in the value-model tests."""

from __future__ import annotations

import os
from typing import Any

import torch

from support.loader_ranks import TOKENS, megatron, settings


class ValueHead(torch.nn.Linear):
    """A value head as verl builds one (``LinearForLastLayer``): hidden -> 1, no bias,
    replicated over TP, fp32 output, called the way GPTModel calls its ``output_layer``."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden, 1, bias=False)
        with torch.no_grad():  # the same random head on every rank, unlike any checkpoint tensor
            self.weight.copy_(torch.randn(1, hidden, generator=torch.Generator().manual_seed(7)))

    def forward(self, input_: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
        return super().forward(input_).float(), None


def build_critic(checkpoint: str) -> list[Any]:
    """A critic as verl builds it: the checkpoint's decoder, embeddings untied (verl sets
    ``tie_word_embeddings=False`` for a value model), the LM head replaced by :class:`ValueHead`."""
    from transformers import AutoConfig

    from megastart.harness import model

    hf_config = AutoConfig.from_pretrained(checkpoint)
    hf_config.tie_word_embeddings = False
    chunks = model.build_gpt_chunks(hf_config)
    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer = ValueHead(hf_config.hidden_size)
    return chunks


def load_critic_and_forward(
    checkpoint: str, layout: dict[str, int]
) -> tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The load report, the values on :data:`TOKENS` (every rank), and this rank's value head
    before and after the load (``None`` off the last stage)."""
    from megastart import load_hf_checkpoint
    from megastart.harness.model import forward_logits

    with megatron(layout):
        chunks = build_critic(checkpoint)
        head = chunks[-1].output_layer.weight if chunks[-1].post_process else None
        before = None if head is None else head.detach().clone()
        report = load_hf_checkpoint(chunks, checkpoint, settings=settings(), value_model=True)
        values = forward_logits(chunks, TOKENS, value_model=True)
        return report, values, before, None if head is None else head.detach().clone()


def reference_hidden_states(checkpoint: str | os.PathLike[str]) -> tuple[torch.Tensor, Any]:
    """Ground truth for a value model: the ``transformers`` model's last hidden states
    (after the final norm) on :data:`TOKENS`, fp32, and the model itself."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    reward = any(
        a.endswith("ForSequenceClassification")
        for a in AutoConfig.from_pretrained(checkpoint).architectures
    )
    auto = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    model = auto.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.base_model(TOKENS).last_hidden_state.float(), model
