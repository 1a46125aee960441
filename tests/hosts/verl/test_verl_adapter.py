"""The verl adapter on the installed verl: it wraps exactly the three methods of
``MegatronEngine``, puts the originals back on detach, and refuses a verl outside
its supported range, naming the version, with nothing wrapped."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest
import verl.workers.engine.megatron.transformer_impl as transformer_impl

from megastart.engines.verl import VerlAdapter

WRAPPED = ("_build_megatron_module", "load_checkpoint", "forward_backward_batch")


@pytest.fixture(autouse=True)
def without_the_installed_adapter():
    """On verl >= 0.9, ``import verl`` activated megastart in this process and its adapter
    attached when the engine module was imported; these tests attach their own."""
    from megastart.engines import detach_all

    detach_all()


def methods() -> dict:
    return {name: transformer_impl.MegatronEngine.__dict__[name] for name in WRAPPED}


def test_attach_wraps_the_engine_methods_and_detach_restores_the_originals():
    originals = methods()
    adapter = VerlAdapter()
    assert adapter.attach(transformer_impl)
    assert adapter.attach(transformer_impl)  # idempotent
    wrapped = methods()
    for name in WRAPPED:
        assert wrapped[name] is not originals[name]
        assert wrapped[name].__wrapped__ is originals[name]
        # the concrete engines verl registers inherit the wrapped methods
        lm_head = getattr(transformer_impl.MegatronEngineWithLMHead, name)
        assert lm_head.__wrapped__ is originals[name].__get__(None, transformer_impl.MegatronEngine)
    assert logging.getLogger("megastart").getEffectiveLevel() == logging.INFO
    adapter.detach()
    adapter.detach()  # idempotent
    assert methods() == originals
    assert logging.getLogger("megastart").level == logging.NOTSET
    assert all(methods()[name] is originals[name] for name in WRAPPED)


def test_detach_refuses_to_drop_a_wrapper_installed_after_megastart():
    import wrapt

    adapter = VerlAdapter()
    adapter.attach(transformer_impl)
    outer = wrapt.wrap_function_wrapper(
        transformer_impl.MegatronEngine, "load_checkpoint", lambda w, i, a, k: w(*a, **k)
    )
    try:
        with pytest.raises(RuntimeError, match=r"MegatronEngine\.load_checkpoint: it was replaced"):
            adapter.detach()
    finally:
        transformer_impl.MegatronEngine.load_checkpoint = outer.__wrapped__
        adapter.detach()


class OldVerlOnlyAdapter(VerlAdapter):
    requirement = "verl<0.1"


def test_unsupported_verl_version_is_refused_with_the_version(caplog):
    originals = methods()
    with caplog.at_level(logging.WARNING, logger="megastart"):
        assert not OldVerlOnlyAdapter().attach(transformer_impl)
    assert f"requested verl<0.1 but found verl {metadata.version('verl')}" in caplog.text
    assert methods() == originals
