"""The demo's closing table (scripts/demo_report.py) says what RL gained and whether the run was in PULSE's sparse
regime, and the task's evaluation problems cover a small task exactly once (pulseloco/recipes/tasks.py).

The run directory is written here by hand, in the formats the recipes write (``grpo_eval.json``,
``trainer_state.json``, ``pulseloco_rounds.jsonl``), so every number in the report can be checked by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import demo_report  # scripts/demo_report.py (scripts/ is on the tests' path)
import pytest

from pulseloco.recipes import tasks


def test_small_task_is_scored_on_every_problem_once() -> None:
    add = tasks.TaskSpec(task="add", max_operand=9)
    everything = tasks.eval_problems(add, 256)
    assert len(everything) == 100 and len(set(everything)) == 100
    assert ("9+9=", "18") in everything and ("0+0=", "0") in everything
    assert tasks.eval_problems(add, 100) == everything
    sampled = tasks.eval_problems(add, 64)  # fewer asked than the task has: drawn with the fixed seed, as before
    assert len(sampled) == 64 and sampled == tasks.make_problems(add, 64, tasks.EVAL_SEED)
    sub = tasks.TaskSpec(task="sub", max_operand=9)
    assert len(tasks.eval_problems(sub, 256)) == 55  # a >= b
    assert all(int(p.split("-")[0]) - int(p.split("-")[1][:-1]) == int(a) for p, a in tasks.eval_problems(sub, 256))
    big = tasks.TaskSpec(task="add", max_operand=99)
    assert len(tasks.eval_problems(big, 256)) == 256  # 10,000 problems: a fixed sample of them


def _peer(run: Path, name: str, *, density: float, learning_rate: float, rewards: list[float]) -> None:
    peer = run / name
    peer.mkdir(parents=True)
    (peer / "grpo_eval.json").write_text(
        json.dumps({"reward_before": 0.5, "reward_after": 0.7, "seconds": 100.0, "num_eval_prompts": 100,
                    "sampled_reward_before": 0.41, "sampled_se_before": 0.012, "sampled_reward_after": 0.58,
                    "sampled_se_after": 0.011, "num_eval_samples": 8, "eval_temperature": 1.0})
    )  # fmt: skip
    history: list[dict[str, Any]] = [{"step": 8 * (i + 1), "reward": r, "learning_rate": learning_rate}
                                     for i, r in enumerate(rewards)]  # fmt: skip
    (peer / "trainer_state.json").write_text(json.dumps({"global_step": 8 * len(rewards), "log_history": history}))
    numel = 1000
    rounds = [
        {"round": i, "num_peers": 2, "numel": numel, "density": density, "bytes_sent": 100, "theta_digest": "d"}
        for i in range(len(rewards))
    ]
    (peer / "pulseloco_rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))


@pytest.mark.parametrize(("density", "where"), [(0.5, "ABOVE the sparse regime"), (0.01, "sparse regime")])
def test_report_says_what_rl_gained_and_the_regime(tmp_path: Path, density: float, where: str) -> None:
    for name in ("peer0", "peer1"):
        _peer(tmp_path, name, density=density, learning_rate=3e-5, rewards=[0.2, 0.3, 0.4, 0.6])
    text, data, _ = demo_report.build_report(tmp_path, seconds=None)
    se_before, se_after = math.sqrt(0.5 * 0.5 / 100), math.sqrt(0.7 * 0.3 / 100)
    assert (
        f"what RL gained: greedy reward 0.500 +- {se_before:.3f} -> 0.700 +- {se_after:.3f} (+0.200) on 100 problems"
        in text
    )
    assert "first quarter 0.200 -> last quarter 0.600 (+0.400)" in text  # 4 logs: a quarter is one log
    assert "held-out sampled reward (8 draws per problem): 0.410 +- 0.012 -> 0.580 +- 0.011 (+0.170)" in text
    rows = [line.rstrip() for line in text.splitlines() if line.startswith("peer0 ")]
    assert rows[0].endswith("0.500 -> 0.700")  # the reward table
    assert rows[1].endswith(f"{where} (lr 3e-05, {density:.1%}/round)")  # the bytes table
    assert data["peers"][0]["learning_rate"] == 3e-5


def test_report_without_evaluation_says_so(tmp_path: Path) -> None:
    _peer(tmp_path, "peer0", density=0.5, learning_rate=1e-4, rewards=[0.1])
    (tmp_path / "peer0" / "grpo_eval.json").unlink()
    text, _, ok = demo_report.build_report(tmp_path, seconds=None)
    assert "what RL gained: unknown (no peer wrote grpo_eval.json)" in text
    assert not ok


def test_the_checks_line_says_what_the_checks_added_beyond_the_forward_pass_trl_did_not_run() -> None:
    """A trainer's last ``verify`` record (cumulative): 12 s of checks, 8 s of them the first checks' forward pass,
    whose log-probabilities answered TRL's in 95 rounds, so the checks added 4 s to 200 s of training (2.0%); without
    shared forward passes everything counts; without the fields (older runs, or no checks) nothing is said."""
    verify = {
        "total_seconds": 12.0, "first_forward_seconds": 8.0, "shared_forwards": 95, "completions": 1000,
        "shared_completions": 990, "failed_leases": 0, "worst_passing_gap": 0.25,
    }  # fmt: skip
    checks = demo_report.check_summary(verify, 200.0)
    assert checks is not None and checks["added_seconds"] == 4.0 and checks["added_share"] == pytest.approx(0.02)
    line = demo_report.check_lines("peer0", checks)[0]
    assert "99% passed with the trainer's weights" in line and "answered TRL's in 95 rounds" in line
    assert "added beyond it 4.0 s = 2.0% of 200 s of training" in line
    unshared = demo_report.check_summary({**verify, "shared_forwards": 0}, 200.0)
    assert unshared is not None and unshared["added_seconds"] == 12.0
    assert demo_report.check_summary(None, 200.0) is None and demo_report.check_lines("peer0", None) == []
    assert demo_report.check_summary({"total_seconds": 3.0}, 200.0) is None
