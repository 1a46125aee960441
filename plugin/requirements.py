"""What megastart needs of the distributions it runs beside, and how to check it (metadata only).

Each engine adapter declares its host's range as its own constant; the megatron-core
range is here, beside the check, because the loader's parameter names and the warmup's
group table both follow megatron-core's API.
"""

from __future__ import annotations

from dataclasses import dataclass

MEGATRON_CORE_TESTED = "megatron-core>=0.16.1,<0.20"
"""The megatron-core releases CI runs megastart on: 0.16.1 (the ``tests`` nox session),
0.17.1, 0.18.2 and 0.19.2 (``megatron``). The loader's parameter names and the
warmup's group table come from megatron-core's layer specs and ``parallel_state``
getters, which change between releases; keep this, the noxfile and docs/compatibility.md's
table in step."""


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
