"""Handing freed memory back to the operating system between outer rounds.

A round allocates and frees buffers of the model's size (pseudo-gradients, encoded frames, received parts, sums)
from several threads. glibc's allocator keeps what such buffers freed in its heaps and per-thread arenas (its
mmap threshold rises to 32 MiB after the first large free, so later buffers below it come from the heaps), and a
peer's resident memory then grows round after round well past what it holds (docs/results.md, "Memory": a DiLoCo
peer of the wide demo model). :func:`release_freed_memory` returns those pages (what that costs: the same section).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["release_freed_memory"]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, looked up once, or None (another C library, another system): where ``malloc_trim`` exists."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            libc.malloc_trim.restype = ctypes.c_int
            return libc
    return None


def release_freed_memory() -> bool:
    """Return the heap pages the allocator holds free to the operating system (glibc's ``malloc_trim(0)``, over
    every arena); live memory is untouched. Returns whether anything was released; False, doing nothing, without
    glibc. Never raises."""
    libc = _glibc()
    if libc is None:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except Exception as exc:  # a C library that exports the name but fails: nothing to release then
        logger.debug("malloc_trim failed error=%r", exc)
        return False
