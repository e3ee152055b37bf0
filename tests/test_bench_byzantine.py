"""experiments/byzantine/bench_byzantine.py: a smoke run end to end on loopback (two runs of four peer processes,
two rounds).

The measured losses are not asserted here (they are the script's output,
experiments/byzantine/results/byzantine/README.md); this checks that the script runs a group of four with and
without the attacker and writes its report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "byzantine" / "bench_byzantine.py"


@pytest.mark.timeout(300)
def test_small_run_writes_the_table(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    argv = ["--rounds", "2", "--rules", "clip", "--attacks", "flip", "--matchmaking-time", "30", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_byzantine.json").read_text())
    runs = {(r["rule"], r["attack"]) for r in report["results"]}
    assert runs == {("clip", None), ("clip", "flip")}
    for result in report["results"]:
        assert len(result["eval_loss"]) == 3 and result["honest_equal_digests"]
        assert result["honest_disputed"] == []
    assert "| flip @9x | clip |" in (tmp_path / "README.md").read_text()
