"""scripts/warm_model.py and its library scripts/harness/warm.py: the tiny warm model is a real Hugging Face
checkpoint, cached and reused.

The model itself comes from the session fixture ``tiny_warm_model`` (tests/conftest.py), built once into a
temporary cache; these tests check what it holds, that a second call reuses it, that a directory without the
completion marker is rebuilt, and that an unusable cache directory ends with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import warm

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "warm_model.py"


def run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        check=False,
    )


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout.strip().splitlines()[-1]


def test_tiny_warm_model_is_a_hugging_face_checkpoint(tiny_warm_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert tiny_warm_model.is_absolute()
    assert tiny_warm_model.name == f"warm-tiny-{warm.SIZES['tiny'].digest()}"
    assert (tiny_warm_model / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tiny_warm_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_warm_model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert tokenizer.chat_template is None

    for text in ("37+45=", "37+45=82", "def f(x):\n    return x  # é"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text.encode())  # one token per byte
        assert tokenizer.decode(ids) == text
        padded = [tokenizer.pad_token_id, *ids, tokenizer.eos_token_id, tokenizer.pad_token_id]
        assert tokenizer.decode(padded, skip_special_tokens=True) == text


def test_marker_records_the_build(tiny_warm_model: Path) -> None:
    marker = json.loads((tiny_warm_model / warm.MARKER).read_text())
    spec = warm.SIZES["tiny"]
    assert marker["task"] == spec.task and marker["max_operand"] == spec.max_operand
    assert marker["settings"]["pretrain_steps"] == spec.pretrain_steps
    assert marker["hash"] == spec.digest()
    curve = marker["pretrain"]["loss_curve"]
    assert len(curve) >= 5 and curve[-1][0] == spec.pretrain_steps
    assert curve[-1][1] < curve[0][1] - 1.0  # pretraining learned something...
    tail = [loss for _, loss in curve[-3:]]
    assert max(tail) - min(tail) < 0.25  # ...and has flattened
    assert 0.0 < marker["reward"] < 1.0  # some problems right, room for GRPO
    assert 0.003 < marker["median_abs_weight"] < 0.1  # pretrained-like scale (init std 0.02; tiny: 0.046)
    assert marker["seconds"] > 0 and marker["num_parameters"] > 50_000


def test_reward_in_marker_is_the_saved_models(tiny_warm_model: Path) -> None:
    """Greedy decoding of the saved weights reproduces the reward the build measured (nothing lost on saving)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_warm_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_warm_model)
    marker = warm.read_marker(tiny_warm_model)
    reward, _ = warm.greedy_reward(model, tokenizer, warm.SIZES["tiny"])
    assert reward == marker["reward"]


def test_second_call_reuses_the_cached_model(tiny_warm_model: Path) -> None:
    marker = tiny_warm_model / warm.MARKER
    before = marker.stat().st_mtime_ns
    result = run_script("--size", "tiny", "--cache-dir", str(tiny_warm_model.parent.parent), timeout=120)
    assert result.returncode == 0, result.stderr
    assert last_line(result) == f"warm model: {tiny_warm_model}"
    assert "building" not in result.stdout and "pretrain step" not in result.stdout
    assert marker.stat().st_mtime_ns == before


def test_directory_without_marker_is_rebuilt(tiny_warm_model: Path) -> None:
    """A killed build's leftovers (a half-written model directory, a temporary directory) are not reused: the
    session fixture planted both in its cache before building (tests/conftest.py)."""
    models = tiny_warm_model.parent
    build_log = (models.parent / "build.log").read_text()
    assert "building" in build_log
    assert build_log.strip().splitlines()[-1] == f"warm model: {tiny_warm_model}"
    assert warm.is_complete(tiny_warm_model)
    json.loads((tiny_warm_model / "config.json").read_text())
    assert not list(models.glob(f".{tiny_warm_model.name}.tmp-*"))


@pytest.mark.parametrize("make_cache", ["a_file", "under_a_file"])
def test_unusable_cache_dir_is_one_line(tmp_path: Path, make_cache: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    cache = blocker if make_cache == "a_file" else blocker / "cache"
    result = run_script("--size", "tiny", "--cache-dir", str(cache), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("warm_model.py: error: cannot write the cache directory")
    assert "--cache-dir" in lines[0]


def test_terminated_build_leaves_nothing_that_looks_complete(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--size", "tiny", "--cache-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # terminate it as pretraining starts (the model and data made, nothing saved)
            if "pretraining a " in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_a_stop_whose_exit_a_finalizer_swallowed_still_stops_before_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM handler runs between any two bytecodes, also inside a ``__del__``, where Python drops its
    ``SystemExit``: the request it leaves stops the build before its model goes into the cache."""

    def build_through_a_swallowed_exit(size: str, spec: warm.WarmSpec, tmp: Path) -> dict[str, object]:
        with contextlib.suppress(SystemExit):  # the handler, with its exit dropped as a finalizer drops it
            warm.request_stop(143)
        (tmp / warm.MARKER).write_text("{}")  # the build went on to the end
        return {}

    monkeypatch.setattr(warm, "STOP_REQUESTS", [])
    monkeypatch.setattr(warm, "build", build_through_a_swallowed_exit)
    with pytest.raises(SystemExit) as exc:
        warm.warm_model("tiny", cache_dir=tmp_path)
    assert exc.value.code == 143
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("size", ["demo", "wide"])
def test_larger_sizes_build_and_load_reduced(tmp_path: Path, size: str) -> None:
    """The demo and sparse-regime sizes, built with their shapes and task but a few steps (the full builds take
    minutes: scripts/warm_model.py --size demo|wide), are Hugging Face checkpoints of that shape, scored on the task."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    spec = warm.SIZES[size]
    reduced = dataclasses.replace(spec, pretrain_steps=3, warmup_steps=1, max_bytes=100_000, sft_steps=2,
                                  sft_examples=64)  # fmt: skip
    marker = warm.build(size, reduced, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.hidden_size == spec.hidden_size
    assert model.config.num_hidden_layers == spec.num_hidden_layers
    assert marker["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert marker["max_operand"] == spec.max_operand == 9
    assert marker["num_eval_problems"] == 100  # single-digit sums: every problem scored
    assert 0.0 <= marker["reward"] <= 1.0
    assert warm.read_marker(tmp_path)["size"] == size
