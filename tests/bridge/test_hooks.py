"""Megatron-Bridge's per-weight hooks as data (:mod:`megastart.loader.mapping.hooks`), and the
layouts that came with the eleven architectures 0.6.2 left to the bridge: Gemma 4's derived K
and V, MiMo-V2-Flash's narrower V heads, Mamba's ``in_proj``, a permuted ``AutoMapping``.
Each is compared, on each of two TP ranks, with the bridge's own hook and mapping on the same
tensors (:mod:`support.hook_ranks`); a derived tensor is read once, from its source.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import version
from typing import Any

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("Megatron-Bridge is not installed here", allow_module_level=True)

from support import hook_ranks

from megastart.harness.launch import RankPool

CASES = {  # the rank function, what its transform's name starts with, HF tensors it reads
    "gemma4-v_is_k": (hook_ranks.gemma4_qkv, ("v",), "interleave:", 2),
    "gemma4-zero_kv": (hook_ranks.gemma4_qkv, ("kv",), "interleave:", 1),
    "mimo_v2_flash-qkv": (hook_ranks.mimo_v2_flash_qkv, (), "interleave:", 3),
    "mamba-in_proj": (hook_ranks.mamba_in_proj, (), "interleave:", 1),
    "permuted-projector": (hook_ranks.permuted_projector, (), "permuted:1.0:", 1),
}


SINCE_0_6 = ("gemma4", "mimo_v2_flash")
"""Families Megatron-Bridge 0.6 added (the verl session runs these tests on 0.5.1 too)."""


@pytest.mark.parametrize("case", CASES)
def test_megastart_places_what_the_bridges_hook_and_mapping_make_on_each_tp_rank(
    rank_pools: dict[int, RankPool], case: str
) -> None:
    function, args, transform, reads = CASES[case]
    if case.startswith(SINCE_0_6) and version("megatron-bridge") < "0.6":
        pytest.skip(f"Megatron-Bridge {version('megatron-bridge')} has no {case} bridge")
    for rank, (theirs, ours, name, hf) in enumerate(rank_pools[2].run(function, *args)):
        assert name.startswith(transform), name
        assert len(hf) == len(set(hf)) == reads, f"rank {rank}: reads {hf}"
        assert not ours.isnan().any(), f"rank {rank}: rows left unplaced by {name}"
        assert torch.equal(theirs, ours), f"rank {rank}: differs ({name})"


def test_deepseek_v4_own_classes_and_hook_load_as_its_bridge_loads_them(
    rank_pools: dict[int, RankPool],
) -> None:
    """On tensors only: megatron-core 0.19.2 has no ``dsv4_hybrid`` attention variant, so no
    DeepSeek-V4 model builds on either machine's megatron-core."""
    if version("megatron-bridge") < "0.6":
        pytest.skip("Megatron-Bridge before 0.6 has no DeepSeek-V4 bridge")
    for rank, parts in enumerate(rank_pools[2].run(hook_ranks.deepseek_v4_parts)):
        names = [name for _, _, name, _ in parts]
        assert names == ["rows:0:1", "rows:1:2", "rows:2:3", "replicated"], names
        assert parts[-1][3] == ("layers.0.attn.indexer.weights_proj.weight",), parts[-1][3]
        for theirs, ours, name, _ in parts:
            assert torch.equal(theirs, ours), f"rank {rank}: {name} differs"


def test_every_hook_megastart_recognises_is_megatron_bridges_own() -> None:
    """Each class :data:`HOOKS` names exists in the installed Megatron-Bridge and defines the
    hook itself: a renamed or moved class is found here, not guessed at load time."""
    from importlib import import_module

    from support.bridge_ranks import import_megatron_bridge

    from megastart.loader.mapping.hooks import HOOKS

    import_megatron_bridge()
    for owner in HOOKS:
        module, _, name = owner.rpartition(".")
        if version("megatron-bridge") < "0.6" and not _importable(module):
            continue  # a family 0.6 added
        kind: Any = getattr(import_module(module), name)
        assert "maybe_modify_loaded_hf_weight" in vars(kind), owner


def test_a_registered_bridge_replaced_by_an_unknown_subclass_is_left_to_the_bridge() -> None:
    """Every bridge megastart serves, replaced by a subclass of its own class that overrides
    a method megastart does not read (how it builds its conversion tasks): megastart cannot
    know what it changes, so the bridge loads, by name; one that overrides nothing is served."""
    from support.bridge_ranks import import_megatron_bridge

    from megastart.architectures import megatron_bridge_architectures
    from megastart.loader.mapping.bridge import Untranslatable, bridge_table

    import_megatron_bridge()
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    served = megatron_bridge_architectures()["architectures"]
    checked = 0
    for source in get_model_bridge._exact_types:
        name = source if isinstance(source, str) else source.__name__
        if served[name]["served"] != "yes":
            continue
        registered = type(get_model_bridge(source))
        patched = {"build_conversion_tasks": registered.build_conversion_tasks}
        unknown = type(f"Patched{registered.__name__}", (registered,), patched)
        with pytest.raises(Untranslatable, match=f"subclass of {registered.__name__} that"):
            bridge_table(unknown(), [], (), tied=False)
        only_data = type(f"Renamed{registered.__name__}", (registered,), {})
        bridge_table(only_data(), [], (), tied=False)  # overriding nothing: served
        checked += 1
    assert checked >= (50 if version("megatron-bridge") >= "0.6" else 10), checked


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is missing too
        return False
