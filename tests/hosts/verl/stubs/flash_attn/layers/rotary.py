"""The name verl 0.7's legacy ParallelLlama attention imports; it may not run."""

from flash_attn import missing

apply_rotary_emb = missing("layers.rotary.apply_rotary_emb")
