"""``pip install megastart`` is all verl >= 0.9 needs: every process that imports verl
has megastart's adapter on verl's engine the moment the engine module's import
returns; verl's ``VERL_USE_EXTERNAL_PLUGINS`` and ``MEGASTART_DISABLE`` keep it
off. verl 0.7 (no plugin group) activates through ``AUTOWRAPT_BOOTSTRAP``.
Each case runs in a fresh interpreter of this environment, where megastart is
installed as a wheel (its entry points and autowrapt's start-up file are real)."""

from __future__ import annotations

import json

import pytest
from support.pyrun import run_python
from verl_configs import HAS_PLUGIN_GROUP

ENGINE = "verl.workers.engine.megatron.transformer_impl"
LEGACY = "verl.workers.megatron_workers"

WRAPPED_AFTER_IMPORT = """
    import importlib, json, sys
    module = importlib.import_module({module!r})
    owner = vars(module)[{owner!r}]
    print(json.dumps({{
        "wrapped": hasattr(vars(owner)[{method!r}], "__wrapped__"),
        "megastart_imported": sorted(m for m in sys.modules if m.split(".")[0] == "megastart"),
    }}))
"""


def after_import(module: str, owner: str, method: str, **env: str) -> dict:
    """Import ``module`` (and nothing else) in a fresh interpreter; is ``owner.method``
    wrapped when the import returns, and which megastart modules were imported."""
    code = WRAPPED_AFTER_IMPORT.format(module=module, owner=owner, method=method)
    proc = run_python(code, env={"AUTOWRAPT_BOOTSTRAP": "", **env})
    return json.loads(proc.stdout.strip().splitlines()[-1])


needs_plugin_group = pytest.mark.skipif(not HAS_PLUGIN_GROUP, reason="verl >= 0.9")
needs_legacy_workers = pytest.mark.skipif(HAS_PLUGIN_GROUP, reason="verl 0.7 (legacy workers)")


@needs_plugin_group
def test_installed_megastart_wraps_the_engine_when_its_import_returns():
    out = after_import(ENGINE, "MegatronEngine", "_build_megatron_module")
    assert out["wrapped"]


@needs_plugin_group
@pytest.mark.parametrize("plugins", ["megastart", "auto", "other_plugin,megastart"])
def test_verl_plugin_filter_that_names_megastart_keeps_it(plugins):
    out = after_import(
        ENGINE, "MegatronEngine", "_build_megatron_module", VERL_USE_EXTERNAL_PLUGINS=plugins
    )
    assert out["wrapped"]


@needs_plugin_group
@pytest.mark.parametrize("plugins", ["none", "other_plugin"])
def test_verl_plugin_filter_that_leaves_megastart_out_imports_none_of_it(plugins):
    out = after_import(
        ENGINE, "MegatronEngine", "_build_megatron_module", VERL_USE_EXTERNAL_PLUGINS=plugins
    )
    assert out == {"wrapped": False, "megastart_imported": []}


@needs_plugin_group
def test_megastart_disable_leaves_the_engine_unwrapped():
    out = after_import(ENGINE, "MegatronEngine", "_build_megatron_module", MEGASTART_DISABLE="1")
    assert not out["wrapped"]


def test_a_process_that_never_imports_verl_imports_nothing_of_megastart():
    code = """
        import json, sys
        import torch, megatron.core, omegaconf
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("megastart", "wrapt"))))
    """
    proc = run_python(code, env={"AUTOWRAPT_BOOTSTRAP": ""})
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@needs_legacy_workers
def test_verl_0_7_variable_route_wraps_the_legacy_workers_when_their_import_returns():
    bootstrap = {"AUTOWRAPT_BOOTSTRAP": "megastart.bootstrap"}
    out = after_import(LEGACY, "ActorRolloutRefWorker", "_build_model_optimizer", **bootstrap)
    assert out["wrapped"]
    critic = after_import(LEGACY, "CriticWorker", "update_critic", **bootstrap)
    assert critic["wrapped"]


@needs_legacy_workers
def test_verl_0_7_without_the_variable_imports_none_of_megastart():
    out = after_import(LEGACY, "ActorRolloutRefWorker", "_build_model_optimizer")
    assert out == {"wrapped": False, "megastart_imported": []}


@needs_legacy_workers
def test_verl_0_7_megastart_on_carries_the_activation_variable_to_the_workers():
    from omegaconf import OmegaConf
    from verl_configs import ENV_VARS, compose_ppo_trainer

    from megastart.engines.verl_config import export_to_ray_workers

    config = compose_ppo_trainer(f"+{ENV_VARS}.AUTOWRAPT_BOOTSTRAP=user.patches", "+megastart=on")
    export_to_ray_workers(config)
    bootstrap = OmegaConf.select(config, f"{ENV_VARS}.AUTOWRAPT_BOOTSTRAP")
    assert bootstrap == "user.patches,megastart.bootstrap"


STATUS = "import sys; from megastart.cli import main; sys.exit(main(['status', '--json']))"


def verl_route(**env: str) -> str:
    proc = run_python(STATUS, env={"AUTOWRAPT_BOOTSTRAP": "", **env})
    return json.loads(proc.stdout)["activation"]["hosts"]["verl"]["route"]


def test_status_shows_how_the_installed_verl_activates_megastart():
    if HAS_PLUGIN_GROUP:
        assert verl_route() == "verl.plugins (loaded by every import of verl): installed = on"
        assert verl_route(VERL_USE_EXTERNAL_PLUGINS="none") == (
            "AUTOWRAPT_BOOTSTRAP=megastart.bootstrap in the workers' environment "
            "(verl.plugins is filtered: VERL_USE_EXTERNAL_PLUGINS=none leaves megastart out)"
        )
    else:
        assert verl_route() == (
            "AUTOWRAPT_BOOTSTRAP=megastart.bootstrap in the workers' environment "
            "(this verl is older than verl>=0.9)"
        )
