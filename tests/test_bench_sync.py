"""experiments/sync/bench_sync.py: a smoke run end to end on loopback (a publisher and two subscriber processes).

The benchmark's timings are not asserted here (performance lives in the script's own output); this checks that
it runs both modes, that every subscriber ended every version with the publisher's digest, and that a patch is
smaller than a full checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "sync" / "bench_sync.py"


@pytest.mark.timeout(300)
def test_small_run_matches_digests_and_patches_are_smaller(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--small",
            "--versions",
            "3",
            "--subscribers",
            "2",
            "--no-netns",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "loopback" in proc.stdout
    assert "skipped (--no-netns)" in proc.stdout

    report = json.loads(out.read_text())
    assert report["completed"]
    cases = {(c["condition"], c["mode"]): c for c in report["cases"]}
    assert set(cases) == {("loopback", "patches"), ("loopback", "full")}
    for case in cases.values():
        assert case["subscribers"] == 2
        versions = case["versions"]
        assert [v["counted"] for v in versions] == [False, True, True, True]  # initial anchor + 3 versions
        assert case["all_digests_match"]
        for v in versions:
            assert v["digests_match"]
            assert len(v["subscribers"]) == 2
            for sub in v["subscribers"]:
                assert sub["digest"] == v["publisher_digest"]
                assert sub["version"] == v["version"]
                assert sub["latency_s"] > 0
        assert case["summary"]["all_digests_match"]

    patches, full = cases["loopback", "patches"], cases["loopback", "full"]
    assert patches["summary"]["mean_object_bytes"] < full["summary"]["mean_object_bytes"]
    for v in patches["versions"][1:]:
        assert 0 < v["patch_bytes"] < patches["full_bf16_bytes"]
    for v in full["versions"]:
        assert v["object_bytes"] == v["anchor_bytes"] >= full["full_bf16_bytes"]
    assert report["summary"][0]["bytes_ratio"] < 1
