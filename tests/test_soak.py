"""The churn soak's short version: experiments/soak/soak.py with 4 peers (one in client mode, one poisoning its
payloads) for 8 rounds, a peer SIGKILLed right after pushing and restarted, a short and a long SIGSTOP stall, and a
PULSESync subscriber killed and restarted. The full run (6 peers, 50 rounds) is a benchmark; see the README."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _log_tails(out: Path, chars: int = 8000) -> str:
    """The end of every process's log of the run: what a failure under load needs to be explained (a run that timed
    out has had each running peer write every thread's stack there)."""
    tails = [
        f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}" for path in sorted((out / "logs").glob("*.log"))
    ]
    return "\n".join(tails)


# The soak's own deadline (--timeout 240 for the rounds, then at most about 4 minutes to stop every process and check)
# comes first, so that a slow run still writes its summary and logs; the subprocess's and pytest's come after it.
@pytest.mark.timeout(600)
def test_short_churn_soak_counts_every_contribution_once(tmp_path: Path) -> None:
    out, summary_path = tmp_path / "soak", tmp_path / "summary.json"
    cmd = [
        sys.executable,
        str(REPO / "experiments" / "soak" / "soak.py"),
        "--peers",
        "4",
        "--rounds",
        "8",
        "--publish-interval",
        "2",
    ]
    cmd += ["--out", str(out), "--json", str(summary_path), "--timeout", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, check=False)
    assert summary_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:] + _log_tails(out)
    summary = json.loads(summary_path.read_text())
    context = proc.stdout + "\n".join(summary["events"]) + ("" if proc.returncode == 0 else _log_tails(out))
    assert summary["rounds"] >= 8, context
    assert summary["ledger_note"] == "", context
    assert summary["ledger_checked"] >= 4, context  # the three honest peers and the killed incarnation
    assert summary["double_counts"] == 0, context
    assert summary["digest_disagreements"] == 0, context
    assert summary["leaked_processes"] == 0, context
    assert summary["rejected_contributions"] > 0, context  # the poisoned payloads were seen and refused
    assert summary["sync_versions"] > 0 and summary["sync_mismatches"] == 0 and summary["sync_behind"] == 0, context
    assert summary["missed_events"] == [], context  # every event of the schedule happened
    assert any("kill peer1" in e for e in summary["events"]) and any("stall" in e for e in summary["events"])
    assert proc.returncode == 0, context
