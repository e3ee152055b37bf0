"""The warm models: small causal LMs in Hugging Face format, pretrained and then supervised, built once and cached.

``scripts/warm_model.py`` is the command line of this module (its last line ``warm model: DIR`` is what the other
scripts read); the tests import the module itself (:data:`SIZES`, :func:`build`, :func:`greedy_reward`).

PULSE's observation holds for *pretrained* weights; offline there are none to download, so this module makes them.
For the settings of a size (:data:`SIZES`):

1. pretraining: a Llama with random weights (seeded, initializer std 0.02) trained as a causal LM with
   transformers' ``Trainer`` on the Python standard library's sources, with recipes/pretrain.py's byte-level
   tokenizer, data and model code, until the loss has flattened;
2. a supervised warm-up with TRL's ``SFTTrainer`` on the arithmetic task of ``pulseloco/recipes/tasks.py`` (prompt
   ``"37+45="``, completion ``"82"`` then eos), short enough that greedy decoding answers only some held-out
   problems: GRPO afterwards has room to improve it.

The model goes to ``<cache>/models/warm-<size>-<hash>`` (cache: ``cache_dir``, else ``$PULSELOCO_CACHE``, else
``~/.cache/pulseloco``); the hash covers every setting that affects the weights. It is built in a temporary
sibling directory and moved into place at the end, with ``pulseloco_warm.json`` written last: the settings, the
task (``task``, ``max_operand``: GRPO must use the same), the loss curves, the greedy exact-match reward after the
warm-up and the seconds taken. A directory without that file is incomplete and is rebuilt. Concurrent calls for
the same model wait for one build (a lock file). torch, transformers and TRL load inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROG = "warm_model.py"
MARKER = "pulseloco_warm.json"
"""Written last into a complete model directory; its absence means the directory is incomplete."""
RECIPE_VERSION = 1
"""Part of the hash: raise it when the procedure below changes the weights for the same settings."""
NUM_EVAL_PROBLEMS = 256


@dataclass(frozen=True, kw_only=True)
class WarmSpec:
    """Every setting that affects the weights of a warm model (all of them go into its directory's hash)."""

    # model: a Llama (byte-level vocabulary of 258)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 256
    # phase 1: causal-LM pretraining on the Python standard library's sources
    pretrain_steps: int
    batch_size: int
    seq_len: int = 128
    learning_rate: float
    warmup_steps: int
    max_bytes: int = 2_000_000
    # phase 2: supervised warm-up on the arithmetic task
    task: str = "add"
    max_operand: int
    sft_steps: int
    sft_batch_size: int = 32
    sft_learning_rate: float
    sft_examples: int = 4096
    seed: int = 0

    def digest(self) -> str:
        """Ten hex digits of the SHA-256 of every setting and :data:`RECIPE_VERSION` (the directory's name)."""
        settings = {"recipe_version": RECIPE_VERSION, **dataclasses.asdict(self)}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


SIZES: dict[str, WarmSpec] = {
    # for tests: 0.12M parameters, built by every suite run (about 36 CPU-s on one thread; docs/results.md)
    "tiny": WarmSpec(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        pretrain_steps=300, batch_size=16, learning_rate=3e-3, warmup_steps=30, max_bytes=1_000_000,
        max_operand=9, sft_steps=80, sft_learning_rate=3e-3,
    ),
    # for scripts/demo.sh: 1.64M parameters, wide and shallow; single-digit sums (100 problems, all of them scored);
    # the build is not bit-reproducible across machines (its greedy reward and build time: docs/results.md)
    "demo": WarmSpec(
        hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        pretrain_steps=500, batch_size=16, learning_rate=2e-3, warmup_steps=50,
        max_operand=9, sft_steps=100, sft_learning_rate=2e-3,
    ),
    # for the sparse regime: 9.18M parameters, wide and shallow, where each weight moves little per step while a
    # pre-activation sums 1024 of them; single-digit sums (its greedy reward and build time: docs/results.md);
    # experiments/sparsity/sparsity_study.py --warm-size wide
    "wide": WarmSpec(
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
        pretrain_steps=400, batch_size=16, learning_rate=1.5e-3, warmup_steps=40,
        max_operand=9, sft_steps=140, sft_learning_rate=1e-3,
    ),
    # for experiments/compare/compare.py: 9.5M parameters; 12.5 min, greedy reward 0.19
    "compare": WarmSpec(
        hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
        pretrain_steps=900, batch_size=16, learning_rate=1e-3, warmup_steps=90, max_bytes=4_000_000,
        max_operand=19, sft_steps=100, sft_learning_rate=1e-3,
    ),
}  # fmt: skip
"""The sizes ``scripts/warm_model.py --size`` builds, by name."""


class BuildError(Exception):
    """Something the user must fix (the message says what); ``scripts/warm_model.py`` reports it as one line."""


def say(message: str) -> None:
    """A progress line ``warm_model.py: MESSAGE`` on stdout (the last stdout line is the model's directory)."""
    print(f"{PROG}: {message}", flush=True)


def default_cache_dir() -> Path:
    """``$PULSELOCO_CACHE``, else ``~/.cache/pulseloco`` (not created here)."""
    return Path(os.environ.get("PULSELOCO_CACHE") or Path.home() / ".cache" / "pulseloco")


def is_complete(path: Path) -> bool:
    """A finished warm model: its marker is readable JSON (written last, after every weight and tokenizer file)."""
    try:
        return isinstance(json.loads((path / MARKER).read_text()), dict)
    except (OSError, ValueError):
        return False


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``pulseloco_warm.json`` of a warm model directory (settings, task, curves, reward, seconds). Raises
    ``OSError`` when it cannot be read and ``ValueError`` when it is not JSON (see :func:`is_complete`)."""
    return dict(json.loads((Path(path) / MARKER).read_text()))


@contextlib.contextmanager
def build_lock(models_dir: Path, name: str) -> Iterator[None]:
    """Held while one process builds ``name``; others wait here (without a timeout), then find it complete.
    Raises ``OSError`` when the lock file cannot be created in ``models_dir``."""
    with (models_dir / f".{name}.lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---- the two phases ------------------------------------------------------------------------------------------


STOP_REQUESTS: list[int] = []
"""Exit codes a signal handler asked a build for (:func:`request_stop`); the build checks them at every training step
and before its model goes into the cache."""


def request_stop(code: int) -> None:
    """Ask a running build to stop with exit ``code`` and raise ``SystemExit(code)`` (for a signal handler). Python
    runs a handler between any two bytecodes, also inside a finalizer (``__del__``), where it prints the exception
    and drops it: the request stays, and the build exits at its next training step or, at the latest, before it
    moves its model into the cache (:func:`check_stop`)."""
    STOP_REQUESTS.append(code)
    raise SystemExit(code)


def check_stop() -> None:
    """Raise ``SystemExit`` with the first requested code if :func:`request_stop` was called; else nothing."""
    if STOP_REQUESTS:
        raise SystemExit(STOP_REQUESTS[0])


def _progress_callback(phase: str, total_steps: int, started: float) -> Any:
    """A ``TrainerCallback`` that prints one :func:`say` line per logging step (loss, eval loss, seconds) and stops
    the build at a step end when a stop was requested (:func:`check_stop`)."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):  # one short line per logging step, instead of dicts or tqdm bars
        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            check_stop()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
            logs = logs or {}
            parts = [f"{key}={logs[key]:.4f}" for key in ("loss", "eval_loss") if key in logs]
            if parts:
                elapsed = time.monotonic() - started
                say(f"{phase} step {state.global_step}/{total_steps} {' '.join(parts)} ({elapsed:.0f} s)")

    return Progress()


def _quiet(trainer: Any, callback: Any) -> None:
    """Replace the trainer's printed log dicts with ``callback``'s lines."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(callback)


def _curve(log_history: list[dict[str, Any]], key: str) -> list[list[float]]:
    """``[step, value]`` of every log entry that has ``key`` (rounded to 4 digits)."""
    return [[entry["step"], round(float(entry[key]), 4)] for entry in log_history if key in entry]


def _common_training_args(spec: WarmSpec, steps: int) -> dict[str, Any]:
    """The training arguments both phases share: cosine schedule, CPU, no checkpoints, no trackers, the seed."""
    return {
        "max_steps": steps,
        "lr_scheduler_type": "cosine",
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "logging_steps": max(1, steps // 20),
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": spec.seed,
        "data_seed": spec.seed,
        "dataloader_pin_memory": False,
    }


def pretrain_phase(spec: WarmSpec, run_dir: Path) -> tuple[Any, Any, dict[str, Any]]:
    """Phase 1: (model, tokenizer, record) after causal-LM pretraining with recipes/pretrain.py's pieces. The
    training libraries' exceptions pass through."""
    from transformers import TrainingArguments

    from pulseloco.recipes import pretrain

    started = time.monotonic()
    model_args = pretrain.ModelArguments(
        tokenizer_name_or_path=pretrain.BYTE_TOKENIZER,
        arch="llama",
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
    )
    data_args = pretrain.DataArguments(max_bytes=spec.max_bytes, seq_len=spec.seq_len, eval_fraction=0.01)
    training_args = TrainingArguments(
        output_dir=str(run_dir / "pretrain"),
        per_device_train_batch_size=spec.batch_size,
        per_device_eval_batch_size=spec.batch_size,
        learning_rate=spec.learning_rate,
        warmup_steps=spec.warmup_steps,
        eval_strategy="steps",
        eval_steps=max(1, spec.pretrain_steps // 5),
        **_common_training_args(spec, spec.pretrain_steps),
    )
    trainer = pretrain.make_trainer(model_args, data_args, training_args)
    num_params = sum(p.numel() for p in trainer.model.parameters())
    say(
        f"pretraining a {num_params / 1e6:.2f}M-parameter Llama for {spec.pretrain_steps} steps on "
        f"{len(trainer.train_dataset)} blocks of {spec.seq_len} tokens (Python standard library sources)"
    )
    _quiet(trainer, _progress_callback("pretrain", spec.pretrain_steps, started))
    trainer.train()
    eval_losses = _curve(trainer.state.log_history, "eval_loss")
    if not eval_losses or eval_losses[-1][0] != trainer.state.global_step:
        eval_losses.append([trainer.state.global_step, round(float(trainer.evaluate()["eval_loss"]), 4)])
    losses = _curve(trainer.state.log_history, "loss")
    record = {
        "steps": spec.pretrain_steps,
        "num_blocks": len(trainer.train_dataset),
        "loss_curve": losses,
        "eval_loss_curve": eval_losses,
        "first_loss": losses[0][1],
        "last_loss": losses[-1][1],
        "eval_loss": eval_losses[-1][1],
        "seconds": round(time.monotonic() - started, 1),
    }
    return trainer.model, trainer.processing_class, record


def greedy_completions(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations of ``prompts`` (left-padded batch), up to eos, without special tokens."""
    import torch

    model.eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    new_tokens = out[:, batch["input_ids"].shape[1] :]
    return [str(text) for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def _eval_problems(spec: WarmSpec) -> list[tuple[str, str]]:
    """The problems the warm model is scored on (``pulseloco/recipes/tasks.py``: every problem of a task with at most
    :data:`NUM_EVAL_PROBLEMS` of them, else that many held-out ones)."""
    from pulseloco.recipes import tasks

    return tasks.eval_problems(tasks.TaskSpec(task=spec.task, max_operand=spec.max_operand), NUM_EVAL_PROBLEMS)


def greedy_reward(model: Any, tokenizer: Any, spec: WarmSpec) -> tuple[float, list[list[str]]]:
    """Mean exact-match reward of greedy answers to the task's evaluation problems, and a few (prompt, answer, got)."""
    from pulseloco.recipes import tasks

    problems = _eval_problems(spec)
    longest_answer = len(str(2 * spec.max_operand))
    completions = greedy_completions(model, tokenizer, [p for p, _ in problems], longest_answer + 2)
    samples = [[p, a, c] for (p, a), c in list(zip(problems, completions))[:8]]
    return tasks.score(completions, problems), samples


def sft_phase(spec: WarmSpec, model: Any, tokenizer: Any, run_dir: Path) -> tuple[Any, dict[str, Any]]:
    """Phase 2: (model, record) after TRL's SFTTrainer on the task's prompt/completion pairs (eos appended). The
    training libraries' exceptions pass through."""
    from trl import SFTConfig, SFTTrainer

    from pulseloco.recipes import tasks

    started = time.monotonic()
    before, _ = greedy_reward(model, tokenizer, spec)
    task = tasks.TaskSpec(task=spec.task, max_operand=spec.max_operand)
    dataset = tasks.sft_dataset(task, spec.sft_examples, seed=spec.seed + 1)
    config = SFTConfig(
        output_dir=str(run_dir / "sft"),
        per_device_train_batch_size=spec.sft_batch_size,
        learning_rate=spec.sft_learning_rate,
        warmup_steps=max(1, spec.sft_steps // 10),
        max_length=64,
        **_common_training_args(spec, spec.sft_steps),
    )
    say(
        f"supervised warm-up: {spec.sft_steps} steps of {spec.sft_batch_size} {spec.task} problems "
        f"(operands 0..{spec.max_operand}); greedy reward before it {before:.3f}"
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    _quiet(trainer, _progress_callback("sft", spec.sft_steps, started))
    trainer.train()
    reward, samples = greedy_reward(trainer.model, tokenizer, spec)
    losses = _curve(trainer.state.log_history, "loss")
    record = {
        "steps": spec.sft_steps,
        "loss_curve": losses,
        "reward_before": before,
        "reward": reward,
        "samples": samples,
        "seconds": round(time.monotonic() - started, 1),
    }
    return trainer.model, record


# ---- building and caching ------------------------------------------------------------------------------------


def build(size: str, spec: WarmSpec, tmp: Path) -> dict[str, Any]:
    """Train the warm model and save it (and its marker, last) into ``tmp``; returns the marker. The training
    libraries' exceptions and ``OSError`` pass through, leaving ``tmp`` without a marker (:func:`warm_model` removes
    it)."""
    import datasets
    import torch
    import transformers
    import trl

    from pulseloco.recipes import common

    common.quiet_libraries()  # progress lines only: no progress bars of saving, no TRL deprecation noise
    datasets.disable_progress_bars()
    started = time.monotonic()
    model, tokenizer, pretrain_record = pretrain_phase(spec, tmp / "_runs")
    model, sft_record = sft_phase(spec, model, tokenizer, tmp / "_runs")
    shutil.rmtree(tmp / "_runs", ignore_errors=True)
    model = model.to(torch.float32)
    model.config.use_cache = True
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weights = torch.cat([p.detach().abs().flatten() for p in model.parameters() if p.dim() > 1])
    marker = {
        "size": size,
        "hash": spec.digest(),
        "task": spec.task,
        "max_operand": spec.max_operand,
        "reward": sft_record["reward"],
        "num_eval_problems": len(_eval_problems(spec)),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "median_abs_weight": round(float(weights.median()), 5),
        "seconds": round(time.monotonic() - started, 1),
        "settings": {"recipe_version": RECIPE_VERSION, **dataclasses.asdict(spec)},
        "pretrain": pretrain_record,
        "sft": sft_record,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # last: the directory is now complete
    return marker


def warm_model(size: str, *, cache_dir: Path | None = None, force: bool = False, threads: int | None = None) -> Path:
    """The directory of the warm model of ``size``, built first unless a complete one is cached.

    ``threads``: ``torch.set_num_threads`` for the build (default: torch's own choice). Raises :class:`BuildError`
    when the cache directory cannot be written and ``KeyError`` for a size not in :data:`SIZES`; a build that fails
    or is interrupted (``KeyboardInterrupt``, ``SystemExit`` from a signal handler) removes its temporary directory
    and re-raises.
    """
    spec = SIZES[size]
    models_dir = (cache_dir or default_cache_dir()).expanduser().resolve() / "models"
    name = f"warm-{size}-{spec.digest()}"
    final = models_dir / name
    if is_complete(final) and not force:
        return final
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=models_dir, prefix=".probe-"):
            pass
    except OSError as exc:
        raise BuildError(
            f"cannot write the cache directory {models_dir} ({exc.strerror or exc}); "
            "set --cache-dir or PULSELOCO_CACHE to a writable directory"
        ) from None
    with build_lock(models_dir, name):
        if is_complete(final) and not force:  # another process built it while this one waited
            return final
        for stale in models_dir.glob(f".{name}.tmp-*"):  # left by a killed build: nobody else holds the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir))
        moved = False
        try:
            say(f"building {name} in {tmp}")
            if threads:
                import torch

                torch.set_num_threads(threads)
            marker = build(size, spec, tmp)
            check_stop()  # a stop requested during the build's last step: nothing goes into the cache
            if final.exists():  # incomplete, or replaced with --force
                shutil.rmtree(final)
            os.replace(tmp, final)
            moved = True
        finally:  # failed, interrupted or terminated: no half model stays behind
            if not moved:
                shutil.rmtree(tmp, ignore_errors=True)
    pre, sft = marker["pretrain"], marker["sft"]
    say(
        f"built {name}: {marker['num_parameters'] / 1e6:.2f}M parameters, pretraining loss "
        f"{pre['first_loss']:.3f} -> {pre['last_loss']:.3f} (held-out {pre['eval_loss']:.3f}), greedy {spec.task} "
        f"reward {sft['reward_before']:.3f} -> {sft['reward']:.3f}, {marker['seconds']:.0f} s"
    )
    return final
