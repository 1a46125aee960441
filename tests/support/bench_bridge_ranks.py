"""What each rank runs to check ``bench loader``'s ``bridge`` strategy: the benchmark's own
rank functions (build, load, checksum), with Megatron-Bridge imported as the other
Megatron-Bridge tests import it (:func:`support.bridge_ranks.import_megatron_bridge`)."""

from __future__ import annotations

from typing import Any

import torch

from support.bridge_ranks import import_megatron_bridge, poison


def benchmark_checksums(
    checkpoint: str, layout: dict[str, Any], strategies: tuple[str, ...]
) -> dict[str, tuple[str, int]]:
    """Per strategy: the benchmark's checksum of this rank's parameters after the strategy
    loaded into parameters set to NaN, and how many values are still NaN."""
    from megastart.bench import strategies as bench

    import_megatron_bridge()
    bench.build_model(checkpoint, layout)
    try:
        out = {}
        for name in strategies:
            poison(bench._STATE["chunks"])
            bench.load(name, checkpoint, {})
            nans = sum(int(p.isnan().sum()) for c in bench._STATE["chunks"] for p in c.parameters())
            out[name] = (bench.checksum(), nans)
        return out
    finally:
        bench.teardown()
        torch.distributed.barrier()
