"""Processes a benchmark starts: each in a session (process group) of its own, output to a log file, every wait
bounded, and a cleanup that reaches the whole group (accelerate's children, hivemind's DHT process, the libp2p
daemon) and reaps it.

    runner = Runner(log_dir, netns=net, env={"OMP_NUM_THREADS": "1"})
    dht = runner.start("dht", [sys.executable, "-m", "pulseloco", "dht"], ns_index=0)   # log_dir/dht.log
    maddr = dht.wait_for(r"multiaddr: (\\S+)", timeout=120).group(1)
    wait_all([runner.start("trainer", argv)], timeout=600)     # exit code 0, else ProcFailed with the log's tail
    runner.stop_all()                                          # SIGTERM every group, then SIGKILL; idempotent

A runner made with ``preload=("torch", "hivemind", ...)`` starts Python command lines (``python script.py ...``,
``python -m module ...``) as forks of a ``multiprocessing`` fork server that imported those modules once, instead
of as new interpreters that each import them again (about 5 CPU-s for torch and hivemind): the same command line,
run by ``runpy`` in a real process of its own session, with the same log, environment and working directory.

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
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import REPO

if TYPE_CHECKING:
    import psutil

    from harness.netns import NetNS

HELPERS = ("resource_tracker", "torch_shm_manager", "multiprocessing.forkserver")
"""Children of a benchmark that are not its workers (multiprocessing's and torch's helpers, the fork server)."""


class ProcFailed(RuntimeError):
    """A started process exited with an error, or before printing what was waited for."""


class ProcTimeout(ProcFailed, TimeoutError):
    """A wait for a started process ran out of time."""


def _runpy_args(argv: list[str]) -> list[str] | None:
    """``argv`` without the interpreter when it runs a script or a module with this interpreter and no options
    (what :func:`_run_forked` can run), else None."""
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    args = argv[1:]
    if args[0] == "-m":
        return args if len(args) >= 2 else None
    return None if args[0].startswith("-") else args


def own_hivemind_locks() -> None:
    """Give this process hivemind's process-wide locks of its own; call it first in a process forked from one that
    imported hivemind (a fork server, a test) to run as a program of its own, before it makes any hivemind object.
    Does nothing where hivemind is not imported; never raises.

    hivemind makes multiprocessing locks when it is imported (``MPFuture``'s update, initialization and shared-byte
    locks, its executor lock) and every process forked after shares them: meant for a process and the DHT processes
    it forks, which write to its pipes. Siblings forked from one server shared them too, so one killed while holding
    one (a churn soak's SIGKILL while its DHT process sent a result) stopped every other's DHT for good, and one
    stopped (SIGSTOP) while holding one stopped them for as long."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # new update, initialization and shared-byte locks; its pipe made anew
    hm_asyncio = sys.modules.get("hivemind.utils.asyncio")
    if hm_asyncio is not None:
        hm_asyncio._AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


def _run_forked(args: list[str], log_path: str, env: dict[str, str], cwd: str) -> None:
    """The body of a forked :class:`Proc`: become the leader of a new session with hivemind's locks of its own
    (:func:`own_hivemind_locks`), send stdin from ``/dev/null`` and stdout and stderr to ``log_path``, take ``env``
    and ``cwd``, then run ``args`` (:func:`_runpy_args`: a script or ``-m`` and a module, then their arguments) as
    ``__main__`` (its ``SystemExit`` code is the process's exit code, an exception's is 1)."""
    os.setsid()
    own_hivemind_locks()
    null, log = os.open(os.devnull, os.O_RDONLY), os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  # the process's own stdout, to its end
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


class ForkedPopen:
    """The part of ``subprocess.Popen``'s interface that :class:`Proc` uses, for a process forked from a
    ``multiprocessing`` fork server (a child of the server, not of this process: waited for through its
    sentinel). ``returncode`` is negative for a signal, as Popen's."""

    def __init__(
        self, forkserver: Any, argv: list[str], runpy_args: list[str], log_path: Path, *, env: dict[str, str], cwd: Path
    ) -> None:
        self.args = argv
        self._process = forkserver.Process(target=_run_forked, args=(runpy_args, str(log_path), env, str(cwd)))
        self._process.start()
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


def fork_server(preload: Iterable[str]) -> Any:
    """A ``multiprocessing`` context whose fork server imports ``preload`` (module names) once; it starts with the
    first process and ends with this one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


class Proc:
    """One started process, leading its own process group: ``argv`` run in ``cwd`` with ``env``, stdin closed,
    stdout and stderr to ``log_path``. Raises OSError when it cannot be started."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path = REPO,
        forkserver: Any = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.started = time.monotonic()
        self.ended: float | None = None
        """When :meth:`poll` or :meth:`wait` first saw it exit (monotonic clock)."""
        self.popen: subprocess.Popen[bytes] | ForkedPopen
        runpy_args = _runpy_args(argv) if forkserver is not None else None
        if runpy_args is not None:
            log_path.write_bytes(b"")
            self.popen = ForkedPopen(forkserver, argv, runpy_args, log_path, env=dict(env or os.environ), cwd=cwd)
            return
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
    ``env`` of its :meth:`start`. With ``preload`` (module names), Python command lines outside a namespace are
    forked from a fork server that imported those modules (:class:`ForkedPopen`). Usable as a context manager that
    stops everything on exit.
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        netns: NetNS | None = None,
        env: dict[str, str] | None = None,
        preload: Iterable[str] = (),
    ) -> None:
        self.log_dir = log_dir
        self.netns = netns
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: list[Proc] = []
        preload = list(preload)
        self.forkserver = fork_server(preload) if preload else None

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
        forkserver = self.forkserver
        if self.netns is not None and ns_index is not None:
            argv = self.netns.exec_argv(ns_index, argv)
            forkserver = None
        log_path = log_path or self.log_dir / f"{name}.log"
        proc = Proc(name, argv, log_path, env={**self.env, **(env or {})}, forkserver=forkserver)
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
    names none of ``ignore``: what a clean shutdown should have left nothing of. Zombies are not counted: they
    have exited, and wait for a parent to reap them (under a child subreaper, such as the test suite's pytest
    workers, that parent is the subreaper, which reaps when its test ends). Never raises for processes that vanish
    meanwhile."""
    import psutil

    groups = set(groups)
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.info["pid"]) in groups:
                found[proc.pid] = proc
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and not any(name in " ".join(proc.cmdline()) for name in ignore):
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
