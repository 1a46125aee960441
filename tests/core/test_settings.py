"""Settings resolve defaults < config < environment, and reject what they do not know."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
from omegaconf import OmegaConf

from megastart.settings import SettingsError, resolve


@dataclass(kw_only=True, slots=True)
class LoaderLike:
    bucket_mb: int = 256
    timeout_s: float = 300.0
    reader: Literal["global", "node"] = "global"
    strict: bool = False
    tags: tuple[str, ...] = ()
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")


SECTIONS = {"rank0_loader": LoaderLike}


def test_defaults_when_nothing_is_set():
    settings = resolve(None, environ={}, sections=SECTIONS)
    assert settings.enabled and settings.blocklist == ()
    assert settings.section("rank0_loader") == LoaderLike()
    assert settings.sources["rank0_loader.bucket_mb"] == "default"


def test_config_overrides_default_and_env_overrides_config():
    config = {"blocklist": ["comm_warmup"], "rank0_loader": {"bucket_mb": 64, "reader": "node"}}
    env = {"MEGASTART_RANK0_LOADER_BUCKET_MB": "32", "MEGASTART_TRACE": "1"}
    settings = resolve(config, environ=env, sections=SECTIONS)
    loader = settings.section("rank0_loader")
    assert loader.bucket_mb == 32 and loader.reader == "node"
    assert settings.blocklist == ("comm_warmup",) and settings.core.trace
    assert settings.sources["rank0_loader.bucket_mb"] == "env:MEGASTART_RANK0_LOADER_BUCKET_MB"
    assert settings.sources["rank0_loader.reader"] == "config"
    assert settings.sources["blocklist"] == "config"


def test_omegaconf_section_is_accepted_and_resolved():
    cfg = OmegaConf.create({"size": 16, "megastart": {"rank0_loader": {"bucket_mb": "${size}"}}})
    settings = resolve(cfg.megastart, environ={}, sections=SECTIONS)
    assert settings.section("rank0_loader").bucket_mb == 16


@pytest.mark.parametrize(
    ("env", "enabled"),
    [
        ({"MEGASTART_DISABLE": "1"}, False),
        ({"MEGASTART_DISABLE": "0"}, True),
        ({"MEGASTART_ENABLED": "off"}, False),
    ],
)
def test_disable_variables(env, enabled):
    assert resolve({"enabled": True}, environ=env, sections=SECTIONS).enabled is enabled


def test_env_lists_and_optionals_parse():
    env = {
        "MEGASTART_BLOCKLIST": "a, b,,c",
        "MEGASTART_RANK0_LOADER_TAGS": "x,y",
        "MEGASTART_RANK0_LOADER_LIMIT": "none",
    }
    settings = resolve(None, environ=env, sections=SECTIONS)
    assert settings.blocklist == ("a", "b", "c")
    assert settings.section("rank0_loader").tags == ("x", "y")
    assert settings.section("rank0_loader").limit is None


def test_unknown_key_lists_valid_keys():
    with pytest.raises(
        SettingsError,
        match=r"unknown megastart setting\(s\) \['bucket_size'\].*valid keys: \['bucket_mb'",
    ):
        resolve({"rank0_loader": {"bucket_size": 1}}, environ={}, sections=SECTIONS)


def test_unknown_top_level_key_lists_valid_keys():
    with pytest.raises(
        SettingsError,
        match=r"\['enable'\] in the top level; valid keys: \['enabled', 'blocklist', 'trace', 'library_adapters'\]",
    ):
        resolve({"enable": False}, environ={}, sections=SECTIONS)


def test_unknown_section_lists_valid_sections():
    with pytest.raises(
        SettingsError, match=r"section\(s\) \['rank0_loadr'\]; valid sections: \['rank0_loader'\]"
    ):
        resolve({"rank0_loadr": {"bucket_mb": 1}}, environ={}, sections=SECTIONS)


def test_section_of_a_blocked_plugin_is_accepted_unread():
    settings = resolve(
        {"comm_warmup": {"when": "x"}},
        environ={"MEGASTART_COMM_WARMUP_WHEN": "x"},
        sections=SECTIONS,
        ignored_sections={"comm_warmup"},
    )
    assert "comm_warmup" not in settings.sections


def test_unknown_environment_variable_lists_valid_ones():
    with pytest.raises(
        SettingsError, match=r"MEGASTART_BUCKET_MB.*valid: .*MEGASTART_RANK0_LOADER_BUCKET_MB"
    ):
        resolve(None, environ={"MEGASTART_BUCKET_MB": "1"}, sections=SECTIONS)


def test_unknown_field_in_a_known_section_env():
    with pytest.raises(
        SettingsError, match=r"MEGASTART_RANK0_LOADER_BUCKETS.*MEGASTART_RANK0_LOADER_BUCKET_MB"
    ):
        resolve(None, environ={"MEGASTART_RANK0_LOADER_BUCKETS": "1"}, sections=SECTIONS)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MEGASTART_RANK0_LOADER_BUCKET_MB": "big"}, r"BUCKET_MB='big': expected int"),
        ({"MEGASTART_RANK0_LOADER_TIMEOUT_S": "soon"}, r"TIMEOUT_S='soon': expected float"),
        (
            {"MEGASTART_RANK0_LOADER_READER": "rack"},
            r"expected one of \['global', 'node'\], got 'rack'",
        ),
        ({"MEGASTART_RANK0_LOADER_STRICT": "maybe"}, r"expected a boolean"),
        ({"MEGASTART_TRACE": "2"}, r"MEGASTART_TRACE='2': expected a boolean"),
    ],
)
def test_unparsable_environment_values(env, message):
    with pytest.raises(SettingsError, match=message):
        resolve(None, environ=env, sections=SECTIONS)


def test_unparsable_config_value_names_the_key():
    with pytest.raises(SettingsError, match=r"megastart.rank0_loader.strict: expected a boolean"):
        resolve({"rank0_loader": {"strict": "sometimes"}}, environ={}, sections=SECTIONS)


def test_value_rejected_by_the_section_names_the_constraint():
    with pytest.raises(SettingsError, match=r"rank0_loader: bucket_mb must be positive, got 0"):
        resolve({"rank0_loader": {"bucket_mb": 0}}, environ={}, sections=SECTIONS)


def test_section_must_be_a_mapping():
    with pytest.raises(SettingsError, match="must be a mapping"):
        resolve(["enabled"], environ={}, sections=SECTIONS)


@pytest.mark.parametrize("field", ["BUCKET_MB", "TIMEOUT_S"])
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_numbers_are_refused_naming_the_variable(field, raw):
    from megastart.loader.settings import Rank0LoaderSettings

    var = f"MEGASTART_RANK0_LOADER_{field}"
    with pytest.raises(SettingsError, match=rf"{var}='{raw}': expected a finite number"):
        resolve(None, environ={var: raw}, sections={"rank0_loader": Rank0LoaderSettings})


@pytest.mark.parametrize("value", [1e12, 2048, 0.001, 0, -1])
def test_bucket_mb_outside_its_range_names_setting_variable_and_range(value):
    from megastart.loader.settings import Rank0LoaderSettings

    with pytest.raises(
        SettingsError,
        match=r"rank0_loader.bucket_mb \(MEGASTART_RANK0_LOADER_BUCKET_MB\) must be between "
        rf"0.01 and 1024 MiB, got {value}",
    ):
        resolve(
            {"rank0_loader": {"bucket_mb": value}},
            environ={},
            sections={"rank0_loader": Rank0LoaderSettings},
        )


def test_settings_built_directly_refuse_nan_too():
    from megastart.loader.settings import Rank0LoaderSettings
    from megastart.warmup.settings import CommWarmupSettings

    with pytest.raises(ValueError, match=r"MEGASTART_RANK0_LOADER_BUCKET_MB.*got nan"):
        Rank0LoaderSettings(bucket_mb=float("nan"))
    with pytest.raises(ValueError, match=r"MEGASTART_RANK0_LOADER_TIMEOUT_S.*finite.*got inf"):
        Rank0LoaderSettings(timeout_s=float("inf"))
    with pytest.raises(ValueError, match=r"MEGASTART_COMM_WARMUP_TIMEOUT_S.*finite.*got nan"):
        CommWarmupSettings(timeout_s=float("nan"))
