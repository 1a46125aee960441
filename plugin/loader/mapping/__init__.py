r"""Mapping: what a rank needs, and how HF tensors become its slices.

Takes this rank's Megatron model chunks and the checkpoint's metadata
(:class:`~megastart.loader.checkpoint.CheckpointMeta`); returns the rank's
:class:`~megastart.loader.mapping.needs.Need`\ s (one per parameter: the HF tensors,
their dtypes, and the transform that cuts the rank's slice out of them), validated
against the checkpoint's names and shapes before any byte moves. Nothing here touches
torch.distributed; the transforms are torch operations on tensors of either device.

Modules, in reading order:

- ``mappings``: HF <-> Megatron name tables, one per architecture, as data
  (``archs/``: one module per family);
- ``bridge``, ``bridge_classes``, ``bridge_layouts``, ``hooks``: the same knowledge read from
  the host's Megatron-Bridge bridge at run time: its own mapping classes, its config-dependent
  layouts and its per-weight hook, as data;
- ``model``: this rank's model (parameters, config, shard) matched to a checkpoint;
- ``experts``: expert-parallel numbering (local <-> global expert index);
- ``needs``: which HF tensors each parameter needs, in which dtype, validated;
- ``transforms``, ``transform_base``, ``slices``, ``interleave``, ``fused``, ``permuted``: how
  full HF tensors become a rank's shard of one parameter;
- ``dequantise``, ``unpack``: FP8 block-scaled and packed 4-bit weights, dequantised on
  the rank that receives them.
"""
