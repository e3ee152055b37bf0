"""scripts/harness/procs.py: processes forked from a preloaded fork server behave as the command lines they stand
for (arguments, environment, working directory, log, exit code, a session of their own), and fall back to a new
interpreter where a fork cannot stand for the command. scripts/harness/channel.py: a finished case's connections
say nothing to the next case."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness import channel, procs

SCRIPT = """
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0])
print("env", os.environ.get("PROCS_TEST"), "leader", os.getsid(0) == os.getpid() == os.getpgid(0))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "sleep":
    child = __import__("subprocess").Popen(["sleep", "60"])
    print("child", child.pid, flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "child.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_a_forked_script_runs_as_its_command_line(tmp_path: Path, script: Path) -> None:
    runner = procs.Runner(tmp_path, env={"PROCS_TEST": "yes"}, preload=("json",))
    try:
        proc = runner.start("child", [sys.executable, str(script), "3", "x"])
        assert isinstance(proc.popen, procs.ForkedPopen)
        assert proc.wait(timeout=60) == 3 and proc.poll() == 3
        log = proc.text()
        assert f"argv ['3', 'x'] cwd {procs.REPO} path0 {script.parent}" in log
        assert "env yes leader True" in log and "to stderr" in log
        (tmp_path / "in.json").write_text('{"a": [1]}')
        module = runner.start("module", [sys.executable, "-m", "json.tool", str(tmp_path / "in.json")])
        assert module.wait(timeout=60) == 0 and '"a": [' in module.text()
        failing = runner.start("failing", [sys.executable, str(script), "raise"])
        assert failing.wait(timeout=60) == 1 and "ValueError: boom" in failing.text()
    finally:
        runner.stop_all()


def test_killing_a_forked_process_ends_its_whole_session(tmp_path: Path, script: Path) -> None:
    runner = procs.Runner(tmp_path, preload=("json",))
    try:
        proc = runner.start("sleeper", [sys.executable, str(script), "sleep"])
        grandchild = int(proc.wait_for(r"child (\d+)", timeout=60).group(1))
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        proc.kill()
        assert proc.poll() == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the session's other process survived the kill"
            time.sleep(0.1)
    finally:
        runner.stop_all()


def test_command_lines_a_fork_cannot_stand_for_start_a_new_interpreter(tmp_path: Path) -> None:
    runner = procs.Runner(tmp_path, preload=("json",))
    try:
        with_option = runner.start("option", [sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid())"])
        other = runner.start("other", ["sh", "-c", "echo $$"])
        assert isinstance(with_option.popen, subprocess.Popen) and isinstance(other.popen, subprocess.Popen)
        assert with_option.wait(timeout=60) == 0 and with_option.text().strip() == "True"
        assert other.wait(timeout=60) == 0 and other.text().strip() == str(other.pid)
    finally:
        runner.stop_all()
    assert os.environ.get("PROCS_TEST") is None


def test_a_forgotten_workers_late_end_of_connection_is_not_reported(tmp_path: Path) -> None:
    """bench_sync once failed a case with "subscriber 2 closed its connection": the end of the connection of the
    previous case's subscriber 2, which its last process closed after the coordinator had forgotten that case."""
    hub = channel.Hub(tmp_path / "hub.sock")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(channel.AUTHKEY_ENV, hub.worker_env()[channel.AUTHKEY_ENV])
            old, _ = channel.connect(hub.path, "subscriber", 2)
            got = hub.get(timeout=10)
            assert got is not None and got[:2] == ("subscriber", 2) and got[2][0] == "hello"
            hub.forget()
            old.close()
            assert hub.get(timeout=1.0) is None  # its eof is dropped
            new, send = channel.connect(hub.path, "subscriber", 2)
            send(("joined", {}))
            messages = [hub.get(timeout=10) for _ in range(2)]
            assert [m[2][0] for m in messages if m is not None] == ["hello", "joined"]
            new.close()
            got = hub.get(timeout=10)
            assert got is not None and got[2] == ("eof",)
    finally:
        hub.close()


HOLDER = """
import time
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture, SharedBytes
for lock in (MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock):
    lock.acquire()
_AsyncContextWrapper.EXECUTOR_LOCK.acquire()
print("holding", flush=True)
time.sleep(600)
"""

DHT_USER = """
import hivemind
from hivemind.utils import get_dht_time
dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
print("stored", dht.store("key", "value", get_dht_time() + 60), flush=True)
print("got", dht.get("key", latest=True).value, flush=True)
dht.shutdown()
"""


def test_a_forked_process_killed_holding_hiveminds_locks_stops_no_other(tmp_path: Path) -> None:
    """hivemind creates its MPFuture and executor locks when it is imported, shared by every process forked after:
    the churn soak's peers, forks of one server, once hung for good after one of them was SIGKILLed (its DHT
    process mid-update, holding the update lock). Each forked command line has locks of its own."""
    (tmp_path / "holder.py").write_text(HOLDER)
    (tmp_path / "dht_user.py").write_text(DHT_USER)
    runner = procs.Runner(tmp_path, preload=("hivemind",))
    try:
        holder = runner.start("holder", [sys.executable, str(tmp_path / "holder.py")])
        holder.wait_for("holding", timeout=120)
        holder.kill()
        user = runner.start("user", [sys.executable, str(tmp_path / "dht_user.py")])
        try:
            assert user.wait(timeout=60) == 0, user.tail()
        except subprocess.TimeoutExpired:
            pytest.fail(f"a DHT in a sibling of the killed process did not start and answer in 60 s:\n{user.tail()}")
        assert "stored True" in user.text() and "got value" in user.text()
    finally:
        runner.stop_all()
