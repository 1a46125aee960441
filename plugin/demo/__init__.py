"""A CPU stand-in for a Megatron-core training job: test and demo support, never library code.

The harness the tests, the benchmarks and the ``megastart demo`` command share:
``cpu`` initialises Megatron's parallel state inside a
:class:`megastart.harness.launch.RankPool` rank and applies the shims Megatron needs
without a GPU; ``model`` builds this rank's GPTModel chunks from a
``transformers`` config and runs a pipeline forward; ``checkpoints`` writes
random Hugging Face checkpoints. The other modules are the demo itself.
"""
