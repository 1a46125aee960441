"""CPU stand-ins for a Megatron-core training job: test and demo support, never library code.

``cpu`` initialises Megatron's parallel state inside a :class:`megastart.launch.RankPool`
rank and applies the shims Megatron needs without a GPU; ``model`` builds this
rank's GPTModel chunks from a ``transformers`` config and runs a pipeline forward;
``checkpoints`` writes small random Hugging Face checkpoints.
"""
