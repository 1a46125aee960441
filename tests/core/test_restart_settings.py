"""``rank0_loader.skip_hf_load_on_resume`` is on by default; AReaL's deprecated
``skip_hf_load_on_recover`` given alone is honoured with one warning, and refused where it
disagrees with the new setting."""

from __future__ import annotations

import logging

import pytest

from megastart import manager
from megastart.errors import SettingsError
from megastart.restart import checkpoint_bytes, policy, skip_wanted

NEW = "MEGASTART_RANK0_LOADER_SKIP_HF_LOAD_ON_RESUME"
OLD = "MEGASTART_AREAL_SKIP_HF_LOAD_ON_RECOVER"


@pytest.fixture
def settings_from(monkeypatch):
    def resolve(**env: str) -> None:
        for name in (NEW, OLD):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        manager.reset()
        policy._warned.clear()

    yield resolve
    manager.reset()


def test_the_skip_is_on_by_default_and_one_variable_turns_it_off(settings_from):
    settings_from()
    assert skip_wanted()
    settings_from(**{NEW: "0"})
    assert not skip_wanted()


def test_the_deprecated_areal_setting_alone_is_honoured_with_one_warning(settings_from, caplog):
    settings_from(**{OLD: "0"})
    with caplog.at_level(logging.WARNING, logger="megastart"):
        assert not skip_wanted()
        assert not skip_wanted()
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1 and NEW in warnings[0]


def test_both_settings_disagreeing_are_refused_naming_both(settings_from):
    settings_from(**{OLD: "1", NEW: "0"})
    with pytest.raises(SettingsError) as refused:
        skip_wanted()
    assert NEW in str(refused.value) and OLD in str(refused.value)
    settings_from(**{OLD: "1", NEW: "1"})
    assert skip_wanted()


def test_what_a_skip_does_not_read_is_the_weight_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_bytes(str(tmp_path)) == 1000
    assert checkpoint_bytes(str(tmp_path / "absent")) == 0
