"""scripts/compare.py: a minimal comparison end to end (pretrain-tiny.yaml, one outer round, on 127.0.0.1), and the
one-line refusal to run with a Python that is not the project's.

Timings are not asserted (they live in compare.md); this checks that the four strategies ran with two workers
each (two ddp processes; swarm rounds averaged by both peers), that compare.md and the plots were written, and
that the bytes sent per worker are ordered as the algorithms say at an RL-sized learning rate: PULSELoCo < DiLoCo
(dense, once per round) < DDP (every step, the ring all-reduce estimate).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "compare.py"
SYSTEM_PYTHON = Path("/usr/bin/python3")
HAS_DEPS = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('transformers', 'trl')))"
"""Exits 0 where the Python can import the project's main dependencies (found, not imported: fast)."""


def run_compare(argv: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run compare.py; on a timeout SIGTERM it first, so that it stops the processes it started."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"compare.py still running after {timeout:.0f} s:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.timeout(170)
def test_minimal_comparison_writes_table_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "results"
    report = tmp_path / "compare.json"
    runs = tmp_path / "runs"
    # --parallel: the four strategies at once (wall times are not compared here); a small learning rate puts the
    # inner updates below the BF16 visibility threshold of most weights, the regime PULSELoCo is built for. 8 steps
    # are one outer round (inner_steps 8); 100 kB of text keep the data preparation short.
    argv = [sys.executable, str(SCRIPT), "--steps", "8", "--parallel", "--out", str(out), "--json", str(report)]
    argv += ["--runs-dir", str(runs), "--timeout", "140", "--", "--learning_rate", "1e-5", "--warmup_steps", "0"]
    argv += ["--logging_steps", "2", "--max_bytes", "100000"]
    proc = run_compare(argv, timeout=160)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    md = (out / "compare.md").read_text()
    for strategy in ("ddp", "diloco", "pulseloco", "sparseloco"):
        assert f"| {strategy} |" in md
    assert "ran concurrently" in md and "loopback" in md
    assert "| final eval loss |" in md and "2(W-1)/W x 4 bytes" in md  # the metric and ddp's estimate are named
    for png in ("compare_bytes.png", "compare_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = {r["strategy"]: r for r in json.loads(report.read_text())["results"]}
    assert set(results) == {"ddp", "diloco", "pulseloco", "sparseloco"}
    for name, r in results.items():
        assert r["error"] is None and r["workers"] == 2
        assert r["group_sizes"] == [2], name  # ddp ran 2 processes; every swarm round was averaged by both peers
        assert r["steps"] == 8 and r["rounds"] == (0 if name == "ddp" else 1)
        assert r["final_source"] == "eval"
        assert r["final"] is not None and 0 < r["final"] < 10  # held-out loss of a byte-level model
        assert r["bytes_per_worker"] > 0
        assert len(r["curve"]) == 4  # the training loss at steps 2, 4, 6 and 8
    for peer in ("peer0", "peer1"):
        assert (runs / "pulseloco" / peer / "pulseloco_rounds.jsonl").exists()
    ddp = results["ddp"]
    assert ddp["bytes_per_worker"] == 2 * (2 - 1) / 2 * 4 * ddp["num_params"] * 8  # ring all-reduce, FP32, 8 steps
    sent = {name: r["bytes_per_worker"] for name, r in results.items()}
    assert sent["pulseloco"] < sent["diloco"] < sent["ddp"]
    # DDP all-reduces every step and DiLoCo once per round of 8 steps: about 8x (estimated vs measured bytes,
    # which hivemind's wire format makes somewhat smaller)
    assert 2 < sent["ddp"] / sent["diloco"] < 30


def assert_one_line_refusal(proc: subprocess.CompletedProcess[str], tmp: Path, out: Path) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and not proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in lines[0]
    assert "scripts/demo.sh" in lines[0] and "scripts/test.sh" in lines[0]
    assert ".venv/bin/python scripts/compare.py" in lines[0]
    assert list(tmp.iterdir()) == [] and not out.exists()  # no runs directory, nothing written
    return lines[0]


@pytest.mark.timeout(60)
def test_python_without_the_dependencies_gets_one_line(tmp_path: Path) -> None:
    """The system Python (isolated: no user site-packages), as a new user who ran `python3 scripts/compare.py`."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"no {SYSTEM_PYTHON}")
    probe = subprocess.run([str(SYSTEM_PYTHON), "-I", "-c", HAS_DEPS], check=False,
                           capture_output=True, timeout=60)  # fmt: skip
    if probe.returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has the project's dependencies")
    tmp, out = tmp_path / "tmp", tmp_path / "results"
    tmp.mkdir()
    argv = [str(SYSTEM_PYTHON), "-I", str(SCRIPT), "--out", str(out), "--steps", "8"]
    proc = run_compare(argv, timeout=50, env=dict(os.environ, TMPDIR=str(tmp)))
    line = assert_one_line_refusal(proc, tmp, out)
    assert "lacks the project's dependencies" in line


@pytest.mark.timeout(60)
def test_python_without_accelerate_beside_it_gets_one_line(tmp_path: Path) -> None:
    """A virtual environment with the packages but no `accelerate` command beside its python: this venv's
    pyvenv.cfg and lib/ behind a bin/ that holds only the interpreter."""
    cfg = Path(sys.prefix) / "pyvenv.cfg"
    if not cfg.exists() or not (Path(sys.prefix) / "lib").is_dir():
        pytest.skip("the tests do not run in a virtual environment")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(cfg, venv / "pyvenv.cfg")
    (venv / "lib").symlink_to(Path(sys.prefix) / "lib")
    python = venv / "bin" / "python"
    python.symlink_to(os.path.realpath(sys.executable))
    probe = subprocess.run([str(python), "-c", HAS_DEPS], check=False,
                           capture_output=True, timeout=60)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip("this venv's layout cannot be borrowed by another bin/ directory")
    tmp, out = tmp_path / "tmp", tmp_path / "results"
    tmp.mkdir()
    proc = run_compare([str(python), str(SCRIPT), "--out", str(out)], timeout=50, env=dict(os.environ, TMPDIR=str(tmp)))
    line = assert_one_line_refusal(proc, tmp, out)
    assert "no accelerate or pulseloco command" in line and "no module" not in line
