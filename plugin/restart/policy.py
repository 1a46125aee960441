"""Whether a restart skips its HF load: ``rank0_loader.skip_hf_load_on_resume`` (on by
default), and AReaL's deprecated ``areal.skip_hf_load_on_recover``; what a skip does not read."""

from __future__ import annotations

import logging
import os
import threading

from megastart.errors import SettingsError

log = logging.getLogger("megastart")

SETTING = "rank0_loader.skip_hf_load_on_resume"
VARIABLE = "MEGASTART_RANK0_LOADER_SKIP_HF_LOAD_ON_RESUME"
DEPRECATED = "areal.skip_hf_load_on_recover"
DEPRECATED_VARIABLE = "MEGASTART_AREAL_SKIP_HF_LOAD_ON_RECOVER"
WEIGHT_FILES = (".safetensors", ".bin", ".pt")

_warned = threading.Event()


def skip_wanted() -> bool:
    """Whether a load followed by a resume is deferred, in this process's settings.

    AReaL's ``skip_hf_load_on_recover`` (deprecated) given alone is honoured, with one
    warning; given with ``skip_hf_load_on_resume`` and disagreeing, both are refused.
    """
    from megastart.loader.settings import resolved
    from megastart.manager import get_settings

    settings = get_settings()
    wanted: bool = resolved().skip_hf_load_on_resume
    given = settings.sources.get(SETTING, "default") != "default"
    if settings.sources.get(DEPRECATED, "default") == "default":
        return wanted
    old: bool = settings.section("areal").skip_hf_load_on_recover
    if given and old != wanted:
        raise SettingsError(
            f"megastart: {SETTING}={wanted} ({VARIABLE}) and the deprecated {DEPRECATED}={old} "
            f"({DEPRECATED_VARIABLE}) disagree: set {SETTING} alone"
        )
    if not given and not _warned.is_set():
        _warned.set()
        log.warning(
            "megastart: %s (%s) is deprecated and goes in the next release: set %s (%s), "
            "on by default, instead",
            DEPRECATED,
            DEPRECATED_VARIABLE,
            SETTING,
            VARIABLE,
        )
    return old


def checkpoint_bytes(checkpoint: str) -> int:
    """The size of the weight files in ``checkpoint`` (what an HF load of it reads); 0 where it
    is not a local directory."""
    try:
        names = os.listdir(checkpoint)
    except OSError:
        return 0
    return sum(
        os.path.getsize(os.path.join(checkpoint, name))
        for name in names
        if name.endswith(WEIGHT_FILES)
    )
