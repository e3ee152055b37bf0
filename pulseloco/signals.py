"""Signal handling for long-running processes: a recipe's or a command's loop ends cleanly on SIGINT or SIGTERM."""

from __future__ import annotations

import signal
import threading

__all__ = ["stop_on_signals"]


def stop_on_signals() -> threading.Event:
    """An event set on SIGINT or SIGTERM, for a long-running loop to end cleanly.

    It replaces the handlers of both signals for the rest of the process. Call it from the main thread: Python
    installs signal handlers only there, and ``signal.signal`` raises ``ValueError`` from any other thread."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop
