"""Memory, as the benchmarks measure and budget it (Linux; glibc where malloc is tuned).

- this process's resident set and its peak from /proc (:func:`status`, :func:`held`, :func:`reset_peak`);
- glibc's allocator: hand freed heap pages back (:func:`trim`), or keep them for steady timings
  (:func:`tune_malloc`);
- whether a run's estimated peak fits what the machine has available (:func:`shortfall`).
"""

from __future__ import annotations

import ctypes
import gc
import sys
from pathlib import Path

from harness.machine import memory_available
from pulseloco.memory import release_freed_memory

MIB = 2**20
GB = 1e9


def status() -> dict[str, int]:
    """``VmRSS`` (resident now) and ``VmHWM`` (peak resident) of this process, in bytes; raises OSError without
    /proc."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def trim() -> None:
    """Collect garbage and hand freed heap pages back to the kernel (glibc ``malloc_trim``), so that VmRSS counts
    live memory rather than what the allocator kept after a free. Without glibc, only the garbage collection."""
    gc.collect()
    release_freed_memory()  # not glibc: RSS may then include freed heap pages


def held() -> int:
    """VmRSS after :func:`trim`, in bytes."""
    trim()
    return status()["VmRSS"]


def reset_peak() -> int:
    """Reset the peak RSS to the current RSS (Linux ``clear_refs`` 5, after :func:`trim`); returns the RSS. Raises
    OSError where the kernel does not allow it (peaks cannot be measured there)."""
    trim()
    Path("/proc/self/clear_refs").write_text("5")
    return status()["VmRSS"]


def tune_malloc() -> bool:
    """Make glibc keep freed memory instead of returning it to the kernel; True if it took effect (False off Linux
    or without glibc).

    By default every free of a large tensor unmaps it and the next allocation page-faults fresh zeroed pages. On
    this kind of VM that makes a 250 MB clone take either ~15 ms or ~700 ms depending on allocator history, which
    swamps every timing ratio against it. With these settings the process reaches a steady state where copies and
    codecs measure compute and memory bandwidth.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    # mallopt takes a C int: 2**31 - 1 is the largest trim threshold it accepts.
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def shortfall(need: float, margin: float) -> str | None:
    """Why a run that needs about ``need`` bytes at its peak should not start while ``margin`` bytes stay free for
    the rest of the machine (``needs about … GB, … GB available and … GB kept free``); None when it fits or the
    available memory is unknown."""
    available = memory_available()
    if available is None or need <= available - margin:
        return None
    return f"needs about {need / GB:.1f} GB, {available / GB:.1f} GB available and {margin / GB:.0f} GB kept free"
