"""scripts/bench_streams.py: a short run end to end (its own server process, real daemons on 127.0.0.1), and its
flags. The loss it counts is rare (a few in ten thousand under load), so only the handler that leaves the end of
the stream to the asker is held to zero here; the benchmark's own output carries the comparison."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import bench_streams
import psutil
import pytest


@pytest.mark.timeout(120)
def test_a_short_run_asks_both_handlers_and_loses_nothing_when_the_asker_closes(tmp_path: Path) -> None:
    argv = ["--seconds", "2", "--askers", "2", "--burners", "0", "--size", "300000", "--out", str(tmp_path)]
    bench_streams.main(argv)
    data = json.loads((tmp_path / "bench_streams.json").read_text())
    results = data["results"]
    assert set(results) == {"server_closes", "asker_closes"}
    assert sum(results["server_closes"].values()) > 0
    assert results["asker_closes"].get("complete", 0) > 0 and set(results["asker_closes"]) == {"complete"}, results
    table = (tmp_path / "bench_streams.md").read_text()
    assert "| asker_closes |" in table and "replies of 300000 bytes" in table
    # nothing of the server is left: neither it, nor its DHT's process, nor their daemon (once, only the server
    # itself was killed and the other two ran on, orphans that no test reaps)
    deadline = time.monotonic() + 10
    while (left := _server_group_left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def _server_group_left() -> list[str]:
    """Command lines of the processes still in a bench_streams server's process group (any on this machine)."""
    groups = set()
    for proc in psutil.process_iter(["cmdline"]):
        if "--serve" in (proc.info["cmdline"] or []) and any("bench_streams" in a for a in proc.info["cmdline"]):
            with contextlib.suppress(psutil.Error):
                groups.add(os.getpgid(proc.pid))
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) in groups:
                left.append(" ".join(proc.info["cmdline"] or [])[:120])
    return left


@pytest.mark.parametrize("argv", [["--seconds", "0"], ["--askers", "0"], ["--read-delay", "-1"]])
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_streams.main(argv)
    assert exited.value.code == 2
    assert "error: --seconds must be > 0" in capsys.readouterr().err
