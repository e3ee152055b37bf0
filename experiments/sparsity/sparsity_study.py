#!/usr/bin/env python
"""How sparse are the per-step BF16 weight updates of GRPO on our warm model? (PULSE's ~99% observation.)

    .venv/bin/python experiments/sparsity/sparsity_study.py                         # demo warm model, 5 lrs x fp32,bf16
    .venv/bin/python experiments/sparsity/sparsity_study.py --lrs 1e-6,1e-5 --precisions fp32 --steps 32 --ks 1,2,4,8
    .venv/bin/python experiments/sparsity/sparsity_study.py --model_name_or_path DIR --out /tmp/sp --json /tmp/sp.json
    .venv/bin/python experiments/sparsity/sparsity_study.py -- --per_device_train_batch_size 32   # after --: GRPO flags

For every learning rate (``--lrs``, default 5e-7,1e-6,3e-6,5e-6,1e-5) and precision (``--precisions``) it trains
the warm model with TRL's ``GRPOTrainer`` in this process (CPU) for ``--steps`` optimizer steps: the task and GRPO
settings of ``recipes/grpo.py`` with ``--config`` (default ``recipes/configs/grpo-tiny.yaml``, parsed by
``pulseloco/recipes/common.py`` as the recipe does; the pulseloco swarm keys in it are ignored: no swarm), a fresh AdamW
(the config's ``optim``), constant learning rate, no warmup, the same ``--seed`` for every run. Precisions:

* ``fp32``: FP32 master weights (the model trains in float32); the "BF16 view" is ``p.to(torch.bfloat16)``;
* ``bf16``: pure BF16 parameters (the model loaded in bfloat16, AdamW updates the bf16 parameters directly, no
  autocast): an update smaller than half a BF16 unit in the last place is rounded away.

A ``TrainerCallback`` snapshots the BF16 view of all parameters (flattened, 2 bytes each) before the first step and
after every optimizer step. From the snapshots theta_0 .. theta_T:

* S_k(t): the fraction of entries whose BF16 value is bitwise the same in theta_t and theta_{t+k}, for every window
  t = 0 .. T-k and k in ``--ks`` (1 always included); S_1 is the per-step sparsity, 1 - S_1 the density;
* the mechanism, per step: r = |update| / (|w| / 256) for every entry (|w| before the step; |w|/256 is about one
  BF16 unit in the last place), in 48 log-spaced bins from 1e-3 to 1e3 (8 a decade; r outside goes to the end
  bins), and per bin the fraction of entries whose BF16 view changed; the median of r and the fraction with r >= 1.
  The update is, for ``fp32``, the exact FP32 master-weight change; for ``bf16``, the AdamW step before rounding,
  rebuilt from the optimizer state after the step (-lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) - lr*wd*w, with the
  bf16 moments as stored: within ~1% of the kernel's own). For ``fp32`` runs the same rebuild is compared with the
  exact change (``adam_rebuild_rel_error``), a check of the formula the bf16 runs rely on;
* error feedback: the steps cut into rounds of the largest k (H), and in each PULSELoCo's selection as one peer
  runs it (``sparsity.error_feedback_round``: the round's change theta_start - theta_end plus the residual
  of entries not sent before; the entries whose BF16 value at theta_start it would change are sent, the rest stays
  in the residual). Its density per round, beside 1 - S_H (which carries nothing from round to round), is the
  density a swarm's peer sends. It is simulated on the one trajectory: the run's weights go on from theta_end,
  where a peer restarts from the averaged weights (only the sent entries applied);
* per run: the seconds it took and the sampled reward TRL logged (mean over all steps, the first and last quarter).

Outputs in ``--out`` (default: a new folder ``experiments/sparsity/results/MODEL-LRS-STEPS-STAMP``):

* ``sparsity.md``: a table in the layout of the PULSE paper's: one row per (precision, lr), S_1 mean, S_1 min, then
  S_k mean (min) for every k, in percent; a second table per run (density, median r, fraction r >= 1, sampled
  reward, seconds); notes (model, parameters, median |w|, steps, settings, date, commit, command line) and a short
  explanation written from the numbers;
* ``sparsity.json``: every number (S_k(t) for every window, per-step density, median r and fraction r >= 1, the
  histograms, the logged rewards, the settings); with ``--json PATH`` also written to PATH;
* ``sparsity_ratio.png``: fraction of entries whose BF16 value changed against r, one line per lr (left fp32,
  right bf16), log x axis, a vertical line at r = 1;
* ``sparsity_k.png``: S_k mean against k, one line per (precision, lr).

The model: ``--model_name_or_path DIR``, else ``scripts/warm_model.py --size WARM_SIZE`` (default demo; built once,
minutes, and cached; its last line ``warm model: DIR`` is used). ``--threads`` sets ``torch.set_num_threads``
(default: the CPUs this process may use). Flags after ``--`` go to the GRPO config (``trl.TrlParser`` flags of
``recipes/grpo.py``) except those the study sets itself. Progress goes to stderr, one line per run; a failure ends
the script with one line ``sparsity_study.py: error: ...`` and exit code 2 (bad configuration) or 1.

The measurements are :mod:`sparsity` (experiments/sparsity/sparsity.py), the tables, sentences and plots
:mod:`sparsity_report`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import itertools
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

import sparsity
import torch
from harness import REPO
from harness.logs import progress
from harness.machine import git_revision, versions
from harness.models import warm_model_dir
from harness.report import default_out, lr_label, mean, parse_list
from harness.warm import read_marker
from sparsity_report import pct, run_facts, write_markdown, write_plots

from pulseloco.errors import ConfigError
from pulseloco.recipes import common, grpo, tasks  # config parsing, TaskArguments, dataset and reward

PROG = "sparsity_study.py"
DEFAULT_CONFIG = REPO / "recipes" / "configs" / "grpo-tiny.yaml"
DEFAULT_LRS = (5e-7, 1e-6, 3e-6, 5e-6, 1e-5)
DEFAULT_KS = (1, 2, 4, 8, 16, 32)
PRECISIONS = ("fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTROLLED = (
    "learning_rate", "max_steps", "seed", "bf16", "fp16", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
    "output_dir", "model_name_or_path", "dtype", "use_cpu", "report_to", "save_strategy", "logging_steps",
    "disable_tqdm", "config", "num_train_epochs", "resume_from_checkpoint",
)  # fmt: skip
"""GRPO flags the study sets itself (refused after ``--``)."""
GRPO_KEYS = (
    "per_device_train_batch_size", "num_generations", "max_completion_length", "temperature", "beta",
    "num_iterations", "max_grad_norm", "gradient_accumulation_steps", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_epsilon",
)  # fmt: skip
"""The GRPO settings recorded in ``sparsity.json`` (``settings.grpo``)."""

log = progress("sparsity")


# ---- one training run ----------------------------------------------------------------------------------------------


def grpo_argv(args: argparse.Namespace, model_dir: str, output_dir: str, lr: float) -> list[str]:
    """The recipe's flags for one run: the config, the flags after ``--``, then what the study sets."""
    return [
        "--config", str(args.config), *args.extra,
        "--model_name_or_path", model_dir, "--output_dir", output_dir, "--learning_rate", repr(lr),
        "--max_steps", str(args.steps), "--seed", str(args.seed), "--lr_scheduler_type", "constant",
        "--warmup_steps", "0", "--bf16", "false", "--fp16", "false", "--use_cpu", "true", "--report_to", "none",
        "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true",
    ]  # fmt: skip


def parse_grpo(args: argparse.Namespace, model_dir: str, output_dir: Path, lr: float) -> tuple[Any, Any, Any]:
    """``(task_args, training_args, task spec)`` of one run, parsed as ``recipes/grpo.py`` parses its flags. Raises
    :class:`~pulseloco.errors.ConfigError` for a bad config or flag after ``--``."""
    from trl import GRPOConfig, ModelConfig

    from pulseloco.integrations.args import PulseLoCoArguments

    task_args, training_args, _model_args, _pulse_args = common.parse_args(
        (grpo.TaskArguments, GRPOConfig, ModelConfig, PulseLoCoArguments),
        grpo_argv(args, model_dir, str(output_dir), lr),
        PROG,
    )
    return task_args, training_args, tasks.spec_for_model(model_dir, task_args.task, task_args.max_operand)


def run_one(args: argparse.Namespace, model_dir: str, precision: str, lr: float, work_dir: Path) -> dict[str, Any]:
    """Train one (precision, lr) run and measure it; returns its record for sparsity.json. Raises RuntimeError when
    the callback saw another number of optimizer steps than ``--steps``; the trainer's exceptions pass through."""
    from transformers import PrinterCallback, ProgressCallback

    task_args, training_args, spec = parse_grpo(args, model_dir, work_dir / f"{precision}-{lr:g}", lr)
    callback = sparsity.make_callback(precision, round_steps=args.ks[-1])
    trainer = grpo.build_trainer(spec, task_args, training_args, model_dir, dtype=DTYPES[precision],
                                 callbacks=[callback])  # fmt: skip
    for cls in (PrinterCallback, ProgressCallback):  # no per-step log lines on stdout
        trainer.remove_callback(cls)
    started = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - started
    if len(callback.snapshots) != args.steps + 1:
        raise RuntimeError(
            f"{precision} lr {lr:g}: expected {args.steps} optimizer steps, the callback saw "
            f"{len(callback.snapshots) - 1}"
        )
    rewards = [(int(e["step"]), float(e["reward"])) for e in trainer.state.log_history if "reward" in e]
    quarter = max(1, args.steps // 4)
    record: dict[str, Any] = {
        "precision": precision,
        "lr": lr,
        "steps": args.steps,
        "seconds": round(seconds, 2),
        "step_seconds": [round(b - a, 3) for a, b in itertools.pairwise(callback.step_times)],
        "optim": str(getattr(training_args.optim, "value", training_args.optim)),
        "S": sparsity.window_summary(callback.snapshots, args.ks),
        "density_per_step": [s["density"] for s in callback.steps],
        "round_steps": args.ks[-1],
        "density_per_round_ef": callback.ef_density,
        "never_changed": float((~callback.ever_changed).double().mean()),
        "rewards": rewards,
        "reward_mean": mean([r for _, r in rewards]),
        "reward_first_quarter": mean([r for s, r in rewards if s <= quarter]),
        "reward_last_quarter": mean([r for s, r in rewards if s > args.steps - quarter]),
        "mechanism": sparsity.mechanism_summary(callback.steps, precision),
    }
    if callback.rebuild_errors:
        record["adam_rebuild_rel_error"] = sparsity.summarize(callback.rebuild_errors)
    del trainer, callback
    return record


def model_facts(model_dir: str) -> dict[str, Any]:
    """Parameters and median |w| of the model as loaded (float32), over all parameters and over matrices, and the
    warm model's size, hash, task and reward from its marker (none for a model without a readable one). Loading
    errors pass through."""
    from pulseloco.models import load_causal_lm

    model = load_causal_lm(model_dir, dtype=torch.float32, device="cpu")
    params = list(model.parameters())
    flat = sparsity.flat_float(params).abs()
    matrices = torch.cat([p.detach().abs().reshape(-1) for p in params if p.dim() > 1])
    facts: dict[str, Any] = {
        "path": model_dir,
        "num_parameters": flat.numel(),
        "median_abs_weight": float(flat.median()),
        "median_abs_weight_matrices": float(matrices.median()),
    }
    with contextlib.suppress(OSError, ValueError):
        warm = read_marker(model_dir)
        facts["warm"] = {key: warm.get(key) for key in ("size", "hash", "task", "max_operand", "reward")}
    return facts


def run_line(run: dict[str, Any], kmax: int) -> str:
    """The progress line of a finished run: S_1, S_kmax, median r, sampled reward, seconds."""
    f = run_facts(run)
    median_r = "n/a" if f["median_r"] is None else f"{f['median_r']:.3g}"
    reward = "n/a" if run["reward_mean"] is None else f"{run['reward_mean']:.3f}"
    s = run["S"]
    return (
        f"{run['precision']} lr {run['lr']:g}: S_1 mean {pct(s['1']['mean'])}% min {pct(s['1']['min'])}%, "
        f"S_{kmax} mean {pct(s[str(kmax)]['mean'])}%, median r {median_r}, sampled reward {reward}, "
        f"{run['seconds']:.0f} s"
    )


# ---- the study -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (flags after ``--`` in ``args.extra``); exits 2 through ``ap.error`` with one line naming
    the bad flag."""
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    ap = argparse.ArgumentParser(
        prog=PROG, description=(__doc__ or "").split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--model_name_or_path", "--model-name-or-path", default=None, help="the model (HF directory)")
    source.add_argument("--warm-size", default=None, help="else scripts/warm_model.py --size (default demo)")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="GRPO recipe config (default grpo-tiny.yaml)")
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS), help="learning rates, comma-separated")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="fp32 and/or bf16, comma-separated")
    ap.add_argument("--steps", type=int, default=64, help="optimizer steps per run (default 64; > max k)")
    ap.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)), help="window lengths k (1 always included)")
    ap.add_argument("--seed", type=int, default=0, help="--seed of every run (default 0)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: usable CPUs)")
    ap.add_argument(
        "--out", type=Path, default=None,
        help="where sparsity.md/.json/*.png go (default: a new folder experiments/sparsity/results/"
        "MODEL-LRS-STEPS-STAMP, named after the run's model, learning rates, steps and start time)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="also write sparsity.json to this path")
    args = ap.parse_args(argv)
    args.extra = extra
    args.warm_size = args.warm_size or "demo"
    validate(ap, args)
    if args.out is None:
        model = Path(args.model_name_or_path).name if args.model_name_or_path else args.warm_size
        args.out = default_out("sparsity", f"{model}-{lr_label(args.lrs)}-{args.steps}")
    return args


def validate(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check and normalize ``args`` in place (lists parsed, sorted and deduplicated, paths resolved); exits 2
    through ``ap.error`` on the first bad value."""
    args.lrs = parse_list(ap, "--lrs", args.lrs, float, "1e-6,3e-6")
    if any(not (lr > 0 and math.isfinite(lr)) for lr in args.lrs):
        ap.error(f"--lrs: learning rates must be positive finite numbers, got {args.lrs}")
    args.lrs = sorted(set(args.lrs))
    args.precisions = [p.lower() for p in parse_list(ap, "--precisions", args.precisions, str, "fp32,bf16")]
    unknown = sorted(set(args.precisions) - set(PRECISIONS))
    if unknown:
        ap.error(f"--precisions: unknown {', '.join(unknown)} (choose from {', '.join(PRECISIONS)})")
    args.precisions = [p for p in PRECISIONS if p in args.precisions]
    args.ks = sorted({1, *parse_list(ap, "--ks", args.ks, int, "1,2,4,8")})
    if args.ks[0] < 1:
        ap.error(f"--ks: window lengths must be at least 1, got {args.ks[0]}")
    if args.steps < 2:
        ap.error(f"--steps must be at least 2, got {args.steps}")
    if args.steps <= args.ks[-1]:
        ap.error(f"--steps ({args.steps}) must be larger than the largest k ({args.ks[-1]}): raise --steps or drop k")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    if not args.config.is_file():
        ap.error(f"--config: {args.config} does not exist; give a GRPO recipe config such as {DEFAULT_CONFIG}")
    args.config = args.config.resolve()
    for token in args.extra:
        name = token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") else None
        if name in CONTROLLED:
            ap.error(f"after --: --{name} is set by the study itself (use its own flags: --lrs, --steps, --seed ...)")
    if args.model_name_or_path is not None:
        path = Path(args.model_name_or_path).expanduser()
        if not path.is_dir():
            ap.error(f"--model_name_or_path: {args.model_name_or_path} is not a directory (a Hugging Face model)")
        args.model_name_or_path = str(path.resolve())


def settings(args: argparse.Namespace, threads: int, training_args: Any, spec: Any) -> dict[str, Any]:
    """The ``settings`` of ``sparsity.json``: the study's flags and the GRPO settings every run shares."""
    config = args.config
    return {
        "precisions": args.precisions,
        "lrs": args.lrs,
        "steps": args.steps,
        "ks": args.ks,
        "seed": args.seed,
        "threads": threads,
        "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config),
        "extra": args.extra,
        "optim": str(getattr(training_args.optim, "value", training_args.optim)),
        "task": spec.task,
        "max_operand": spec.max_operand,
        "grpo": {key: getattr(training_args, key, None) for key in GRPO_KEYS},
        "ratio_bin_edges": sparsity.RATIO_EDGES,
    }


def study(args: argparse.Namespace) -> dict[str, Any]:
    """Every run, and the report ``sparsity.json`` holds. Raises :class:`~pulseloco.errors.ConfigError` without
    matplotlib (before any run) or for a bad GRPO config, RuntimeError when the warm model cannot be built; the
    training's exceptions pass through. The runs' directories are removed in any case."""
    if importlib.util.find_spec("matplotlib") is None:  # before hours of runs, not at the plots
        raise ConfigError("matplotlib is not installed: pip install -e '.[scripts]' (scripts/_setup.sh installs it)")
    started = time.monotonic()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    common.quiet_libraries()
    model_dir = args.model_name_or_path
    if model_dir is None:
        log(f"warm model: scripts/warm_model.py --size {args.warm_size} (cached after the first build)")
        model_dir = str(warm_model_dir(args.warm_size))
    facts = model_facts(model_dir)
    log(
        f"model {model_dir}: {facts['num_parameters']:,} parameters, median |w| {facts['median_abs_weight']:.4g}; "
        f"{len(args.precisions)} precision(s) x {len(args.lrs)} lr(s) x {args.steps} steps, {threads} threads"
    )
    work_dir = Path(tempfile.mkdtemp(prefix="pulseloco-sparsity-"))
    runs: list[dict[str, Any]] = []
    try:
        _, training_args, spec = parse_grpo(args, model_dir, work_dir / "settings", args.lrs[0])
        for precision, lr in itertools.product(args.precisions, args.lrs):
            runs.append(run_one(args, model_dir, precision, lr, work_dir))
            log(run_line(runs[-1], args.ks[-1]))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": git_revision(),
        "command": shlex.join([".venv/bin/python", "experiments/sparsity/sparsity_study.py", *sys.argv[1:]]),
        "seconds": round(time.monotonic() - started, 1),
        "versions": versions("torch", "transformers", "trl"),
        "model": facts,
        "settings": settings(args, threads, training_args, spec),
        "runs": runs,
    }


def write_outputs(report: dict[str, Any], out: Path, json_copy: Path | None) -> None:
    """``sparsity.json`` (also to ``json_copy``), ``sparsity.md`` and the two plots into ``out`` (created). Raises
    ``OSError`` when a file cannot be written."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1) + "\n"
    (out / "sparsity.json").write_text(text, encoding="utf-8")
    if json_copy is not None:
        json_copy.parent.mkdir(parents=True, exist_ok=True)
        json_copy.write_text(text, encoding="utf-8")
    write_markdown(report, out / "sparsity.md")
    write_plots(report, out)


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its outputs: 0; 2 with one error line for a bad configuration (flags: argparse's
    exit 2), 130 on Ctrl-C, 1 with one error line for anything else (``PULSELOCO_DEBUG=1``: the traceback)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        write_outputs(study(args), args.out, args.json)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, not a traceback (PULSELOCO_DEBUG=1 shows it)
        if os.environ.get("PULSELOCO_DEBUG"):
            raise
        message = " ".join(str(exc).split())[:500]
        print(f"{PROG}: error: {type(exc).__name__}: {message}", file=sys.stderr, flush=True)
        return 1
    log(f"wrote sparsity.md, sparsity.json, sparsity_ratio.png and sparsity_k.png to {args.out}")
    return 0


if __name__ == "__main__":
    from pulseloco.integrations import skip_vllm_import

    skip_vllm_import()  # TRL would import vLLM (seconds of CPU); this process never uses it
    sys.exit(main())
