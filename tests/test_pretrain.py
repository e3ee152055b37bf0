"""recipes/pretrain.py through ``accelerate launch``: Hugging Face checkpoints in, Hugging Face checkpoints out.

Runs a few ``--strategy ddp`` steps from the tiny warm model (one process, and two CPU processes with gloo),
``--strategy pulseloco`` in two processes, a from-scratch run of ``recipes/configs/pretrain-tiny.yaml`` and one
from a ``--model_config``, and checks that bad configurations end with one line. The two-process runs are real
launches; the one-process runs and the bad configurations call the recipe's entry point in this process
(:func:`in_process`: the code a one-process launch runs after the launcher, without a process that spends its
seconds importing torch and transformers; tests/test_recipes.py checks through a real ``accelerate launch`` that
the launcher adds nothing to a recipe's one-line error). Every launch uses an accelerate config file from
``recipes/accelerate_configs/`` (which must keep accelerate from warning about defaults) and ``-q``, without
which accelerate adds its own traceback when the script exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from recipe_helpers import run_in_process

from pulseloco.jsonl import read_json_lines

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
PRETRAIN = RECIPES / "pretrain.py"
TINY = RECIPES / "configs" / "pretrain-tiny.yaml"
MULTI_CPU = RECIPES / "accelerate_configs" / "multi_process_cpu.yaml"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]  # `accelerate launch`, as in test_recipes.py
RUN_TIMEOUT_S = 240.0
"""Upper bound for one launch (they take 10-30 s on an idle two-core machine)."""
SMALL_DATA = ["--max_bytes", "200000", "--max_steps", "6", "--logging_steps", "2"]


def launch(accelerate_config: Path, *args: str, output_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [*ACCELERATE, "-q", "--config_file", str(accelerate_config), str(PRETRAIN), "--config", str(TINY)]
    argv += list(args)
    if output_dir is not None:
        argv += ["--output_dir", str(output_dir)]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        check=False,
    )


def in_process(capfd: pytest.CaptureFixture[str], *args: str, output_dir: Path) -> subprocess.CompletedProcess[str]:
    """The recipe's entry point in this process (tests/recipe_helpers.py): what the script runs after the launcher,
    without a process that spends its seconds importing torch and transformers."""
    _, pretrain = _recipe_modules()
    argv = ["--config", str(TINY), *args, "--output_dir", str(output_dir)]
    return run_in_process(capfd, "pretrain.py", lambda: pretrain.main(argv))


def _recipe_modules() -> tuple[Any, Any]:
    """pulseloco/recipes/common.py and pulseloco/recipes/pretrain.py as modules."""
    from pulseloco.recipes import common, pretrain

    return common, pretrain


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    log = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, log
    assert "Traceback" not in result.stderr, log
    assert "were not passed to `accelerate launch`" not in result.stderr, log  # the config file names every value
    assert "pretrain.py: done steps=6" in result.stdout, log


def load(path: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def assert_trained_from(out: Path, start: Path) -> None:
    model, tokenizer = load(out)
    warm, warm_tokenizer = load(start)
    assert model.config.to_dict()["hidden_size"] == warm.config.hidden_size
    assert tokenizer("37+45=")["input_ids"] == warm_tokenizer("37+45=")["input_ids"]
    changed = [
        name
        for (name, p), (_, q) in zip(model.named_parameters(), warm.named_parameters(), strict=True)
        if not torch.equal(p, q)
    ]
    assert changed, "training changed no weight"


def test_single_process_from_warm_model(
    tiny_warm_model: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    result = in_process(capfd, "--model_name_or_path", str(tiny_warm_model), "--strategy", "ddp", *SMALL_DATA,
                        output_dir=out)  # fmt: skip
    assert_ok(result)
    assert "processes=1" in result.stdout
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert_trained_from(out, tiny_warm_model)


def test_two_processes_ddp_from_warm_model(tiny_warm_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = launch(MULTI_CPU, "--model_name_or_path", str(tiny_warm_model), "--strategy", "ddp", *SMALL_DATA,
                    output_dir=out)  # fmt: skip
    assert_ok(result)
    assert "processes=2" in result.stdout
    assert_trained_from(out, tiny_warm_model)


def test_two_processes_pulseloco_report_the_main_process_rounds(tmp_path: Path) -> None:
    """``--strategy pulseloco`` under a two-process launch: only rank 0 is in the swarm, and its rounds reach the
    Trainer's logs (TensorBoard, written by rank 0 alone) once each, as in its rounds file."""
    from tensorboard_helpers import scalars

    out = tmp_path / "out"
    swarm = ["--strategy", "pulseloco", "--inner_steps", "2", "--target_group_size", "1", "--linger", "0"]
    swarm += ["--matchmaking_time", "1"]  # alone in its swarm: no one to wait for
    assert_ok(launch(MULTI_CPU, *SMALL_DATA, *swarm, output_dir=out))
    rounds = read_json_lines(out / "pulseloco_rounds.jsonl")
    assert [r["round"] for r in rounds] == [0, 1, 2]  # written by rank 0 only
    assert len({path.name.split(".")[-2] for path in (out / "tensorboard").iterdir()}) == 1  # one process's pid
    series = scalars(out / "tensorboard")
    assert series["train/pulseloco/round"] == [(2, 0), (4, 1), (6, 2)]  # logging_steps 2 = inner_steps
    for name in ("density", "num_peers", "num_contributors", "bytes_sent"):
        assert [value for _, value in series[f"train/pulseloco/{name}"]] == pytest.approx([r[name] for r in rounds])


def test_from_scratch_with_the_tiny_config(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """No model: one is built from the config's sizes with the byte-level tokenizer, and saved with it (the
    recipe in this process; the launches above run it under ``accelerate launch``)."""
    out = tmp_path / "out"
    assert_ok(in_process(capfd, *SMALL_DATA, output_dir=out))
    model, tokenizer = load(out)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert tokenizer.decode(tokenizer("37+45=")["input_ids"]) == "37+45="
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == 258
    from tensorboard_helpers import scalars

    assert "train/loss" in scalars(out / "tensorboard")  # the config's report_to, in <output_dir>/tensorboard


def test_from_a_model_config(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True,
    ).save_pretrained(tmp_path / "qwen")  # fmt: skip
    out = tmp_path / "out"
    assert_ok(in_process(capfd, "--model_config", str(tmp_path / "qwen" / "config.json"), *SMALL_DATA, output_dir=out))
    model, _ = load(out)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 32


def _not_a_causal_lm(tmp_path: Path) -> str:
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(
        tmp_path / "vit"
    )
    return str(tmp_path / "vit")


BAD_CONFIGURATIONS = {
    "unknown_flag": "--no_such_flag",
    "missing_model": "does not exist",
    "not_a_causal_lm": "not a causal language model",
    "no_config_json": "has no config.json",
    "bad_strategy": "unknown strategy",
    "bad_value": "invalid int value",
}


def test_bad_configurations_are_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Each case through the recipe's own entry point in this process (the same code after the launcher; a process
    each would spend its seconds importing torch and transformers)."""
    args = {
        "unknown_flag": ["--no_such_flag", "1"],
        "missing_model": ["--model_name_or_path", str(tmp_path / "no" / "such" / "model")],
        "not_a_causal_lm": ["--model_name_or_path", _not_a_causal_lm(tmp_path)],
        "no_config_json": ["--model_name_or_path", str(tmp_path)],
        "bad_strategy": ["--strategy", "allreduce"],
        "bad_value": ["--max_steps", "many"],
    }
    outs = {case: tmp_path / f"out-{case}" for case in BAD_CONFIGURATIONS}
    stderr = {}
    common, _ = _recipe_modules()
    for case in BAD_CONFIGURATIONS:
        result = in_process(capfd, *args[case], output_dir=outs[case])
        assert result.returncode == common.EXIT_CONFIG_ERROR, case
        stderr[case] = result.stderr
    for case, expected in BAD_CONFIGURATIONS.items():
        lines = stderr[case].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pretrain.py: error: "), (case, stderr[case][-3000:])
        assert expected in lines[0], (case, lines[0])
        assert not outs[case].exists(), case


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*deprecated:FutureWarning")
@pytest.mark.parametrize("config", ["pretrain-tiny.yaml", "llama-1b-pretrain.yaml"])
def test_configs_parse(config: str) -> None:
    """Every shipped config parses (the 1B one needs a GPU and the hub to run, not to parse; transformers refuses
    its ``bf16: true`` on a machine without a GPU, so that one key is overridden here)."""
    from transformers import TrainingArguments

    from pulseloco.integrations.args import PulseLoCoArguments
    from pulseloco.recipes import common, pretrain

    model_args, data_args, training_args, pulse_args = common.parse_args(
        (pretrain.ModelArguments, pretrain.DataArguments, TrainingArguments, PulseLoCoArguments),
        ["--config", str(RECIPES / "configs" / config), *(["--bf16", "false"] if "1b" in config else [])],
        "pretrain.py",
    )
    assert training_args.disable_tqdm and training_args.report_to == ["tensorboard"]
    assert data_args.seq_len <= model_args.max_position_embeddings
    if config == "llama-1b-pretrain.yaml":
        assert model_args.tokenizer_name_or_path == "meta-llama/Llama-3.2-1B"
        assert (model_args.hidden_size, model_args.num_hidden_layers, model_args.num_key_value_heads) == (2048, 16, 8)
        assert pulse_args.strategy == "pulseloco" and training_args.max_steps % pulse_args.inner_steps == 0
    else:
        assert pulse_args.strategy == "ddp" and model_args.model_name_or_path is None
