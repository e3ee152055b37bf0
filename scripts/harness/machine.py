"""Facts about the machine and the code a result was measured with, for the reports' headers and JSON.

None of these raise: a fact that cannot be found is ``"unknown"``, empty or None, as each function says.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from harness import REPO


def _git(*args: str) -> str:
    """``git ARGS`` in the repository: its stdout stripped, "" when git fails or is missing (10 s bound)."""
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def git_revision() -> str:
    """The short hash of the checked-out commit, ``"unknown"`` outside a git checkout."""
    return _git("rev-parse", "--short", "HEAD") or "unknown"


def library_revision() -> dict[str, Any]:
    """The commit the library was imported from (full hash, "" when unknown) and its uncommitted files under
    ``pulseloco/`` (``git status --short`` lines): results depend on both."""
    return {"commit": _git("rev-parse", "HEAD"), "uncommitted": _git("status", "--short", "pulseloco").splitlines()}


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what :mod:`platform` says."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return name


def load_average() -> float | None:
    """The 1-minute load average, None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_note() -> str:
    """One line: host, cores, CPU, Python and the load average now."""
    load = load_average()
    at_end = f", load average {load:.1f} at the end" if load is not None else ""
    return f"{platform.node()}: {os.cpu_count()} CPU cores ({cpu_name()}), Python {platform.python_version()}{at_end}"


def memory_available() -> int | None:
    """Bytes of memory available to new processes (psutil: the kernel's MemAvailable on Linux), None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def gpu_name() -> str | None:
    """The name of the first CUDA GPU torch sees, None without one (or without torch)."""
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        return None


def torch_note() -> str:
    """One line: the processor, torch's threads and version, and the GPU if there is one."""
    import torch

    gpu = gpu_name()
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
        + (f", {gpu}" if gpu else "")
    )


def versions(*modules: str) -> dict[str, str | None]:
    """``{module: its __version__}`` for the modules named (default torch, transformers, trl); None for one that is
    not installed."""
    found: dict[str, str | None] = {}
    for name in modules or ("torch", "transformers", "trl"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", None)
        except ImportError:
            found[name] = None
    return found
