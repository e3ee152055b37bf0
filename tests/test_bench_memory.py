"""Smoke test of scripts/bench_memory.py: a --small run (no DHT) prints the table and writes a JSON report whose
rows are measured numbers with a PASS/MISS verdict each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_memory.py"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc/self/clear_refs")
def test_small_run_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--no-dht", "--threads", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: some row missed its target (a measurement)
    report = json.loads(out.read_text())
    rows = {row["row"].split(" (")[0]: row for row in report["rows"]}
    assert set(rows) == {
        "pulseloco held after 2 rounds",
        "pulseloco round 2 temporaries",
        "publisher peak, patch version",
        "publisher held after it",
        "subscriber peak, patch version",
        "subscriber held after it",
    }
    numel = report["meta"]["numel"]
    assert numel > 1_000_000
    for row in report["rows"]:
        assert row["result"] in ("PASS", "MISS")
        assert row["measured_per_param"] == pytest.approx(row["measured_bytes"] / numel)
        assert row["row"] in proc.stdout and row["result"] in proc.stdout
    # The outer state really is resident: theta, residual and momentum are at least 12 bytes a parameter.
    assert rows["pulseloco held after 2 rounds"]["measured_per_param"] >= 12.0
    assert report["meta"]["pulseloco"]["rounds"][-1]["num_sent"] > 0
