"""What each rank runs in the registration tests: which of its slots the registered route
registers (:func:`megastart.loader.stream.stream.goes_straight`, on meta tensors), against the
pieces :meth:`Stream.apply` would copy, cut out of real views of the files' mappings."""

from __future__ import annotations

from typing import Any

import torch

from support.loader_ranks import build, megatron


def straight_slots(checkpoint: str, layout: dict[str, int]) -> dict[str, Any]:
    """This rank's slots of its plan, by name: those chosen for registration, those a copy
    takes straight out of the mapping, and the blocks registered for the plan's buckets."""
    from megastart.loader.checkpoint import read_metadata
    from megastart.loader.mapping.model import local_needs
    from megastart.loader.plan.buckets import build_plan
    from megastart.loader.stream.mappings import FileMappings
    from megastart.loader.stream.pagecache import Window
    from megastart.loader.stream.registration import blocks_in_order
    from megastart.loader.stream.straight import consumers_of, goes_straight

    with megatron(layout):
        meta = read_metadata(checkpoint, allow_pickle=False)
        _, tensors, shard, needs = local_needs(build(checkpoint), meta)
        consumers = consumers_of(needs)
        demands = [demand for need in needs for demand in need.demands()]
        plan = build_plan([demands], meta, bucket_bytes=1 << 20)
        mappings = FileMappings(meta)

        def chosen(bucket: Any) -> list[Any]:
            return [
                slot
                for slot in bucket.slots
                if slot.name in consumers
                and goes_straight(slot, meta, consumers[slot.name], tensors, shard)
            ]

        slots = [slot for bucket in plan.buckets for slot in bucket.slots]
        copied = {
            slot.name
            for slot in slots
            if any(
                copied_straight(Window(mappings, [slot]), slot, need, index, tensors, shard)
                for need, index in consumers.get(slot.name, ())
            )
        }
        return {
            "mine": sorted({slot.name for slot in slots if slot.name in consumers}),
            "chosen": sorted({slot.name for bucket in plan.buckets for slot in chosen(bucket)}),
            "copied_straight": sorted(copied),
            "blocks": len(blocks_in_order(mappings, plan, chosen)),
        }


def copied_straight(
    window: Any, slot: Any, need: Any, index: int, tensors: Any, shard: Any
) -> bool:
    """Whether a piece :meth:`Stream.apply` cuts from ``slot``'s real view of the mapping for
    ``need`` is what the copier takes straight: bytes of the mapping itself, contiguous, in
    the parameter's dtype, into a contiguous slice."""
    from megastart.loader.mapping.transforms import TRANSFORMS

    if index >= len(need.hf) or (need.scales and need.scales[index]):
        return False
    data = window.mappings[window.entries[slot.name].file]
    low, high = data.data_ptr(), data.data_ptr() + data.numel()
    param = tensors[(need.param.chunk, need.param.local_name)]
    return any(
        isinstance(piece, torch.Tensor)
        and low <= piece.data_ptr() < high
        and piece.dtype == param.dtype
        and piece.is_contiguous()
        and param.data[first:stop].is_contiguous()
        for first, stop, piece in TRANSFORMS[need.transform].blocks(
            index, window.view(slot), slot.rows, need.param.shape, shard
        )
    )
