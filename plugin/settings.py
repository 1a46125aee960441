"""One typed settings object, resolved from defaults < config < environment.

Each plugin declares its own section: a dataclass stored as the attribute
``megastart_settings`` of the object its entry point names; the section's name
is the plugin's name. The core section (``enabled``, ``blocklist``, ``trace``)
lives at the top level.

Environment variables cross process boundaries (Ray ``runtime_env``, AReaL's
per-worker ``env_vars``), so every setting has one:
``MEGASTART_<SECTION>_<FIELD>`` (``MEGASTART_RANK0_LOADER_BUCKET_MB=256``), and
for the core section ``MEGASTART_ENABLED``, ``MEGASTART_DISABLE=1``,
``MEGASTART_BLOCKLIST=a,b``, ``MEGASTART_TRACE=1`` and ``MEGASTART_LIBRARY_ADAPTERS=0``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

from megastart.errors import SettingsError

__all__ = ["SettingsError"]  # and the names below

ENV_PREFIX = "MEGASTART_"

Source = str
"""Where a value came from: ``"default"``, ``"config"`` or ``"env:NAME"``."""


@dataclass(kw_only=True, slots=True)
class CoreSettings:
    """Settings of megastart itself (the top level of the ``megastart:`` section)."""

    enabled: bool = True
    """False turns every plugin off: no adapter attaches, no hook runs."""

    blocklist: tuple[str, ...] = ()
    """Plugins (entry-point names) that are never imported in this run."""

    trace: bool = False
    """Log every hook implementation call on every rank, not only a summary on rank 0."""

    library_adapters: bool = True
    """False keeps the adapters of Megatron-Bridge, mbridge and megatron-core (which serve
    any host that loads and trains through them) detached; the host adapters (verl, AReaL,
    slime, ROLL) still attach."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The resolved settings of one process."""

    core: CoreSettings
    sections: Mapping[str, Any] = field(default_factory=dict)
    """Plugin name -> that plugin's resolved settings dataclass."""
    sources: Mapping[str, Source] = field(default_factory=dict)
    """``"field"`` or ``"section.field"`` -> where its value came from."""

    @property
    def enabled(self) -> bool:
        return self.core.enabled

    @property
    def blocklist(self) -> tuple[str, ...]:
        return self.core.blocklist

    def section(self, name: str) -> Any:
        """The settings of plugin ``name``; ``KeyError`` lists the known sections."""
        try:
            return self.sections[name]
        except KeyError:
            raise KeyError(
                f"no settings section {name!r}; known sections: {sorted(self.sections)}"
            ) from None

    def as_dict(self) -> dict[str, Any]:
        """Every value with its source, for ``megastart status``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self.core):
            out[f.name] = {
                "value": _plain(getattr(self.core, f.name)),
                "source": self.sources[f.name],
            }
        for name, section in self.sections.items():
            out[name] = {
                f.name: {
                    "value": _plain(getattr(section, f.name)),
                    "source": self.sources[f"{name}.{f.name}"],
                }
                for f in dataclasses.fields(section)
            }
        return out


def resolve(
    config: Any = None,
    *,
    environ: Mapping[str, str] | None = None,
    sections: Mapping[str, type] | None = None,
    ignored_sections: Collection[str] = (),
) -> Settings:
    """Resolve every setting from defaults < ``config`` < ``environ``.

    :param config: the ``megastart:`` section of a host config: a mapping or an
        OmegaConf node, or ``None``.
    :param environ: environment variables (default ``os.environ``).
    :param sections: plugin name -> its settings dataclass.
    :param ignored_sections: names whose keys are accepted but not read (plugins
        that exist but are blocked, so their section class was never imported).
    :raises SettingsError: an unknown key or variable (the message lists the
        valid ones) or a value that does not parse.
    """
    environ = os.environ if environ is None else environ
    sections = dict(sections or {})
    config = to_plain_mapping(config)
    env = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    sources: dict[str, Source] = {}

    core_config = {k: v for k, v in config.items() if not isinstance(v, Mapping)}
    section_configs = {k: v for k, v in config.items() if isinstance(v, Mapping)}
    unknown = set(section_configs) - set(sections) - set(ignored_sections)
    if unknown:
        raise SettingsError(
            f"unknown megastart setting section(s) {sorted(unknown)}; valid sections: "
            f"{sorted(sections)}; valid top-level keys: {_field_names(CoreSettings)}"
        )

    core_env = _core_env(env)
    core = _build(CoreSettings, "", core_config, core_env, sources)

    section_env_names: dict[str, str] = {}
    resolved_sections = {}
    for name, cls in sections.items():
        prefix = f"{ENV_PREFIX}{name.upper()}_"
        section_env = {}
        for var, value in env.items():
            if var.startswith(prefix):
                section_env[var[len(prefix) :].lower()] = (var, value)
                section_env_names[var] = name
        resolved_sections[name] = _build(
            cls, f"{name}.", dict(section_configs.get(name, {})), section_env, sources
        )

    ignored_prefixes = tuple(f"{ENV_PREFIX}{n.upper()}_" for n in ignored_sections)
    stray = [
        var
        for var in env
        if var not in section_env_names
        and var not in _CORE_ENV
        and not var.startswith(ignored_prefixes)
    ]
    if stray:
        valid = sorted(_CORE_ENV) + [
            f"{ENV_PREFIX}{name.upper()}_{f.upper()}"
            for name, cls in sections.items()
            for f in _field_names(cls)
        ]
        raise SettingsError(f"unknown environment variable(s) {sorted(stray)}; valid: {valid}")
    return Settings(core=core, sections=resolved_sections, sources=sources)


def to_plain_mapping(config: Any) -> dict[str, Any]:
    """A plain dict from ``None``, a mapping, or an OmegaConf node (resolved)."""
    if config is None:
        return {}
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(config, omegaconf.DictConfig):
        config = omegaconf.OmegaConf.to_container(config, resolve=True)
    if not isinstance(config, Mapping):
        raise SettingsError(
            f"the megastart config section must be a mapping, got {type(config).__name__}: {config!r}"
        )
    return dict(config)


_CORE_ENV = {
    "MEGASTART_ENABLED": "enabled",
    "MEGASTART_DISABLE": "enabled",
    "MEGASTART_BLOCKLIST": "blocklist",
    "MEGASTART_TRACE": "trace",
    "MEGASTART_LIBRARY_ADAPTERS": "library_adapters",
}


def _core_env(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for var, key in _CORE_ENV.items():
        if var not in env:
            continue
        value = env[var]
        if var == "MEGASTART_DISABLE":
            value = "false" if _parse_bool(var, value) else "true"
        out[key] = (var, value)
    return out


def _build(
    cls: type,
    prefix: str,
    config: dict[str, Any],
    env: Mapping[str, tuple[str, str]],
    sources: dict[str, Source],
) -> Any:
    hints = get_type_hints(cls)
    names = _field_names(cls)
    unknown_config = sorted(set(config) - set(names))
    if unknown_config:
        where = f"section {prefix[:-1]!r}" if prefix else "the top level"
        raise SettingsError(
            f"unknown megastart setting(s) {unknown_config} in {where}; valid keys: {names}"
        )
    unknown_env = sorted(var for key, (var, _) in env.items() if key not in names)
    if unknown_env:
        env_prefix = ENV_PREFIX + prefix.upper().replace(".", "_")
        valid = [f"{env_prefix}{n.upper()}" for n in names]
        raise SettingsError(f"unknown environment variable(s) {unknown_env}; valid: {valid}")
    values: dict[str, Any] = {}
    for name in names:
        key = f"{prefix}{name}"
        if name in env:
            var, raw = env[name]
            values[name] = _parse(f"{var}={raw!r}", hints[name], raw, from_env=True)
            sources[key] = f"env:{var}"
        elif name in config:
            values[name] = _parse(f"megastart.{key}", hints[name], config[name], from_env=False)
            sources[key] = "config"
        else:
            sources[key] = "default"
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"invalid megastart settings {prefix[:-1] or 'core'}: {e}") from e


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(where: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingsError(
        f"{where}: expected a boolean (one of {sorted(_TRUE | _FALSE)}), got {raw!r}"
    )


def _parse(where: str, hint: Any, raw: Any, *, from_env: bool) -> Any:
    """Convert ``raw`` (a string from the environment, or a config value) to ``hint``."""
    origin = get_origin(hint)
    args = get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if raw is None or (from_env and str(raw).strip().lower() in ("", "none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _parse(where, inner[0], raw, from_env=from_env)
    if hint is bool:
        return _parse_bool(where, raw)
    if origin is Literal:
        value = raw.strip() if isinstance(raw, str) else raw
        if value not in args:
            raise SettingsError(f"{where}: expected one of {list(args)}, got {raw!r}")
        return value
    if origin is tuple:
        if isinstance(raw, str):
            items = [item.strip() for item in raw.split(",") if item.strip()]
        elif isinstance(raw, (list, tuple)):
            items = list(raw)
        else:
            raise SettingsError(
                f"{where}: expected a list or a comma-separated string, got {raw!r}"
            )
        return tuple(_parse(where, args[0], item, from_env=from_env) for item in items)
    if hint in (int, float, str):
        if hint is not str and isinstance(raw, bool):
            raise SettingsError(f"{where}: expected {hint.__name__}, got {raw!r}")
        try:
            value = hint(raw.strip() if isinstance(raw, str) else raw)
        except (TypeError, ValueError):
            raise SettingsError(f"{where}: expected {hint.__name__}, got {raw!r}") from None
        if hint is float and not math.isfinite(value):
            raise SettingsError(f"{where}: expected a finite number, got {raw!r}")
        return value
    raise SettingsError(f"{where}: megastart cannot parse settings of type {hint!r}")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
