"""``megastart bench plan`` plans real models' checkpoints from synthetic metadata: the
names and shapes it makes are the ones ``transformers`` writes and the parameters the one
Megatron builds, checked here on small configs of the same families."""

from __future__ import annotations

from typing import Any

import pytest
from support.loader_ranks import parameter_shapes

from megastart.bench.plan import Layout, hf_tensors, rank_parameters
from megastart.harness.launch import RankPool
from megastart.loader.checkpoint import read_metadata

SMALL = {"deepseek_v3": {"num_nextn_predict_layers": 0}, "qwen3_moe": {}}
"""transformers writes no MTP layer, so the small DeepSeek-V3 has none."""


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from megastart.harness.checkpoints import make_checkpoint

    def make(arch: str) -> tuple[str, dict[str, Any]]:
        directory = make_checkpoint(arch, tmp_path_factory.mktemp(arch), **SMALL[arch])
        meta = read_metadata(directory, allow_pickle=False)
        return str(directory), meta.config

    return make


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_synthetic_tensors_are_the_ones_transformers_writes(small: Any, arch: str) -> None:
    directory, config = small(arch)
    tensors = read_metadata(directory, allow_pickle=False).tensors
    written = {name: entry.shape for name, entry in tensors.items()}
    made = {name: shape for name, shape, _ in hf_tensors(config)}
    assert made == written


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_synthetic_parameters_are_the_ones_megatron_builds(
    rank_pools: dict[int, RankPool], small: Any, arch: str
) -> None:
    directory, config = small(arch)
    (built,) = rank_pools[1].run(parameter_shapes, directory, {})
    made = {p.name: p.shape for p in rank_parameters(config, Layout(1, 1, 1))}
    assert made == built
