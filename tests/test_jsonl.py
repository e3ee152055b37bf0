"""pulseloco.jsonl: the one JSON-lines writer (rounds, published versions, rollout batches)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from pulseloco.jsonl import JsonLinesWriter, read_json_lines
from pulseloco.loco.metrics import RoundMetrics


def test_records_from_many_threads_are_whole_lines(tmp_path: Path) -> None:
    writer = JsonLinesWriter(tmp_path / "deep" / "log.jsonl", stamp=True)
    threads = [
        threading.Thread(target=lambda t=t: [writer.write({"thread": t}, i=i, pad="x" * 5000) for i in range(50)])
        for t in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = read_json_lines(tmp_path / "deep" / "log.jsonl")
    assert len(records) == 200
    assert all(next(iter(r)) == "time" and r["time"] > 0 for r in records)  # stamped first
    assert sorted((r["thread"], r["i"]) for r in records) == [(t, i) for t in range(4) for i in range(50)]


def test_a_dataclass_is_written_as_its_fields_and_unstamped_by_default(tmp_path: Path) -> None:
    writer = JsonLinesWriter(tmp_path / "rounds.jsonl")
    metrics = RoundMetrics(
        round=3, num_peers=2, num_sent=7, numel=14, density=0.5, num_returned=0, num_rejected=0, bytes_sent=10,
        bytes_received=12, seconds_inner=1.0, seconds_sync=0.5, loss=None, theta_digest="ab", repaired=False,
    )  # fmt: skip
    writer.write(metrics)
    (record,) = read_json_lines(tmp_path / "rounds.jsonl")
    assert record["round"] == 3 and record["density"] == 0.5 and "time" not in record


def test_a_failed_write_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = JsonLinesWriter(tmp_path / "log.jsonl")
    (tmp_path / "log.jsonl").mkdir()  # a directory where the file should be: open() fails
    with caplog.at_level(logging.WARNING, logger="pulseloco.jsonl"):
        writer.write({"a": 1})
    assert "JSON-lines write failed" in caplog.text and str(tmp_path / "log.jsonl") in caplog.text
