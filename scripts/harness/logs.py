"""Progress lines on stderr, so that a script's stdout holds only its tables.

    log = progress("bench_sync")
    log("case 1 done")                      # [bench_sync 12:34:56] case 1 done

Never raises for an unwritable stderr beyond what ``print`` raises.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def progress(name: str) -> Callable[[str], None]:
    """A function that prints ``[name HH:MM:SS] message`` to stderr and flushes it."""

    def log(message: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return log
