"""experiments/sparsity/sparsity_study.py: the sparsity and mechanism computations (experiments/sparsity/sparsity.py) on
hand-made tensors (fast), and a smoke run end to end on the tiny warm model (TRL GRPO in process, two learning rates,
both precisions, a few steps).

The smoke run checks what must hold whatever the numbers: the outputs exist, every S is a fraction, the minimum is
at most the mean, the changed set over k steps is within the union of the per-step changed sets, and FP32 master
weights change more BF16 values per step at the larger learning rate.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sparsity
import sparsity_study  # experiments/sparsity/sparsity_study.py (on the tests' path: pyproject.toml)
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "sparsity" / "sparsity_study.py"

PNG = b"\x89PNG\r\n\x1a\n"


def bf16(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def test_k_step_sparsity_counts_bitwise_equal_entries() -> None:
    snapshots = [
        bf16([1.0, 2.0, 3.0, 4.0, 0.0]),
        bf16([1.0, 2.5, 3.0, 4.0, -0.0]),  # -0.0 is another bit pattern: changed
        bf16([1.0, 2.0, 3.0, 5.0, -0.0]),
        bf16([1.0, 2.0, 3.0, 5.0, -0.0]),
    ]
    s = sparsity.k_step_sparsity(snapshots, [1, 2, 3])
    assert s[1] == [3 / 5, 3 / 5, 1.0]
    assert s[2] == [3 / 5, 3 / 5]  # t=0 -> 2: entries 3 and 4 differ; entry 1 went 2 -> 2.5 -> 2 (back)
    assert s[3] == [3 / 5]
    # one ulp of bf16 is 2^-7 at 1.0: 1 + 2^-9 rounds back to 1.0, the BF16 view does not change
    fp32 = torch.tensor([1.0, 1.0 + 2**-9, 1.0 + 2**-7])
    view = sparsity.bf16_view([fp32])
    assert sparsity.k_step_sparsity([bf16([1.0, 1.0, 1.0]), view], [1])[1] == [2 / 3]
    with pytest.raises(ValueError, match=r"k must be in 1\.\.3"):
        sparsity.k_step_sparsity(snapshots, [4])
    with pytest.raises(ValueError, match="bfloat16"):
        sparsity.k_step_sparsity([torch.zeros(3), torch.zeros(3)], [1])


def test_mechanism_bins_ratio_and_changed_fraction() -> None:
    weight = torch.tensor([1.0, 1.0, 1.0, 2.56, 0.0, 1.0])
    update = torch.tensor([0.0, 1 / 256, 10 / 256, 0.0001, 1e-9, 1e6])
    r, index = sparsity.ratio_bins(update, weight)
    assert r[0] == 0 and r[1] == pytest.approx(1.0) and r[2] == pytest.approx(10.0) and r[3] == pytest.approx(0.01)
    assert math.isinf(r[4])
    edges = sparsity.RATIO_EDGES
    assert index[0] == 0 and index[4] == sparsity.NUM_BINS - 1 and index[5] == sparsity.NUM_BINS - 1
    for i in (1, 2, 3):  # each r lies in its bin
        assert edges[int(index[i])] * (1 - 1e-9) <= r[i] < edges[int(index[i]) + 1]
    changed = torch.tensor([False, True, True, False, True, True])
    rec = sparsity.step_mechanism(update, weight, changed)
    assert sum(rec["total"]) == 6 and sum(rec["changed"]) == 4
    assert rec["frac_r_ge_1"] == pytest.approx(4 / 6)
    assert sparsity.band_density(rec["total"], rec["changed"], 1, math.inf) == 1.0
    assert sparsity.band_density(rec["total"], rec["changed"], 0, 0.1) == 0.0  # r = 0 and r = 0.01
    assert sparsity.band_density(rec["total"], rec["changed"], 0.1, 1) is None


def test_adam_update_rebuilds_the_step_torch_takes() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=False)
    for _ in range(3):
        before = sparsity.flat_float(params)
        opt.zero_grad()
        (params[0].sin().sum() + (params[1] ** 2).sum()).backward()
        opt.step()
        exact = sparsity.flat_float(params) - before
        rebuilt = sparsity.adam_update(opt, params, before)
        assert rebuilt is not None
        torch.testing.assert_close(rebuilt, exact, rtol=1e-4, atol=1e-8)
    assert sparsity.adam_update(torch.optim.SGD(params, lr=0.1), params, before) is None


def test_error_feedback_rounds_by_hand() -> None:
    # at 1.5 a BF16 unit in the last place is 2^-7 = 0.0078: a value moves in BF16 once it moves by about 0.0039
    start = torch.tensor([1.5, 1.5, 1.5, 1.5])
    end = torch.tensor([1.497, 1.49, 1.5, 1.501])  # round 1 changes 0.003, 0.01, 0, -0.001
    density, residual = sparsity.error_feedback_round(start, end, torch.zeros(4))
    assert density == 1 / 4  # only 1.49 is another BF16 value (1.4921875)
    assert residual.tolist() == pytest.approx([0.003, 0.0, 0.0, -0.001], abs=1e-6)
    later = torch.tensor([1.4965, 1.49, 1.5, 1.501])  # round 2 moves entry 0 by 0.0005: 1.497 and 1.4965 are both
    assert sparsity.bf16_view([later])[0] == sparsity.bf16_view([end])[0] == 1.5  # 1.5 in BF16, so 1 - S = 0 ...
    density, residual = sparsity.error_feedback_round(end, later, residual)
    assert density == 1 / 4  # ... but with the 0.003 owed from round 1 its signal 0.0035 is visible: sent
    assert residual.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.001], abs=1e-6)
    run = {"density_per_round_ef": [0.5, 0.1, 0.2, 0.3, 0.4]}
    import sparsity_report

    assert sparsity_report.late_round_density_ef(run) == pytest.approx(0.4)  # 5 rounds: the last one
    assert sparsity_report.late_round_density_ef({"density_per_round_ef": []}) is None
    assert sparsity_report.late_round_density_ef({}) is None  # a sparsity.json written before the field


def test_report_quarters_and_late_windows_by_hand() -> None:
    import sparsity_report

    assert sparsity_report.mean_and_se([]) is None
    assert sparsity_report.mean_and_se([0.5]) == (0.5, 0.0)
    mean, se = sparsity_report.mean_and_se([1.0, 2.0, 3.0, 6.0])  # sample sd sqrt(14/3)
    assert mean == 3.0 and se == pytest.approx(math.sqrt(14 / 3) / 2)
    # 8 steps: the first quarter is steps 1-2, the last 7-8; step 0 and unlogged steps count nowhere
    run = {"rewards": [(1, 0.1), (2, 0.3), (5, 0.9), (7, 0.5), (8, 0.7)], "S": {"4": {"per_window": [0.9] * 4 + [0.5]}}}
    first, last = sparsity_report.reward_quarters(run, 8)
    assert first == pytest.approx((0.2, 0.1)) and last == pytest.approx((0.6, 0.1))
    assert sparsity_report.reward_quarters({"rewards": [(5, 1.0)]}, 8) == (None, None)
    assert sparsity_report.late_window_density(run, 4) == pytest.approx(0.5)  # 5 windows: the last one
    run["S"]["4"]["per_window"] = [1.0] * 4 + [0.8, 0.6, 0.8, 0.6]  # 8 windows: the last 2
    assert sparsity_report.late_window_density(run, 4) == pytest.approx(0.3)


def test_flags_are_validated(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--steps", "8", "--ks", "1,8"], "must be larger than the largest k"),
        (["--lrs", "1e-6,-1"], "positive"),
        (["--lrs", "abc"], "comma-separated list"),
        (["--precisions", "fp16"], "unknown fp16"),
        (["--model_name_or_path", "/nonexistent", "--warm-size", "demo"], "not allowed with"),
        (["--", "--learning_rate", "1"], "set by the study"),
    ):
        with pytest.raises(SystemExit) as exc:
            sparsity_study.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    args = sparsity_study.parse_args(["--lrs", "3e-6,1e-6,3e-6", "--ks", "4,2", "--precisions", "bf16,fp32"])
    assert args.lrs == [1e-6, 3e-6] and args.ks == [1, 2, 4] and args.precisions == ["fp32", "bf16"]


@pytest.mark.timeout(600)  # with the session's tiny warm model build on first use: 35 s idle, minutes when busy
def test_smoke_run_on_tiny_warm_model(tiny_warm_model: Path, tmp_path: Path) -> None:
    out, report_path = tmp_path / "results", tmp_path / "copy.json"
    steps, ks, lrs = 6, [1, 2, 4], [1e-6, 1e-4]
    argv = [sys.executable, str(SCRIPT), "--model_name_or_path", str(tiny_warm_model), "--lrs", "1e-6,1e-4"]
    argv += ["--precisions", "fp32,bf16", "--steps", str(steps), "--ks", "1,2,4", "--out", str(out)]
    argv += ["--json", str(report_path)]
    proc = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=220, check=False, env=dict(os.environ)
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stderr.count("S_1 mean") == 4  # one progress line per run

    md = (out / "sparsity.md").read_text()
    assert "| precision | lr | S_1 mean | S_1 min | S_2 mean (min) | S_4 mean (min) |" in md
    assert "## What the data say" in md and "Command:" in md
    assert "| 1-S_4, last quarter (%) | per round of 4 with error feedback, last quarter (%) |" in md
    assert "± the standard error of the difference" in md and "density per round of 4 steps with error feedback" in md
    for png in ("sparsity_ratio.png", "sparsity_k.png"):
        assert (out / png).read_bytes()[:8] == PNG
    report = json.loads((out / "sparsity.json").read_text())
    assert json.loads(report_path.read_text()) == report
    assert report["settings"]["ks"] == ks and report["settings"]["steps"] == steps
    assert report["model"]["num_parameters"] > 0 and report["model"]["median_abs_weight"] > 0
    runs = {(r["precision"], r["lr"]): r for r in report["runs"]}
    assert set(runs) == {(p, lr) for p in ("fp32", "bf16") for lr in lrs}

    for (precision, lr), run in runs.items():
        assert len(run["density_per_step"]) == steps and len(run["step_seconds"]) == steps
        # entries that never changed are unchanged in every window
        assert 0.0 <= run["never_changed"] <= min(min(s["per_window"]) for s in run["S"].values())
        assert run["rewards"], "TRL logged no reward"
        for k in ks:
            s = run["S"][str(k)]
            assert len(s["per_window"]) == steps - k + 1
            assert all(0.0 <= x <= 1.0 for x in s["per_window"])
            assert s["min"] <= s["mean"] <= s["max"]
            # guaranteed: what changed from t to t+k changed in one of the k steps between
            per_step = run["S"]["1"]["per_window"]
            for t, x in enumerate(s["per_window"]):
                assert 1 - x <= sum(1 - y for y in per_step[t : t + k]) + 1e-9, (precision, lr, k, t)
        means = [run["S"][str(k)]["mean"] for k in ks]
        # on average S_k falls with k (updates keep their sign under Adam); a reversal would be a tiny one
        assert all(b <= a + 1e-3 for a, b in itertools.pairwise(means)), (precision, lr, means)
        # one round of 4 steps: nothing owed yet, so error feedback sends exactly what changed in BF16 over it
        assert run["round_steps"] == 4 and len(run["density_per_round_ef"]) == 1
        assert run["density_per_round_ef"][0] == pytest.approx(1 - run["S"]["4"]["per_window"][0], abs=1e-6)
        assert run["mechanism"] is not None
        assert sum(run["mechanism"]["total"]) == steps * report["model"]["num_parameters"]
        if precision == "fp32":
            assert run["adam_rebuild_rel_error"]["max"] < 0.05
    small, large = (1 - runs[("fp32", lr)]["S"]["1"]["mean"] for lr in lrs)
    assert large >= small and large > 0
