"""Test environments. verl and AReaL cannot share one, so each host gets its own session.

Every session installs the CPU build ``torch==2.13.0`` first: a bare ``torch``
requirement would pull a multi-GB CUDA build.

Environments are made and filled by uv where it is installed (``pip install nox uv``; CI does),
else by virtualenv and pip: uv installs the same packages faster (CONTRIBUTING.md). uv does not
read pip's configuration, so pip_config_for_uv below hands it pip's indexes and find-links.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import nox

nox.options.sessions = ["lint", "tests", "megatron", "verl", "bridge", "verl07", "areal", "areal2"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "uv|virtualenv"

PYTHON = "3.11"
TORCH = "torch==2.13.0"
MEGATRON = "megatron-core==0.16.1"
DISCARD_ENVS = "NOX_DISCARD_ENVS"
"""Set to 1 (CI does) to remove each session's environment when the session ends,
pass or fail: together they take about 18 GB, more than a CI machine has had free.
Not ``MEGASTART_*``: megastart refuses variables of its prefix that it does not know."""


PIP_TO_UV = {
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", " "),
    "default-timeout": ("UV_HTTP_TIMEOUT", " "),
    "no-cache-dir": ("UV_NO_CACHE", " "),
}
"""pip's setting -> uv's variable and its list separator, for the settings this project's
machines use (the CPU torch is on a find-links folder, other wheels on extra indexes)."""


def pip_config_for_uv() -> dict[str, str]:
    """pip's configuration (files and PIP_* variables, as ``pip config list`` shows it) as
    uv's variables, so that uv installs from where and as pip would. Variables already set win."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    found: dict[str, str] = {}
    for line in sorted(listed.splitlines(), key=lambda line: line.startswith(":env:")):
        key, _, value = line.partition("=")
        uv = PIP_TO_UV.get(key.rpartition(".")[2])
        if uv:
            found[uv[0]] = uv[1].join(value.strip("'\"").split())
    # pip's rule: the best version across every index; and pip's bytecode at install: without
    # it a fresh environment's first rank pool compiles torch in every rank at once, and under
    # load overruns its 60 s start (tests/core/test_board.py)
    return {"UV_INDEX_STRATEGY": "unsafe-best-match", "UV_COMPILE_BYTECODE": "1", **found}


for _name, _value in pip_config_for_uv().items():
    os.environ.setdefault(_name, _value)


def pip_install(session: nox.Session, *args: str) -> None:
    """pip itself, for what uv cannot do: ``--ignore-requires-python`` (megatron-core 0.17+
    and Megatron-Bridge declare Python >= 3.12, and these sessions run 3.11)."""
    if session.venv_backend == "uv":
        session.install("pip")
    session.run_install("python", "-m", "pip", "install", "-q", *args)


def reinstall(session: nox.Session, *args: str) -> None:
    """``session.install`` of local projects as wheels; uv keeps an installed project's
    old build in a reused environment unless told to rebuild it."""
    local = ("megastart", *(f"megastart-{probe}-probe" for probe in ("verl", "areal")))
    rebuilt = [f"--reinstall-package={name}" for name in local]
    session.install(*(rebuilt if session.venv_backend == "uv" else ()), *args)


def uninstall(session: nox.Session, *packages: str) -> None:
    """Remove packages from the session's environment, with uv or pip as it was made."""
    tool = ("uv", "pip") if session.venv_backend == "uv" else ("python", "-m", "pip")
    session.run_install(*tool, "uninstall", *(() if tool[0] == "uv" else ("-y", "-q")), *packages)


def session(func: Callable[..., None]) -> Callable[..., None]:
    """``nox.session`` on PYTHON, whose environment goes when it ends if DISCARD_ENVS is 1."""

    @functools.wraps(func)
    def run(session: nox.Session, **params: str) -> None:
        try:
            func(session, **params)
        finally:
            if os.environ.get(DISCARD_ENVS) == "1":
                shutil.rmtree(session.virtualenv.location)

    return nox.session(python=PYTHON)(run)


def install_megastart(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)


@session
def lint(session: nox.Session) -> None:
    """ruff, and mypy on the public API."""
    install_megastart(session, "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


PRELOADED = ("-p", "support.preloaded")
"""The core suite's ranks fork from a server that imported torch and Megatron once
(tests/support/preloaded.py): it starts a fresh world per test module and per rank it kills."""


@session
def tests(session: nox.Session) -> None:
    """The core suite: plugin manager, settings, loader, warmup, demo (CPU, gloo); not the
    GPU suite (tests/gpu)."""
    install_megastart(session, "test")
    session.install("-e", "tests/fixtures/toyplugin")
    # tests/gpu needs a GPU and Transformer Engine: tests/gpu/run on the GPU machine
    ignored = ("--ignore=tests/hosts", "--ignore=tests/gpu")
    # the slowest tests, in CI's log: the suite takes most of CI's time
    selected = session.posargs or ["tests", *ignored, "-q", "--durations=25"]
    session.run("pytest", *PRELOADED, *selected)


MEGATRON_CORES = ("0.17.1", "0.18.2", "0.19.2")
"""The megatron-core releases after the ``tests`` session's 0.16.1 (which runs the whole
suite); keep in step with ``megastart.requirements.MEGATRON_CORE_TESTED`` and docs/compatibility.md."""
MEGATRON_SUBSET = (
    # one dense architecture at TP2 x PP2, one MoE at EP2: the parameter names the
    # loader maps come from megatron-core's layer specs
    "tests/loader/test_loader_logits.py::test_logits_match_transformers[qwen3-tp2_pp2-untied]",
    "tests/loader/test_loader_moe.py::test_logits_match_transformers[qwen3_moe-ep2]",
    # the warmup's group table: parallel_state getters and the pipeline P2P path
    "tests/warmup/test_warmup.py",
)


@session
def megatron(session: nox.Session) -> None:
    """The loader's logits and the warmup's group table on each megatron-core release in
    MEGATRON_CORES, one after the other in one environment (``posargs`` replace the tests).

    0.17 and later declare Python >= 3.12 and install on 3.11 (by pip) without their
    requirements, which go in before: numpy below 2.5, packaging, and triton, which they import.
    pip replaces one release by the next.
    """
    session.install(TORCH, "numpy<2.5", "packaging>=24.2", "triton")
    session.install(TORCH, "-e", ".", "pytest", "transformers")  # what the subset imports
    for core in MEGATRON_CORES:
        pip_install(session, "--ignore-requires-python", "--no-deps", f"megatron-core=={core}")
        session.run("pytest", *PRELOADED, *(session.posargs or [*MEGATRON_SUBSET, "-q"]))


MODELOPT_NEEDS = ("ninja", "nvidia-ml-py", "pulp", "scipy", "requests")
"""megatron-bridge imports nvidia-modelopt, which imports these."""

VERL = "verl==0.9.1"
VERL_BRIDGE = (
    # what `pip install "verl[megatron]==0.9.1"` gives on Python 3.12: the newest
    # megatron-core, megatron-bridge 0.5.2 and nvidia-modelopt 0.44.0. 0.5.2 is not
    # on the index; 0.5.1 is the nearest release, and needs megatron-core >= 0.18
    # (megatron.core._rank_utils.safe_get_world_size)
    *("megatron-core==0.19.2", "megatron-bridge==0.5.1", "nvidia-modelopt==0.44.0"),
)
VERL_BRIDGE_TESTS = ("tests/hosts/verl/test_verl_engine_cpu.py", "-k", "megatron_bridge")
BRIDGE_TESTS = ("tests/bridge",)
"""Megastart's load against Megatron-Bridge's own, in the same environment."""
BRIDGE_051_TESTS = ("tests/bridge/test_megatron_bridge_registry.py",)
"""Against Megatron-Bridge 0.5.1 (verl 0.9.1's branch): its registry and the built-in table
agree, and the architectures both releases register load bit-exact; the families 0.6.2 added
(hooks, Mamba, fused experts) run in the ``bridge`` session."""
MBRIDGE_TESTS = (
    "tests/libraries/test_library_adapters.py::test_mbridge_load_weights_is_megastarts_load_bit_for_bit",
)
"""The library adapters in the first environment: mbridge's, which only it has; the others
run there on megatron-core 0.16.1, as in the ``tests`` session, which runs them."""
LIBRARY_TESTS = ("tests/libraries",)
"""The library adapters in the second environment: Megatron-Bridge's, and megatron-core
0.19's schedules and ``megatron.training`` (about a minute)."""


@session
def verl(session: nox.Session) -> None:
    """The verl adapter against the real verl (CPU, gloo, a local Ray cluster), on both
    of verl 0.9's HF-load branches, one environment after the other, with the library
    adapters (mbridge's, Megatron-Bridge's, megatron-core's) attached beneath it; and the
    library adapters on their own: mbridge's in the first environment, ``tests/libraries``
    in the second.

    mbridge (``vanilla_mbridge: True``) first, on megatron-core 0.16.1: mbridge
    0.15.1 builds models with ``ModelType.encoder_and_decoder``, which megatron-core
    0.17 removed. Then verl's default, Megatron-Bridge, in the same environment with
    megatron-core 0.19.2 and megatron-bridge added (both declare Python >= 3.12 and
    go in without their CUDA requirements); ``posargs`` replace the first step's
    tests. verl without extras (each extra pins a CUDA torch), plus what its
    Megatron engine imports. megastart goes in as a wheel, not editable: Hydra 1.3
    finds SearchPathPlugins by scanning the ``hydra_plugins`` namespace, which
    setuptools' editable finder hides.
    """
    session.install(TORCH)
    # a reused environment still holds the second step's Megatron-Bridge, which the first
    # step's megatron-core 0.16.1 cannot import (its tests would run instead of skipping)
    uninstall(session, "megatron-bridge")
    session.install(VERL, MEGATRON, "uvicorn", "fastapi", "mbridge", "einops", *MODELOPT_NEEDS)
    reinstall(session, ".[test,hydra]", "tests/fixtures/verl_probe")
    session.run("pytest", *(session.posargs or ["tests/hosts/verl", "-x", "-q"]))
    session.run("pytest", *MBRIDGE_TESTS, "-x", "-q")
    pip_install(session, "--ignore-requires-python", "--no-deps", *VERL_BRIDGE)
    session.install(TORCH, "numpy<2.5", "triton")
    session.run("pytest", *VERL_BRIDGE_TESTS, "-x", "-q")
    session.run("pytest", *BRIDGE_051_TESTS, "-x", "-q")
    # apart: the bridge tests' rank pools keep the Transformer Engine stub they import,
    # which megatron-core's fp8_utils cannot import from in the library tests' ranks
    session.run("pytest", *LIBRARY_TESTS, "-x", "-q")


BRIDGE = ("megatron-core==0.19.2", "megatron-bridge==0.6.2", "nvidia-modelopt==0.44.0")
BRIDGE_TRANSFORMERS = "transformers==5.12.1"
"""The newest Megatron-Bridge's ``transformers`` ceiling (it declares 5.8 to 5.12.1): the
tiny checkpoints of Qwen3.5, Qwen3-Next and the vision-language models are written with it."""


@session
def bridge(session: nox.Session) -> None:
    """megastart's load against Megatron-Bridge 0.6.2's own (``tests/bridge``), on CPU.

    0.6.2 declares Python 3.12 (``>=3.12,<3.13``) and installs here on 3.11 like
    0.5.1 does in the ``verl`` session: ``--ignore-requires-python --no-deps``, with
    what it imports, so both releases are tested against the CPU build of torch
    (the index has torch for 3.12 only as the CUDA build: CONTRIBUTING.md says more).
    """
    session.install(TORCH)
    session.install(MEGATRON, "einops", BRIDGE_TRANSFORMERS, *MODELOPT_NEEDS)
    reinstall(session, ".[test]", "-e", "tests/fixtures/toyplugin")
    pip_install(session, "--ignore-requires-python", "--no-deps", *BRIDGE)
    session.install(TORCH, "numpy<2.5", "triton", BRIDGE_TRANSFORMERS)
    session.run("pytest", *(session.posargs or [*BRIDGE_TESTS, "-x", "-q"]))


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


@session
def verl07(session: nox.Session) -> None:
    """Both verl adapters against the real verl 0.7.1 (CPU, gloo): the legacy
    Megatron workers and verl 0.7's engine. Installed like the ``verl`` session."""
    session.install(TORCH)
    session.install(VERL07, MEGATRON, "uvicorn", "fastapi", "mbridge", "einops", *VERL07_NEEDS)
    reinstall(session, ".[test,hydra]", "tests/fixtures/verl_probe", *VERL07_NEEDS)
    session.run("pytest", *(session.posargs or [*VERL07_TESTS, "-x", "-q"]))


AREAL = "areal==1.0.4"
AREAL_NEEDS = (
    # what AReaL 1.0.4's trainer, engine and config modules import (its own
    # requirements pin a CUDA torch<2.11, so it is installed with --no-deps)
    *("aiohttp", "httpx", "colorlog", "tenacity", "flask", "torchdata", "lark", "uvloop"),
    *("pyyaml", "hydra-core", "transformers==5.3.0", "ray", "numba", "pillow", "orjson"),
    *("einops", "aiofiles", "openai", "peft<=0.18.1", "mbridge", "datasets", "pybase64"),
    *("swanlab", "wandb", "tensorboardX", "tabulate", "trackio", "triton", "numpy<2.5"),
    *MODELOPT_NEEDS,
)


@session
def areal(session: nox.Session) -> None:
    """The AReaL adapter against the real AReaL 1.0.4 (CPU, gloo).

    megatron-core 0.17 and megatron-bridge 0.4 declare Python >= 3.12 and install
    on 3.11 without their CUDA requirements; Transformer Engine has no CPU build,
    so the tests put a stub on ``sys.path`` (tests/support/stubs). megastart
    goes in as a wheel so that Hydra 1.3 finds its SearchPathPlugin.
    """
    install_areal(session, AREAL)
    session.run("pytest", *(session.posargs or ["tests/hosts/areal", "-x", "-q"]))


AREAL2_WHEEL = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "shared",
    "hosts",
    "areal-2.0.0-py3-none-any.whl",
)
"""AReaL 2.0.0, released as a git tag only: a wheel built unchanged from it (../shared/hosts/README.md)."""
AREAL2_TESTS = (
    # what 2.0.0 changed under the adapter: the restart (its recover load waits for async
    # saves first), the hooks' order, the critic; activation is the same code as 1.0.4's
    *("tests/hosts/areal/test_areal_skip_hf_load.py", "tests/hosts/areal/test_areal_recover.py"),
    "tests/hosts/areal/test_areal_critic.py",
)


@session
def areal2(session: nox.Session) -> None:
    """The AReaL adapter against the real AReaL 2.0.0 (CPU, gloo), installed as the ``areal``
    session installs 1.0.4, from the wheel in ../shared/hosts (skipped where it is absent)."""
    if not os.path.exists(AREAL2_WHEEL):
        session.skip(f"AReaL 2.0.0's wheel is not at {os.path.normpath(AREAL2_WHEEL)}")
    install_areal(session, AREAL2_WHEEL)
    session.run("pytest", *(session.posargs or [*AREAL2_TESTS, "-x", "-q"]))


def install_areal(session: nox.Session, areal: str) -> None:
    """AReaL ``--no-deps`` (it pins a CUDA torch below 2.11) beside torch 2.13.0 and the pins
    both 1.0.4 and 2.0.0 declare (megatron-core 0.17.0, megatron-bridge 0.4.0, mbridge 0.15.1,
    transformers 5.3.0)."""
    session.install(TORCH)
    session.install("--no-deps", areal)
    session.install(TORCH, *AREAL_NEEDS)
    reinstall(session, TORCH, "transformers==5.3.0", "numpy<2.5", ".[test]")
    reinstall(session, "tests/fixtures/areal_probe")
    # last: a later install naming megatron-core (megastart's test extra does) makes uv put
    # back the newest release that declares Python 3.11 (0.16.1) over pip's 0.17.0
    pip_install(
        session,
        "--ignore-requires-python",
        "--no-deps",
        "megatron-core==0.17.0",
        "megatron-bridge==0.4.0",
        "nvidia-modelopt",
    )
