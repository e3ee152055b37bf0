"""experiments/attacks/bench_attacks.py: a small run on the tiny warm model, and bad flags refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import bench_attacks as ba  # experiments/attacks/bench_attacks.py (on the tests' path: pyproject.toml)
import pytest


def test_a_small_run_refuses_the_steering_worker_and_not_the_honest_one(tiny_warm_model: Path, tmp_path: Path) -> None:
    argv = ["--attacks", "honest,steer-wrong,forged-within", "--model_name_or_path", str(tiny_warm_model)]
    argv += ["--leases", "2", "--prompts", "8", "--samples", "8", "--out", str(tmp_path)]
    assert ba.main(argv) == 0
    rows = {r["attack"]: r for r in json.loads((tmp_path / "bench_attacks.json").read_text())["rows"]}
    honest, steer, forged = rows["honest"], rows["steer-wrong"], rows["forged-within"]
    # the honest worker is never refused: what did not pass was held back on probation (generated again)
    assert honest["refused_at"] is None and honest["differ_share"] == 0.0
    assert honest["passed"] + honest["held_back"] == honest["completions"] and honest["probation_leases"] >= 1
    assert honest["held_back_share"] <= 0.25, honest
    assert steer["refused_at"] == 1 and steer["passed"] == 0
    assert forged["refused_at"] is None and forged["worst_logprob_change"] == 0.0
    assert "| steer-wrong |" in (tmp_path / "bench_attacks.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--attacks", "bribe"], "--attacks must name some of"), (["--leases", "0"], "counts must be positive")],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        ba.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
