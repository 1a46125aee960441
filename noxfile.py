"""Test environments. verl and AReaL cannot share one, so each host gets its own session.

Every session installs the CPU build ``torch==2.13.0`` first: a bare ``torch``
requirement would pull a multi-GB CUDA build.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
TORCH = "torch==2.13.0"
MEGATRON = "megatron-core==0.16.1"


def install_megastart(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff, and mypy on the public API."""
    install_megastart(session, "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The core suite: plugin manager, settings, loader, warmup, demo (CPU, gloo)."""
    install_megastart(session, "test")
    session.install("-e", "tests/fixtures/toyplugin")
    session.run("pytest", *(session.posargs or ["tests", "-x", "-q"]))


VERL = "verl==0.9.1"


@nox.session(python=PYTHON)
def verl(session: nox.Session) -> None:
    """The verl adapter against the real verl (CPU, gloo, a local Ray cluster).

    verl without extras (each extra pins a CUDA torch), plus what its Megatron
    engine imports. megastart goes in as a wheel, not editable: Hydra 1.3 finds
    SearchPathPlugins by scanning the ``hydra_plugins`` namespace, which
    setuptools' editable finder hides.
    """
    session.install(TORCH)
    session.install(VERL, MEGATRON, "uvicorn", "fastapi", "mbridge", "einops")
    session.install(".[test,hydra]", "tests/fixtures/verl_probe")
    session.run("pytest", *(session.posargs or ["tests/hosts/verl", "-x", "-q"]))
