"""Shared fixtures: no test may leave a process behind.

Multi-peer tests start real processes (hivemind DHTs and their libp2p daemons, peers, recipe runs). A test
that fails halfway can leave them running, holding ports and CPU and failing later tests for no reason of
their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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


_PR_SET_CHILD_SUBREAPER = 36
"""``prctl`` option (linux/prctl.h): orphaned descendants are re-parented to this process instead of to init."""


def pytest_configure(config: pytest.Config) -> None:
    """Make this process (each xdist worker) a child subreaper on Linux, so that a process orphaned by a test (a
    DHT's process and its daemon whose parent was SIGKILLed, say) stays a descendant that
    :func:`reap_children_after_test` finds, instead of running on under init for the rest of the session."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


@pytest.fixture(autouse=True)
def reap_children_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, kill and reap the processes it started and left running.

    Processes that existed before the test (started by module- or session-scoped fixtures, which are set up
    first) and multiprocessing's own helpers are left alone; ``reap_children_at_exit`` ends those.
    """
    before = {proc.pid for proc in _descendants()}
    yield
    leftovers = [
        proc
        for proc in _descendants()
        if proc.pid not in before and not _is_mp_helper(proc) and not _is_background_build(proc)
    ]
    _kill_and_reap(leftovers, reason=request.node.nodeid)


@pytest.fixture(autouse=True, scope="session")
def reap_children_at_exit() -> Iterator[None]:
    """At the end of the session, kill and reap every process still descending from pytest."""
    yield
    # multiprocessing's helpers exit with pytest (their pipes close), and ignore SIGTERM (5 s of waiting)
    _kill_and_reap([proc for proc in _descendants() if not _is_mp_helper(proc)], reason="end of test session")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run with torch (and pulseloco's codec pool) on one thread, and restore the thread count afterwards (the
    test may set other counts meanwhile). Bit-exact comparisons need the same reduction order in a reference and
    the code under test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of a tiny warm model (``scripts/warm_model.py --size tiny``), built once per test session in
    a temporary cache (about half a minute on two CPU cores); its cache is ``path.parent.parent``.

    The build starts in the background as soon as a collected test needs it (:func:`_start_warm_model_build`),
    so the tests that run first do not wait for it. Under pytest-xdist the workers share that one build, in the
    session's common temporary directory: whoever holds the lock builds (the background process, or the first
    test that needs the model if that one has not started or has failed), the others wait up to the build's own
    timeout and read its result."""
    import filelock

    root = _shared_root(tmp_path_factory)
    cache = root / "pulseloco-cache"
    with filelock.FileLock(str(root / "pulseloco-cache.lock"), timeout=900):
        done = cache / "warm-model-path.txt"
        if not done.exists():
            _build_tiny_warm_model(cache, _tiny_model_name())
        path = Path(done.read_text())
    if _BACKGROUND_BUILD:
        _BACKGROUND_BUILD[0].poll()  # reap it (it has released the lock, so it is exiting or gone)
    assert path.is_dir(), f"the shared tiny warm model {path} is gone"
    return path


WARM_MODEL_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "warm_model.py"
_BACKGROUND_BUILD: list[subprocess.Popen[bytes]] = []
"""This process's background build of the tiny warm model, if it started one."""


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's temporary directory that every xdist worker shares (each worker's basetemp is inside it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def _start_warm_model_build(config: pytest.Config) -> None:
    """Start building the tiny warm model in a background process (``python conftest.py --build-tiny-warm-model
    ROOT``), once per session: the first worker to get here starts it, the others find its marker file."""
    root = _shared_root(config._tmp_path_factory)  # type: ignore[attr-defined]  # the tmp_path_factory fixture's
    if (root / "pulseloco-cache" / "warm-model-path.txt").exists():
        return
    try:
        os.close(os.open(root / "pulseloco-cache.started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    argv = [sys.executable, __file__, "--build-tiny-warm-model", str(root), _tiny_model_name()]
    _BACKGROUND_BUILD.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def _is_background_build(proc: psutil.Process) -> bool:
    """Whether ``proc`` is the background build or its ``warm_model.py`` (both name the shared cache)."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return "--build-tiny-warm-model" in cmdline or any(arg.endswith("pulseloco-cache") for arg in cmdline)


def _tiny_model_name() -> str:
    """The directory name of the tiny warm model (scripts/harness/warm.py; scripts/ is on the tests' path)."""
    from harness import warm

    return f"warm-tiny-{warm.SIZES['tiny'].digest()}"


def _build_tiny_warm_model(cache: Path, name: str) -> None:
    """Build the tiny warm model into ``cache`` and record its directory in ``cache/warm-model-path.txt``.

    The build starts from a killed build's leftovers (a half-written model directory ``name`` without the completion
    marker, a stale temporary directory), so that tests/test_warm_model.py checks that they are rebuilt and
    removed without a second build; the build's stdout is kept in ``build.log`` for it."""
    (cache / "models" / name).mkdir(parents=True, exist_ok=True)
    (cache / "models" / name / "config.json").write_text("{not json")
    (cache / "models" / f".{name}.tmp-killed").mkdir(exist_ok=True)
    result = subprocess.run(
        # One thread: the build runs beside the tests, where a second thread only spins (44 CPU-s instead of 57).
        [sys.executable, str(WARM_MODEL_SCRIPT), "--size", "tiny", "--cache-dir", str(cache), "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        check=False,
    )
    assert result.returncode == 0, f"warm_model.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    (cache / "build.log").write_text(result.stdout)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("warm model: "), f"unexpected last line {last!r}"
    (cache / "warm-model-path.txt").write_text(last.removeprefix("warm model: "))


SLOWEST_FIRST = (
    "test_loco_swarm.py",  # first: much of it waits on timers, which leaves CPU to the warm model's build
    "test_wan.py",  # about 5 minutes, needs no warm model: unranked, it started last and ran alone for its length
    "test_soak.py",  # one test: its worker takes the next file at once, to start after it
    "test_sync_swarm.py",  # needs no warm model: the soak's worker runs it while the build finishes
    "test_recipes.py",  # the longest; by the time it starts the warm model is built
    "test_pretrain.py",
    "test_rollouts.py",
    "test_compare.py",
    "test_vllm.py",
    "test_nat.py",
    "test_bench_sync.py",
    "test_sync_cli.py",
    "test_bench_memory.py",
    "test_monitor.py",
    "test_sparsity_study.py",
    "test_warm_model.py",
    "test_integrations.py",
    "test_status.py",
    "test_swarm.py",
    "test_bench_codec.py",
    "test_p2p_stream.py",
    "test_bench_streams.py",
    "test_sync_relay.py",
    "test_codec_parallel.py",
    "test_bench_verify.py",
)
"""Test files that take longest (``--durations``, 2 cores), about longest first. Under pytest-xdist with ``--dist
loadfile --no-loadscope-reorder`` (scripts/test.sh) files go to the workers in this order (a worker takes the next
file when at most two tests of its current one are left), so running these first keeps one long file from starting
last and running alone (longest-processing-time-first scheduling); the files left after them take a few seconds
each, so that both workers finish within seconds of each other (with test_warm_model.py unranked, one worker ran
it alone for its last 24 s). The warm model (:func:`tiny_warm_model`) builds
in the background meanwhile: the first three files do not need it, so no worker waits for the build (with
test_recipes.py right after the soak, its first test waited 28 s for it in a fresh clone)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the files of :data:`SLOWEST_FIRST` first, in that order; every other file keeps its place after them.
    When a collected test needs the tiny warm model, its build starts now, in the background."""
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order in a file
    if any("tiny_warm_model" in getattr(item, "fixturenames", ()) for item in items):
        _start_warm_model_build(config)


def _build_in_background(root: Path, name: str) -> None:
    """The background build (:func:`_start_warm_model_build`): under the shared lock, build unless done. A failed
    build leaves no ``warm-model-path.txt``, so the first test that needs the model builds it again and reports
    the failure."""
    import filelock

    with filelock.FileLock(str(root / "pulseloco-cache.lock"), timeout=900):
        if not (root / "pulseloco-cache" / "warm-model-path.txt").exists():
            _build_tiny_warm_model(root / "pulseloco-cache", name)


if __name__ == "__main__" and sys.argv[1:2] == ["--build-tiny-warm-model"]:
    _build_in_background(Path(sys.argv[2]), sys.argv[3])
