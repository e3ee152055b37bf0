"""PulseLoCo hands the heap pages a round freed back to the operating system (:mod:`pulseloco.memory`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pulseloco.memory import _glibc

ROOT = Path(__file__).resolve().parents[1]

# Free 7 of every 8 blocks of 64 KiB (below glibc's mmap threshold, so they come from the heap), keeping the rest
# alive so that the freed pages sit between live ones and the allocator does not return them by itself.
PROBE = textwrap.dedent(
    """
    import sys
    from pulseloco.memory import release_freed_memory

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024

    blocks = [bytearray(64 << 10) for _ in range(3200)]
    kept = blocks[::8]
    del blocks
    before = rss()
    released = release_freed_memory()
    print(released, before - rss(), len(kept))
    """
)


@pytest.mark.skipif(
    not Path("/proc/self/status").exists() or _glibc() is None,
    reason="needs Linux with glibc (malloc_trim) and /proc",
)
def test_freed_heap_pages_go_back_to_the_system() -> None:
    """Of 200 MiB freed in the middle of the heap, most leaves the process's resident set; the live blocks stay."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    released, dropped, kept = out[0] == "True", int(out[1]), int(out[2])
    assert released and kept == 400
    assert dropped > 120 * 2**20, f"only {dropped / 2**20:.0f} MiB of 175 MiB freed went back"
