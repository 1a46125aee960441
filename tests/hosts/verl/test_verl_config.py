"""``+megastart=on|off`` in verl's real ``ppo_trainer`` config: the group is found
through megastart's Hydra SearchPathPlugin, and the settings reach
``ray_kwargs.ray_init.runtime_env.env_vars`` as plain strings (verl 0.9 needs no
activation variable there: it loads megastart from ``verl.plugins``)."""

from __future__ import annotations

import dataclasses
from importlib import metadata

import pytest
from omegaconf import OmegaConf
from verl_configs import ENV_VARS, compose_ppo_trainer

from megastart.engines.verl_config import ExportToRayWorkers, export_to_ray_workers
from megastart.settings import SettingsError


def env_vars(config) -> dict:
    return OmegaConf.to_container(OmegaConf.select(config, ENV_VARS), resolve=False)


def test_hydra_1_3_discovers_the_searchpath_plugin():
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    found = [f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(SearchPathPlugin)]
    assert "hydra_plugins.megastart_searchpath.MegastartSearchPathPlugin" in found


def test_hydra_1_4_entry_point_names_the_plugin_class():
    (ep,) = [
        ep
        for ep in metadata.entry_points(group="hydra.plugins")
        if ep.name == "megastart_searchpath"
    ]
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    assert issubclass(ep.load(), SearchPathPlugin)


def test_without_the_override_the_config_is_verls_own():
    config = compose_ppo_trainer("model_engine=megatron")
    assert "megastart" not in config and "megastart" not in config.hydra.callbacks
    assert OmegaConf.select(config, ENV_VARS) is None


def test_megastart_on_adds_the_section_and_the_callback():
    config = compose_ppo_trainer("model_engine=megatron", "+megastart=on")
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    assert config.megastart.enabled is True
    assert list(config.megastart.blocklist) == []
    assert config.megastart.rank0_loader.bucket_mb is None  # null: the plugin's default
    target = config.hydra.callbacks.megastart._target_
    assert target == f"{ExportToRayWorkers.__module__}.{ExportToRayWorkers.__qualname__}"


def test_export_writes_the_settings_as_plain_strings_and_no_activation():
    config = compose_ppo_trainer(
        "model_engine=megatron",
        "+megastart=on",
        "megastart.blocklist=[comm_warmup]",
        "megastart.rank0_loader.bucket_mb=64",
    )
    export_to_ray_workers(config)
    written = env_vars(config)
    assert float(written.pop("MEGASTART_RANK0_LOADER_BUCKET_MB")) == 64
    assert written == {
        "MEGASTART_ENABLED": "true",
        "MEGASTART_BLOCKLIST": "comm_warmup",
        "MEGASTART_TRACE": "false",
        "MEGASTART_LIBRARY_ADAPTERS": "true",
    }


def test_user_external_modules_are_left_alone():
    config = compose_ppo_trainer(
        "model_engine=megatron",
        f"+{ENV_VARS}.VERL_USE_EXTERNAL_MODULES='my.mod,other.mod'",
        "+megastart=on",
    )
    export_to_ray_workers(config)
    assert env_vars(config)["VERL_USE_EXTERNAL_MODULES"] == "my.mod,other.mod"


def test_megastart_off_adds_the_section_and_carries_it_to_the_workers():
    config = compose_ppo_trainer("model_engine=megatron", "+megastart=off")
    assert config.megastart.enabled is False
    export_to_ray_workers(config)
    assert env_vars(config)["MEGASTART_ENABLED"] == "false"


def test_plugin_filter_that_leaves_megastart_out_is_warned_about(caplog):
    config = compose_ppo_trainer(
        "model_engine=megatron", f"+{ENV_VARS}.VERL_USE_EXTERNAL_PLUGINS=none", "+megastart=on"
    )
    export_to_ray_workers(config)
    assert "VERL_USE_EXTERNAL_PLUGINS=none leaves megastart out of verl.plugins" in caplog.text


def test_disabling_is_carried_to_the_workers():
    config = compose_ppo_trainer(
        "model_engine=megatron", "+megastart=on", "megastart.enabled=false"
    )
    export_to_ray_workers(config)
    assert env_vars(config)["MEGASTART_ENABLED"] == "false"


def test_unknown_setting_fails_in_the_driver_naming_the_valid_keys():
    config = compose_ppo_trainer(
        "model_engine=megatron", "+megastart=on", "+megastart.rank0_loader.bucket_size=64"
    )
    with pytest.raises(SettingsError, match=r"bucket_size.*valid keys.*bucket_mb"):
        export_to_ray_workers(config)


def test_the_group_lists_every_setting_of_the_builtin_plugins():
    from megastart.loader.settings import Rank0LoaderSettings
    from megastart.warmup.settings import CommWarmupSettings

    section = compose_ppo_trainer("+megastart=on").megastart
    for name, cls in {
        "rank0_loader": Rank0LoaderSettings,
        "comm_warmup": CommWarmupSettings,
    }.items():
        assert sorted(section[name]) == sorted(f.name for f in dataclasses.fields(cls)), name


def test_multirun_is_refused_rather_than_run_without_megastart():
    config = compose_ppo_trainer("model_engine=megatron", "+megastart=on")
    with pytest.raises(RuntimeError, match="does not support Hydra multirun"):
        ExportToRayWorkers().on_multirun_start(config=config)
