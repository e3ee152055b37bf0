"""scripts/bench_verify.py: a small run on the tiny warm model writes the honest-margin table, and bad flags are
refused with a one-line error (the vLLM rows need vLLM's engine; tests/test_vllm.py replays vLLM's sampling)."""

from __future__ import annotations

import json
from pathlib import Path

import bench_verify as bv  # scripts/bench_verify.py (scripts/ is on the tests' path)
import pytest
import torch


def test_a_small_run_measures_the_honest_margin(tiny_warm_model: Path, tmp_path: Path) -> None:
    argv = ["--engines", "transformers", "--model_name_or_path", str(tiny_warm_model), "--prompts", "6"]
    argv += ["--samples", "4", "--max-new-tokens", "3", "--out", str(tmp_path)]
    assert bv.main(argv) == 0
    written = json.loads((tmp_path / "bench_verify.json").read_text())
    (row,) = written["rows"]
    assert row["engine"] == "transformers" and written["meta"]["device"] == "cpu"
    assert 6 * 4 <= row["positions"] <= 6 * 4 * 3  # at least one token per completion, at most three
    # an honest BF16 worker against the trainer's FP32 replay of the same BF16 values: at most rounding apart, and
    # within the BF16 tolerances
    assert row["precision"] == "bfloat16" and row["passed"] and row["max_gap"] < 0.1 < row["margin"]
    assert row["max_logprob_error"] < 0.25 and row["check_seconds"] > 0 and row["step_seconds"] > 0
    assert "| transformers |" in (tmp_path / "bench_verify.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engines", "sglang"], "--engines must name some of"),
        (["--prompts", "0"], "counts must be positive"),
        (["--device", "tpu"], "--device tpu: only cpu, or cuda"),
        *([] if torch.cuda.is_available() else [(["--trainer-device", "cuda"], "--trainer-device cuda: only cpu")]),
    ],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bv.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
