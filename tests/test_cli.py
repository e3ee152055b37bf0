"""The ``pulseloco`` command, run the way a user runs it: as a subprocess, module and installed script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pulseloco
from pulseloco.cli import main

_CONSOLE_SCRIPT = Path(sys.executable).parent / "pulseloco"


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)


@pytest.mark.parametrize(
    "cmd",
    [[sys.executable, "-m", "pulseloco.cli"], [sys.executable, "-m", "pulseloco"], [str(_CONSOLE_SCRIPT)]],
    ids=["module-cli", "module", "console-script"],
)
def test_version_prints_package_version(cmd: list[str]) -> None:
    assert Path(cmd[0]).exists(), f"{cmd[0]} is missing: is pulseloco installed (pip install -e .)?"
    result = _run([*cmd, "version"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pulseloco {pulseloco.__version__}"


def test_unknown_command_is_a_usage_error() -> None:
    result = _run([str(_CONSOLE_SCRIPT), "no-such-command"])
    assert result.returncode == 2
    assert result.stdout == ""
    known = "dht, keygen, monitor, status, sync, version"
    assert f"error: unknown command 'no-such-command' (choose from: {known})" in result.stderr
    assert "Traceback" not in result.stderr


def test_main_returns_exit_codes_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out == f"pulseloco {pulseloco.__version__}\n"

    assert main(["--log-level", "INFO", "nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err

    assert main([]) == 2
    assert "a command is required" in capsys.readouterr().err

    assert main(["version", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err

    assert main(["--help"]) == 0
    assert "version" in capsys.readouterr().out
