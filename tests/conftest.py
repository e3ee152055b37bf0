"""Shared fixtures: no test may leave a process behind.

Multi-peer tests start real processes (hivemind DHTs and their libp2p daemons, peers, recipe runs). A test
that fails halfway can leave them running, holding ports and CPU and failing later tests for no reason of
their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import psutil
import pytest

logger = logging.getLogger(__name__)

_TERMINATE_GRACE_S = 5.0
"""Seconds a leftover process gets after SIGTERM before SIGKILL."""

_MP_HELPER_MARKERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch_shm_manager")
"""Command-line fragments of multiprocessing's helper processes, which live as long as the test session.

``torch_shm_manager`` serves torch's ``file_system`` shared memory (hivemind's MPFuture buffer lives there): it
exits by itself when its last client does, and killing it first makes the interpreter abort at exit
(``THManagedMapAllocator::close``: broken pipe) when the buffer is freed.
"""


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def _is_mp_helper(proc: psutil.Process) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(marker in cmdline for marker in _MP_HELPER_MARKERS)


def _kill_and_reap(procs: list[psutil.Process], reason: str) -> None:
    """SIGTERM ``procs``, SIGKILL what is left after a grace period, and reap them all (no zombies)."""
    if not procs:
        return
    logger.warning("%s: killing leftover processes pids=%s", reason, [proc.pid for proc in procs])
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=_TERMINATE_GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=_TERMINATE_GRACE_S)


@pytest.fixture(autouse=True)
def reap_children_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, kill and reap the processes it started and left running.

    Processes that existed before the test (started by module- or session-scoped fixtures, which are set up
    first) and multiprocessing's own helpers are left alone; ``reap_children_at_exit`` ends those.
    """
    before = {proc.pid for proc in _descendants()}
    yield
    leftovers = [proc for proc in _descendants() if proc.pid not in before and not _is_mp_helper(proc)]
    _kill_and_reap(leftovers, reason=request.node.nodeid)


@pytest.fixture(autouse=True, scope="session")
def reap_children_at_exit() -> Iterator[None]:
    """At the end of the session, kill and reap every process still descending from pytest."""
    yield
    # multiprocessing's helpers exit with pytest (their pipes close), and ignore SIGTERM (5 s of waiting)
    _kill_and_reap([proc for proc in _descendants() if not _is_mp_helper(proc)], reason="end of test session")
