"""The legacy-worker adapter on the installed verl 0.7: it wraps the workers' build,
checkpoint-load and step methods, keeps the ``@register`` attributes verl's worker
groups bind by, puts the originals back on detach, refuses a verl outside its range,
and shares the log level with the engine adapter attached in the same process."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest

megatron_workers = pytest.importorskip(
    "verl.workers.megatron_workers", reason="needs verl 0.7 (legacy workers)"
)

from verl.single_controller.base.decorator import MAGIC_ATTR  # noqa: E402
from verl.single_controller.ray.base import _bind_workers_method_to_parent  # noqa: E402

from megastart.engines.verl import VerlAdapter  # noqa: E402
from megastart.engines.verl_legacy import (  # noqa: E402
    BUILDS,
    FIRST_STEPS,
    RECOVER_LOADS,
    VerlLegacyAdapter,
)

WRAPPED = BUILDS + RECOVER_LOADS + FIRST_STEPS


def methods() -> dict:
    out = {}
    for name in WRAPPED:
        owner, method = name.split(".")
        out[name] = vars(getattr(megatron_workers, owner))[method]
    return out


def test_attach_wraps_the_worker_methods_and_detach_restores_the_originals():
    originals = methods()
    adapter = VerlLegacyAdapter()
    assert adapter.attach(megatron_workers)
    assert adapter.attach(megatron_workers)  # idempotent
    for name, wrapped in methods().items():
        assert wrapped is not originals[name]
        assert wrapped.__wrapped__ is originals[name]
    # the worker class verl's trainer instantiates inherits the wrapped methods
    async_worker = megatron_workers.AsyncActorRolloutRefWorker
    assert hasattr(async_worker.compute_log_prob, "__wrapped__")
    assert logging.getLogger("megastart").getEffectiveLevel() == logging.INFO
    adapter.detach()
    adapter.detach()  # idempotent
    assert methods() == originals
    assert logging.getLogger("megastart").level == logging.NOTSET


def bound_by_verl(worker_class: type) -> dict[str, dict]:
    """The methods verl's colocated worker group binds for ``worker_class``, with their
    dispatch attributes (verl's own binding code)."""

    class WorkerDict:
        pass

    _bind_workers_method_to_parent(WorkerDict, "role", worker_class)
    return {
        name: getattr(method, MAGIC_ATTR)
        for name, method in vars(WorkerDict).items()
        if name.startswith("role_")
    }


@pytest.mark.parametrize("worker", ["ActorRolloutRefWorker", "CriticWorker"])
def test_verls_worker_groups_bind_the_wrapped_methods_as_before(worker):
    worker_class = getattr(megatron_workers, worker)
    before = bound_by_verl(worker_class)
    adapter = VerlLegacyAdapter()
    assert adapter.attach(megatron_workers)
    try:
        after = bound_by_verl(worker_class)
    finally:
        adapter.detach()
    assert after == before
    wrapped = [
        name.split(".")[1] for name in RECOVER_LOADS + FIRST_STEPS if name.startswith(worker)
    ]
    assert {f"role_{name}" for name in wrapped} <= after.keys()


def test_both_verl_adapters_in_one_process_restore_the_log_level_in_any_order():
    import verl.workers.engine.megatron.transformer_impl as transformer_impl

    logger = logging.getLogger("megastart")
    engine, legacy = VerlAdapter(), VerlLegacyAdapter()
    assert engine.attach(transformer_impl) and legacy.attach(megatron_workers)
    engine.detach()
    assert logger.getEffectiveLevel() == logging.INFO  # the legacy adapter still shows summaries
    legacy.detach()
    assert logger.level == logging.NOTSET


class NewVerlOnlyAdapter(VerlLegacyAdapter):
    requirement = "verl>=99"


def test_unsupported_verl_version_is_refused_with_the_version(caplog):
    originals = methods()
    with caplog.at_level(logging.WARNING, logger="megastart"):
        assert not NewVerlOnlyAdapter().attach(megatron_workers)
    assert f"requested verl>=99 but found verl {metadata.version('verl')}" in caplog.text
    assert methods() == originals


def test_status_shows_every_verl_adapter_compatible_with_verl_0_7():
    from megastart.status import collect

    engines = {e["name"]: e for e in collect()["engines"] if e["host"] == "verl"}
    assert engines.keys() == {
        "verl.trainer.main_ppo",
        "verl.workers.engine.megatron.transformer_impl",
        "verl.workers.megatron_workers",
    }
    for engine in engines.values():
        assert engine["compatible"], engine
        assert engine["installed_version"] == metadata.version("verl")
