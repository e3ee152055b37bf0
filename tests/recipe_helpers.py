"""A recipe's command line in the test's own process: what ``recipes/<name>.py`` runs after the launcher
(``common.run_recipe``), without a process that spends about ten CPU-seconds importing torch, transformers and TRL
before its first line of output. The tests that check a real launch start real processes; these check what the
recipe prints and the exit code it ends with."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest


def run_in_process(
    capfd: pytest.CaptureFixture[str], prog: str, main: Callable[[], None]
) -> subprocess.CompletedProcess[str]:
    """Run ``main`` as ``common.run_recipe(prog, main)`` does in a recipe's process and return its exit code
    (0, or the ``SystemExit`` code) with what it wrote to stdout and stderr (file descriptors, as a process's
    output would be). The libraries' logging, warning filters, progress bars and the SIGINT and SIGTERM handlers
    (which a long-running command replaces: ``pulseloco.signals.stop_on_signals``) are restored afterwards."""
    _point_library_handlers_at_stderr()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
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
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    _point_library_handlers_at_stderr()
    captured = capfd.readouterr()
    return subprocess.CompletedProcess([prog], code, captured.out, captured.err)


def _point_library_handlers_at_stderr() -> None:
    """Point the libraries' own stderr handlers at file descriptor 2 (``sys.__stderr__``).

    transformers, datasets and hivemind each make a ``StreamHandler`` on whatever ``sys.stderr`` is when they are
    first imported, and transformers also binds the handler's ``flush`` to that stream's. Imported during a test
    that captures with ``capfd``, they keep that test's capture file, which pytest closes when the test ends; the
    next in-process run that logs then prints "--- Logging error --- ValueError: I/O operation on closed file".
    File descriptor 2 outlives every test (pytest points it at the current capture), so the handlers write where a
    process's stderr would go, in this test and in later ones."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if type(handler) is logging.StreamHandler and handler.stream is not sys.__stderr__:
                with handler.lock or contextlib.nullcontext():
                    vars(handler).pop("flush", None)  # the class's flush: flushes handler.stream
                    handler.stream = sys.__stderr__  # not setStream, which would flush the closed stream first
