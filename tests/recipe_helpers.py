"""A recipe's command line in the test's own process: what ``recipes/<name>.py`` runs after the launcher
(``common.run_recipe``), without a process that spends about ten CPU-seconds importing torch, transformers and TRL
before its first line of output. The tests that check a real launch start real processes; these check what the
recipe prints and the exit code it ends with."""

from __future__ import annotations

import subprocess
import warnings
from collections.abc import Callable

import pytest


def run_in_process(
    capfd: pytest.CaptureFixture[str], prog: str, main: Callable[[], None]
) -> subprocess.CompletedProcess[str]:
    """Run ``main`` as ``common.run_recipe(prog, main)`` does in a recipe's process and return its exit code
    (0, or the ``SystemExit`` code) with what it wrote to stdout and stderr (file descriptors, as a process's
    output would be). The libraries' logging, warning filters and progress bars are restored afterwards."""
    from transformers.utils import logging as hf_logging

    from pulseloco.recipes import common

    bars_were_on, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    capfd.readouterr()
    code: int | str | None = 0
    try:
        with warnings.catch_warnings():
            common.run_recipe(prog, main)
    except SystemExit as exc:
        code = exc.code
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()
    captured = capfd.readouterr()
    return subprocess.CompletedProcess([prog], code, captured.out, captured.err)
