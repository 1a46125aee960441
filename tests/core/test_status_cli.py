"""``megastart status`` tells a user what is installed, blocked and set."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
from support.pyrun import run_python

from megastart.requirements import MEGATRON_CORE_TESTED

STATUS = "import sys; from megastart.cli import main; sys.exit(main(sys.argv[1:] or {argv!r}))"


def status(*argv: str, **env: str):
    return run_python(STATUS.format(argv=list(argv)), env=env)


def test_status_json_has_the_documented_keys():
    out = json.loads(status("status", "--json").stdout)
    assert {"version", "enabled", "plugins", "engines", "activation", "settings"} <= set(out)
    loader = next(p for p in out["plugins"] if p["name"] == "rank0_loader")
    assert loader["distribution"] == "megastart" and loader["hooks"] == ["on_model_load"]
    assert loader["blocked"] is False and loader["version"] == out["version"]
    toy = next(e for e in out["engines"] if e["name"] == "megastart_toyhost.future")
    assert toy == {
        "name": "megastart_toyhost.future",
        "host": "toyhost",
        "supported": "megastart-toyplugin>=99",
        "installed_version": "1.0.0",
        "compatible": False,
        "reason": "requested megastart-toyplugin>=99 but found megastart-toyplugin 1.0.0",
        "layer": "host",
        "serves": [],
        "would_attach": False,
    }


@pytest.mark.parametrize("setting", ["1", "0"])
def test_status_shows_which_library_adapters_would_attach_and_for_which_hosts(setting: str):
    out = json.loads(status("status", "--json", MEGASTART_LIBRARY_ADAPTERS=setting).stdout)
    library = {e["name"]: e for e in out["engines"] if e["layer"] == "library"}
    schedules = library["megatron.core.pipeline_parallel.schedules"]
    assert schedules["host"] == "megatron-core" and "NeMo-RL" in schedules["serves"]
    assert schedules["installed_version"] == metadata.version("megatron-core")
    assert schedules["would_attach"] is (setting == "1")
    assert "megatron.bridge.models.conversion.model_bridge" in library
    assert "mbridge.core.bridge" in library
    # reached through whichever host imports the library: no activation row of their own
    assert not {e["host"] for e in library.values()} & set(out["activation"]["hosts"])
    text = status("status", MEGASTART_LIBRARY_ADAPTERS=setting).stdout
    shown = "library_adapters=on" if setting == "1" else "library_adapters=OFF"
    assert shown in text and "for: NeMo-RL" in text


def test_status_json_shows_blocked_plugins_and_setting_sources():
    out = json.loads(
        status(
            "status",
            "--json",
            MEGASTART_BLOCKLIST="comm_warmup",
            MEGASTART_RANK0_LOADER_BUCKET_MB="64",
        ).stdout
    )
    warmup = next(p for p in out["plugins"] if p["name"] == "comm_warmup")
    assert warmup["blocked"] is True and warmup["hooks"] == []
    assert out["settings"]["rank0_loader"]["bucket_mb"] == {
        "value": 64,
        "source": "env:MEGASTART_RANK0_LOADER_BUCKET_MB",
    }
    assert out["settings"]["blocklist"] == {
        "value": ["comm_warmup"],
        "source": "env:MEGASTART_BLOCKLIST",
    }


def test_status_text_at_a_glance():
    text = status("status", MEGASTART_DISABLE="1").stdout
    assert "DISABLED" in text and "rank0_loader" in text and "<- env:MEGASTART_DISABLE" in text


def test_help_says_how_to_switch_it_on_and_off():
    text = status("--help").stdout
    for line in (
        "AUTOWRAPT_BOOTSTRAP=megastart.bootstrap",
        "+megastart=off",
        "+megastart=on megastart.blocklist=[comm_warmup]",
        "MEGASTART_DISABLE=1",
        "MEGASTART_BLOCKLIST=comm_warmup",
    ):
        assert line in text


def test_status_shows_the_route_of_each_installed_host_and_the_shell_variable():
    # the toy host (megastart-toyplugin) has no plugin group of its own
    unset = json.loads(status("status", "--json", AUTOWRAPT_BOOTSTRAP="").stdout)["activation"]
    assert unset["value"] is None and not unset["names_megastart"]
    assert unset["hosts"]["toyhost"] == {
        "version": "1.0.0",
        "route": "AUTOWRAPT_BOOTSTRAP=megastart.bootstrap in the workers' environment",
    }
    assert unset["unhooked_adapters"] == []
    text = status("status", AUTOWRAPT_BOOTSTRAP="other.patches,megastart.bootstrap").stdout
    assert (
        "activation (AUTOWRAPT_BOOTSTRAP in this shell: 'other.patches,megastart.bootstrap': "
        "megastart activates in this shell's processes)" in text
    )


@pytest.mark.parametrize("version", ["0.15.3", "0.20.0"])
def test_status_warns_for_a_megatron_core_outside_the_tested_range(tmp_path, version):
    # a distribution's metadata ahead of the installed one on the path, as pip writes it
    dist_info = tmp_path / f"megatron_core-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n"
    )
    text = status("status", PYTHONPATH=str(tmp_path)).stdout
    assert f"megatron-core: installed {version}; tested {MEGATRON_CORE_TESTED}" in text
    assert (
        f"WARNING: megatron-core {version} is outside the tested range ({MEGATRON_CORE_TESTED})"
    ) in text


def test_status_does_not_warn_for_the_tested_megatron_core():
    out = json.loads(status("status", "--json").stdout)
    assert out["megatron_core"] == {
        "tested": MEGATRON_CORE_TESTED,
        "installed_version": metadata.version("megatron-core"),
        "warning": None,
    }


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ("status",),
            {"MEGASTART_RANK0_LOADER_BUCKET_MB": "abc"},
            "megastart status: MEGASTART_RANK0_LOADER_BUCKET_MB='abc': expected float, got 'abc'",
        ),
        (
            ("bench", "loader", "--checkpoint", "/nonexistent"),
            {},
            "megastart bench: checkpoint directory '/nonexistent' does not exist",
        ),
    ],
)
def test_an_error_is_its_message_and_exit_status_2_without_a_traceback(
    argv: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    proc = run_python(STATUS.format(argv=list(argv)), env=env, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr
    debug = run_python(STATUS.format(argv=["--debug", *argv]), env=env, check=False)
    assert "Traceback" in debug.stderr and debug.returncode == 1


def test_version_names_the_installed_distribution() -> None:
    assert status("--version").stdout == f"megastart {metadata.version('megastart')}\n"


def test_status_says_a_host_that_is_not_installed_is_not_installed_and_keeps_its_columns():
    text = status("status", MEGASTART_AREAL_SKIP_HF_LOAD_ON_RECOVER="1").stdout
    areal = text.split("areal.engine.megatron_engine\n", 1)[1].splitlines()[0]
    assert areal.endswith("not installed here (nothing to attach to)")
    assert "NOT compatible" not in areal
    rows = text.split("settings (value  <- source):\n", 1)[1].splitlines()
    assert len({row.index("<- ") for row in rows}) == 1, rows
    assert any(row.split()[0] == "areal.skip_hf_load_on_recover" for row in rows)


@pytest.mark.parametrize(
    "argv",
    [
        ("--help",),
        ("status", "--help"),
        ("demo", "--help"),
        ("bench", "--help"),
        ("bench", "loader", "--help"),
        ("bench", "warmup", "--help"),
    ],
)
def test_help_is_written_for_users_without_markup(argv: tuple[str, ...]) -> None:
    text = status(*argv).stdout
    assert text.startswith("usage: megastart")
    assert "``" not in text and ":data:" not in text and ":func:" not in text, text


def test_status_into_a_pipe_its_reader_closed_ends_quietly():
    """``megastart status | head -1``: no traceback when the reader has closed the pipe."""
    import subprocess
    import sys

    command = STATUS.format(argv=["status"]).replace("sys.argv[1:] or ", "")
    with subprocess.Popen(
        [sys.executable, "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # before megastart writes a byte
        errors = process.stderr.read()
        code = process.wait(timeout=60)
    assert "BrokenPipeError" not in errors and "Traceback" not in errors, errors
    assert code == 0


def test_status_says_the_last_restart_skipped_the_hf_load_and_the_bytes_not_read(tmp_path):
    from dataclasses import asdict

    from megastart.restart import SkippedLoad
    from megastart.restart.report import STATUS_FILE

    skip = SkippedLoad(
        host="areal",
        checkpoint="/ckpt/hf",
        resume="/ckpt/recover",
        bytes_not_read=123456789,
        parameters=42,
    )
    (tmp_path / STATUS_FILE).write_text(json.dumps(asdict(skip)))
    text = status("status", TMPDIR=str(tmp_path)).stdout
    assert "HF load of /ckpt/hf skipped, 123,456,789 bytes not read" in text
    assert json.loads(status("status", "--json", TMPDIR=str(tmp_path)).stdout)[
        "last_restart"
    ] == asdict(skip)
    (tmp_path / "none").mkdir()
    assert "(no HF load skipped)" in status("status", TMPDIR=str(tmp_path / "none")).stdout
