"""Test environments. verl and AReaL cannot share one, so each host gets its own session.

Every session installs the CPU build ``torch==2.13.0`` first: a bare ``torch``
requirement would pull a multi-GB CUDA build.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests", "verl", "verl07", "areal"]
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
    session.run("pytest", *(session.posargs or ["tests", "--ignore=tests/hosts", "-q"]))


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


VERL07 = "verl==0.7.1"
VERL07_NEEDS = (
    # verl 0.7's verl/utils/model.py imports AutoModelForVision2Seq, gone in
    # transformers 5; verl 0.7 pins numpy<2, which pyarrow 21+ refuses.
    *("transformers<5", "pyarrow<21"),
)
VERL07_TESTS = (
    "tests/hosts/verl/test_verl_activation.py",
    "tests/hosts/verl/test_verl_legacy_adapter.py",
    "tests/hosts/verl/test_verl_legacy_workers_cpu.py",
    # the engine adapter on verl 0.7's engine (trainer.use_legacy_worker_impl=disable);
    # the config and Ray tests compose 0.8+'s `model_engine=megatron`, which 0.7 lacks
    "tests/hosts/verl/test_verl_adapter.py",
    "tests/hosts/verl/test_verl_engine_cpu.py",
)


@nox.session(python=PYTHON)
def verl07(session: nox.Session) -> None:
    """Both verl adapters against the real verl 0.7.1 (CPU, gloo): the legacy
    Megatron workers and verl 0.7's engine. Installed like the ``verl`` session."""
    session.install(TORCH)
    session.install(VERL07, MEGATRON, "uvicorn", "fastapi", "mbridge", "einops", *VERL07_NEEDS)
    session.install(".[test,hydra]", "tests/fixtures/verl_probe", *VERL07_NEEDS)
    session.run("pytest", *(session.posargs or [*VERL07_TESTS, "-x", "-q"]))


AREAL = "areal==1.0.4"
AREAL_NEEDS = (
    # what AReaL 1.0.4's trainer, engine and config modules import (its own
    # requirements pin a CUDA torch<2.11, so it is installed with --no-deps)
    *("aiohttp", "httpx", "colorlog", "tenacity", "flask", "torchdata", "lark", "uvloop"),
    *("pyyaml", "hydra-core", "transformers==5.3.0", "ray", "numba", "pillow", "orjson"),
    *("einops", "aiofiles", "openai", "peft<=0.18.1", "mbridge", "datasets", "pybase64"),
    *("swanlab", "wandb", "tensorboardX", "tabulate", "trackio", "triton", "numpy<2.5"),
    # megatron-bridge imports nvidia-modelopt, which imports these
    *("ninja", "nvidia-ml-py", "pulp", "scipy"),
)


@nox.session(python=PYTHON)
def areal(session: nox.Session) -> None:
    """The AReaL adapter against the real AReaL 1.0.4 (CPU, gloo).

    megatron-core 0.17 and megatron-bridge 0.4 declare Python >= 3.12 and install
    on 3.11 without their CUDA requirements; Transformer Engine has no CPU build,
    so the tests put a stub on ``sys.path`` (tests/hosts/areal/stubs). megastart
    goes in as a wheel so that Hydra 1.3 finds its SearchPathPlugin.
    """
    session.install(TORCH)
    session.install("--no-deps", AREAL)
    session.install(TORCH, *AREAL_NEEDS)
    session.install(
        "--ignore-requires-python",
        "--no-deps",
        "megatron-core==0.17.0",
        "megatron-bridge==0.4.0",
        "nvidia-modelopt",
    )
    session.install(TORCH, "transformers==5.3.0", "numpy<2.5", ".[test]")
    session.install("tests/fixtures/areal_probe")
    session.run("pytest", *(session.posargs or ["tests/hosts/areal", "-x", "-q"]))
