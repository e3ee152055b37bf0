"""Processes a benchmark starts: each in a session (process group) of its own, output to a log file, every wait
bounded, and a cleanup that reaches the whole group (accelerate's children, hivemind's DHT process, the libp2p
daemon) and reaps it.

    runner = Runner(log_dir, netns=net, env={"OMP_NUM_THREADS": "1"})
    dht = runner.start("dht", [sys.executable, "-m", "pulseloco", "dht"], ns_index=0)   # log_dir/dht.log
    maddr = dht.wait_for(r"multiaddr: (\\S+)", timeout=120).group(1)
    wait_all([runner.start("trainer", argv)], timeout=600)     # exit code 0, else ProcFailed with the log's tail
    runner.stop_all()                                          # SIGTERM every group, then SIGKILL; idempotent

Errors: :class:`ProcFailed` (a RuntimeError) when a process exits with an error or before what was waited for,
:class:`ProcTimeout` (both a ProcFailed and a TimeoutError) when a wait runs out of time; both carry the tail of
the log. Stopping never raises. Also: :func:`run_spawned` and :func:`join_all` for ``multiprocessing`` workers,
:func:`survivors` (what is left of process groups), :func:`exit_on_signals`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import REPO

if TYPE_CHECKING:
    import psutil

    from harness.netns import NetNS

HELPERS = ("resource_tracker", "torch_shm_manager")
"""Children of a benchmark that are not its workers (multiprocessing's and torch's helpers)."""


class ProcFailed(RuntimeError):
    """A started process exited with an error, or before printing what was waited for."""


class ProcTimeout(ProcFailed, TimeoutError):
    """A wait for a started process ran out of time."""


class Proc:
    """One started process, leading its own process group: ``argv`` run in ``cwd`` with ``env``, stdin closed,
    stdout and stderr to ``log_path``. Raises OSError when it cannot be started."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None, cwd: Path = REPO
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.started = time.monotonic()
        self.ended: float | None = None
        """When :meth:`poll` or :meth:`wait` first saw it exit (monotonic clock)."""
        with log_path.open("wb") as fh:
            self.popen = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        """The process id, also its process group id."""
        return self.popen.pid

    def text(self) -> str:
        """The log so far ("" when it cannot be read)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.text().splitlines()[-lines:])

    def poll(self) -> int | None:
        """The exit code, None while it runs."""
        code = self.popen.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code

    @property
    def running(self) -> bool:
        return self.poll() is None

    def wait(self, timeout: float) -> int:
        """Wait for the exit code; raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        code = self.popen.wait(timeout=timeout)
        self.poll()
        return code

    def wait_for(self, pattern: str, timeout: float, *, interval: float = 0.3) -> re.Match[str]:
        """The first match of ``pattern`` in the log; raises ProcFailed if the process exits without printing it
        and ProcTimeout after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            if match := rx.search(self.text()):
                return match
            if self.poll() is not None:
                raise ProcFailed(f"{self.name} exited with {self.popen.returncode} before {pattern!r}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise ProcTimeout(f"{self.name}: no {pattern!r} within {timeout:.0f} s:\n{self.tail()}")
            time.sleep(interval)

    def send_signal(self, sig: int) -> None:
        """Signal the process itself, not its group (SIGSTOP stalls it while its DHT and daemon run on); nothing
        if it is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, sig)

    def signal_group(self, sig: int) -> bool:
        """Signal the whole process group; False when nothing of it is left (or it is not ours)."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the whole group at once and reap the process (bounded: 30 s)."""
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout=30)

    def stop(self, grace: float = 5.0) -> None:
        """:func:`stop_all` of this process alone."""
        stop_all([self], grace)


def stop_all(procs: Iterable[Proc], grace: float = 5.0) -> None:
    """SIGTERM every process group, wait up to ``grace`` seconds for them to exit, then SIGKILL every group (a group
    may hold leftovers after its leader exited) and reap. Never raises; idempotent."""
    procs = list(procs)
    signalled = [proc for proc in procs if proc.signal_group(signal.SIGTERM)]
    if signalled:
        wait_exited(signalled, grace)
        time.sleep(min(grace, 0.5))  # what is left of a group whose leader exited handles its SIGTERM too
    for proc in procs:
        proc.signal_group(signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def wait_exited(procs: Iterable[Proc], timeout: float) -> list[Proc]:
    """Wait up to ``timeout`` seconds in all for the processes to exit, whatever their codes; returns those still
    running."""
    deadline = time.monotonic() + timeout
    procs = list(procs)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    return [p for p in procs if p.running]


def wait_all(procs: list[Proc], timeout: float, *, hint: str = "") -> None:
    """Wait until every process exited with code 0; raises ProcFailed (with the log's tail) as soon as one exits
    with another code, ProcTimeout when some still run after ``timeout`` seconds (``hint``: the option that sets
    it, for the message)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        for proc, code in zip(procs, codes):
            if code not in (None, 0):
                raise ProcFailed(f"{proc.name} exited with {code}; log {proc.log_path}:\n{proc.tail()}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            late = [p for p, c in zip(procs, codes) if c is None]
            because = f" ({hint})" if hint else ""
            raise ProcTimeout(
                f"{', '.join(p.name for p in late)} still running after {timeout:.0f} s{because}; "
                f"log {late[0].log_path}:\n{late[0].tail()}"
            )
        time.sleep(0.5)


class Runner:
    """Starts processes, optionally inside a :class:`~harness.netns.NetNS` peer namespace, and stops all of them.

    Every process gets ``os.environ`` with ``PYTHONUNBUFFERED=1`` (its log is current), then ``env``, then the
    ``env`` of its :meth:`start`. Usable as a context manager that stops everything on exit.
    """

    def __init__(self, log_dir: Path, *, netns: NetNS | None = None, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.netns = netns
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: list[Proc] = []

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        log_path: Path | None = None,
        ns_index: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start ``argv`` logging to ``log_path`` (default ``log_dir/<name>.log``), in peer ``ns_index``'s namespace
        when the runner has a network and it is given. Raises OSError when it cannot be started."""
        if self.netns is not None and ns_index is not None:
            argv = self.netns.exec_argv(ns_index, argv)
        proc = Proc(name, argv, log_path or self.log_dir / f"{name}.log", env={**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def stop_all(self, grace: float = 5.0) -> None:
        """:func:`stop_all` of everything started so far; idempotent."""
        procs, self.procs = self.procs, []
        stop_all(procs, grace)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def survivors(groups: Iterable[int], *, ignore: tuple[str, ...] = HELPERS) -> list[psutil.Process]:
    """Processes still running in the process groups ``groups`` and children of this process whose command line
    names none of ``ignore``: what a clean shutdown should have left nothing of. Never raises for processes that
    vanish meanwhile."""
    import psutil

    groups = set(groups)
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.info["pid"]) in groups:
                found[proc.pid] = proc
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if not any(name in " ".join(proc.cmdline()) for name in ignore):
                found.setdefault(proc.pid, proc)
    return list(found.values())


def exit_on_signals(*signums: int) -> None:
    """Turn SIGTERM and SIGHUP (or ``signums``) into ``SystemExit(128 + signum)`` in the main thread, so that the
    ``finally`` blocks that stop processes and delete namespaces run."""

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    for signum in signums or (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)


def run_spawned(target: Callable[..., None], *args: Any, timeout: float = 900.0) -> Any:
    """Run ``target(*args, results)`` in a fresh ``spawn`` process and return the first thing it puts on the queue
    ``results``; raises RuntimeError (after killing it) when it exits or runs past ``timeout`` seconds without
    one."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, results))
    process.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = results.get(timeout=1.0)
            break
        except queue.Empty:
            if process.is_alive() and time.monotonic() < deadline:
                continue
            process.kill()
            process.join(timeout=10)
            raise RuntimeError(f"{target.__name__} gave no result (exit code {process.exitcode})") from None
    process.join(timeout=60)
    return result


def join_all(processes: list[Any], timeout: float, what: str) -> None:
    """Join started ``multiprocessing`` processes, each within ``timeout`` seconds; raises RuntimeError naming
    ``what`` when one does not finish in time or exits with an error, after killing every one still running."""
    try:
        for process in processes:
            process.join(timeout=timeout)
            if process.exitcode is None:
                raise RuntimeError(f"{what} did not finish within {timeout}s")
            if process.exitcode != 0:
                raise RuntimeError(f"{what} exited with {process.exitcode}")
    finally:
        for process in processes:
            if process.exitcode is None:
                process.kill()
                process.join()
