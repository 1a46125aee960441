"""The base of every engine adapter: version check, attribute check, attach/detach.

Modelled on OpenTelemetry's ``BaseInstrumentor``: the public ``attach`` and
``detach`` are idempotent guards around the adapter's own ``_attach`` and
``_detach``, which mirror each other line by line.
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

log = logging.getLogger("megastart")


class IncompatibleHost(RuntimeError):
    """The installed host is not one this adapter can attach to."""


@dataclass(frozen=True, slots=True)
class Compatibility:
    installed_version: str | None
    compatible: bool
    reason: str


def check_requirement(requirement: str) -> Compatibility:
    """Whether the installed distribution meets ``requirement`` (reads metadata only)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    req = Requirement(requirement)
    try:
        installed = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return Compatibility(None, False, f"{req.name} is not installed")
    try:
        ok = req.specifier.contains(Version(installed), prereleases=True)
    except InvalidVersion:
        ok = False
    reason = "" if ok else f"requested {requirement} but found {req.name} {installed}"
    return Compatibility(installed, ok, reason)


class EngineAdapter(ABC):
    """Attaches megastart's hooks to one host module without editing the host."""

    host: ClassVar[str]
    """Short host name used in ``EngineContext.host`` (``"verl"``)."""

    module: ClassVar[str]
    """The host module this adapter attaches to; its entry-point name."""

    requirement: ClassVar[str]
    """The supported host versions, as a requirement (``"verl>=0.8,<0.10"``)."""

    wraps: ClassVar[Mapping[str, tuple[str, ...]]]
    """``"Class.method"`` -> parameter names the wrapper relies on."""

    def __init__(self) -> None:
        self._attached_to: ModuleType | None = None

    @property
    def attached(self) -> bool:
        return self._attached_to is not None

    def compatibility(self) -> Compatibility:
        """Whether the installed host version is supported (reads metadata only)."""
        return check_requirement(self.requirement)

    def missing_attributes(self, module: ModuleType) -> list[str]:
        """The wrapped attributes (or their parameters) the host module lacks."""
        missing = []
        for dotted, params in self.wraps.items():
            obj: object = module
            for part in dotted.split("."):
                obj = getattr(obj, part, _MISSING)
                if obj is _MISSING:
                    break
            if obj is _MISSING:
                missing.append(f"{self.module}.{dotted}")
                continue
            have = inspect.signature(obj).parameters  # type: ignore[arg-type]
            lacking = [p for p in params if p not in have]
            if lacking:
                missing.append(f"{self.module}.{dotted}({', '.join(lacking)})")
        return missing

    def attach(self, module: ModuleType) -> bool:
        """Wrap the host module; warn once and wrap nothing if it does not fit."""
        if self.attached:
            return True
        compat = self.compatibility()
        if not compat.compatible:
            log.warning("megastart: not attaching to %s: %s", self.module, compat.reason)
            return False
        missing = self.missing_attributes(module)
        if missing:
            log.warning(
                "megastart: not attaching to %s (%s %s): missing %s",
                self.module,
                self.host,
                compat.installed_version,
                ", ".join(missing),
            )
            return False
        self._attach(module)
        self._attached_to = module
        log.debug("megastart: attached to %s %s", self.host, compat.installed_version)
        return True

    def detach(self) -> None:
        """Restore the host's originals; a no-op when not attached."""
        if self._attached_to is None:
            return
        self._detach(self._attached_to)
        self._attached_to = None

    @abstractmethod
    def _attach(self, module: ModuleType) -> None:
        """Wrap the host's methods (``wrapt.wrap_function_wrapper``)."""

    @abstractmethod
    def _detach(self, module: ModuleType) -> None:
        """Unwrap them, in the same order as ``_attach``."""


_MISSING = object()


def unwrap(owner: object, attribute: str) -> None:
    """Undo ``wrapt.wrap_function_wrapper(owner, attribute, ...)``.

    The pair of OpenTelemetry's ``unwrap``; works with wrapt 1.x and 2.x alike.
    """
    current = (
        vars(owner).get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
    )
    if current is not None and hasattr(current, "__wrapped__"):
        setattr(owner, attribute, current.__wrapped__)
