#!/usr/bin/env python
"""How sparse are the per-step BF16 weight updates of GRPO on our warm model? (PULSE's ~99% observation.)

    .venv/bin/python scripts/sparsity_study.py                            # demo warm model, 5 lrs x fp32,bf16
    .venv/bin/python scripts/sparsity_study.py --lrs 1e-6,1e-5 --precisions fp32 --steps 32 --ks 1,2,4,8
    .venv/bin/python scripts/sparsity_study.py --model_name_or_path DIR --out /tmp/sp --json /tmp/sp.json
    .venv/bin/python scripts/sparsity_study.py -- --per_device_train_batch_size 32   # after --: GRPO flags

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
* per run: the seconds it took and the sampled reward TRL logged (mean over all steps, the first and last quarter).

Outputs in ``--out`` (default ``results/`` at the repo root):

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
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]

from pulseloco.recipes import common, grpo, tasks  # noqa: E402  # config parsing, TaskArguments, dataset and reward

sys.path.insert(0, str(REPO / "scripts"))
from compare import git_revision  # noqa: E402  # scripts/compare.py

from pulseloco.errors import ConfigError  # noqa: E402

PROG = "sparsity_study.py"
DEFAULT_CONFIG = REPO / "recipes" / "configs" / "grpo-tiny.yaml"
DEFAULT_LRS = (5e-7, 1e-6, 3e-6, 5e-6, 1e-5)
DEFAULT_KS = (1, 2, 4, 8, 16, 32)
PRECISIONS = ("fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WARM_MODEL_TIMEOUT = 3600.0
"""Seconds ``scripts/warm_model.py`` may take to build a warm model (reusing a cached one takes seconds)."""
RATIO_DECADES = (-3, 3)
BINS_PER_DECADE = 8
NUM_BINS = (RATIO_DECADES[1] - RATIO_DECADES[0]) * BINS_PER_DECADE
RATIO_EDGES = [10 ** (RATIO_DECADES[0] + i / BINS_PER_DECADE) for i in range(NUM_BINS + 1)]
"""Edges of the r bins: 1e-3 .. 1e3, 8 a decade (0.1, 10^-0.5, 1, 10^0.5 and 10 are edges)."""
BANDS = (
    (0.0, 0.1, "r < 0.1"), (0.1, 10**-0.5, "0.1 <= r < 0.32"), (10**-0.5, 1.0, "0.32 <= r < 1"),
    (1.0, 10**0.5, "1 <= r < 3.2"), (10**0.5, math.inf, "r >= 3.2"),
)  # fmt: skip
"""Bands of r (bin edges) for the explanation in sparsity.md."""
ULP_DIVISOR = 256.0
"""r = |update| / (|w| / 256): |w|/256 lies between half a BF16 unit in the last place of w and one unit."""
CONTROLLED = (
    "learning_rate", "max_steps", "seed", "bf16", "fp16", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
    "output_dir", "model_name_or_path", "dtype", "use_cpu", "report_to", "save_strategy", "logging_steps",
    "disable_tqdm", "config", "num_train_epochs", "resume_from_checkpoint",
)  # fmt: skip
"""GRPO flags the study sets itself (refused after ``--``)."""


def log(msg: str) -> None:
    print(f"[sparsity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the measurements (pure functions of tensors) ------------------------------------------------------------------


def bf16_view(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """All parameters as one flat bfloat16 tensor (the values a BF16 copy of the model would hold)."""
    return torch.cat([p.detach().reshape(-1).to(torch.bfloat16) for p in params])


def flat_float(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """All parameters as one flat float32 tensor (a copy)."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])


def k_step_sparsity(snapshots: Sequence[torch.Tensor], ks: Iterable[int]) -> dict[int, list[float]]:
    """S_k(t) for every k in ``ks`` and window t = 0 .. T-k: the fraction of entries with bitwise equal BF16 values
    in ``snapshots[t]`` and ``snapshots[t + k]`` (T + 1 snapshots of the same length, bfloat16).

    Raises ``ValueError`` for fewer than two snapshots, snapshots of other lengths or dtypes, or k outside 1 .. T.
    """
    if len(snapshots) < 2:
        raise ValueError(f"need at least two snapshots, got {len(snapshots)}")
    numel = snapshots[0].numel()
    if numel == 0 or any(s.dtype != torch.bfloat16 or s.numel() != numel for s in snapshots):
        raise ValueError("snapshots must be non-empty bfloat16 tensors of one length")
    bits = [s.reshape(-1).view(torch.int16) for s in snapshots]  # bitwise: -0.0 != 0.0, NaN == the same NaN
    steps = len(bits) - 1
    result: dict[int, list[float]] = {}
    for k in sorted(set(ks)):
        if not 1 <= k <= steps:
            raise ValueError(f"k must be in 1..{steps} (the number of steps), got {k}")
        result[k] = [int((bits[t + k] == bits[t]).sum()) / numel for t in range(steps - k + 1)]
    return result


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def ratio_bins(update: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r = |update| / (|weight| / 256) per entry (float64; 0 where the update is 0, inf where the weight is 0) and
    its bin index in :data:`RATIO_EDGES` (r outside 1e-3 .. 1e3 goes to the first or last bin)."""
    u = update.reshape(-1).double().abs()
    w = weight.reshape(-1).double().abs() / ULP_DIVISOR
    r = torch.where(u == 0, torch.zeros_like(u), u / w)
    low, high = RATIO_EDGES[0], RATIO_EDGES[-1]
    logs = torch.log10(r.clamp(low, high))
    index = ((logs - RATIO_DECADES[0]) * BINS_PER_DECADE).floor().long().clamp(0, NUM_BINS - 1)
    return r, index


def step_mechanism(update: torch.Tensor, weight: torch.Tensor, changed: torch.Tensor) -> dict[str, Any]:
    """One step's entries binned by r (:func:`ratio_bins`): ``total`` and ``changed`` counts per bin, the median
    of r and the fraction of entries with r >= 1."""
    r, index = ratio_bins(update, weight)
    changed = changed.reshape(-1)
    total = torch.bincount(index, minlength=NUM_BINS)
    flipped = torch.bincount(index[changed], minlength=NUM_BINS)
    return {
        "total": total.tolist(),
        "changed": flipped.tolist(),
        "median_r": float(r.median()),
        "frac_r_ge_1": float((r >= 1).double().mean()),
    }


def band_density(total: Sequence[int], changed: Sequence[int], low: float, high: float) -> float | None:
    """Fraction changed among the binned entries with low <= r < high (``None`` where there are none). ``low`` and
    ``high`` should be bin edges: a bin that straddles one is left out."""
    edges = RATIO_EDGES
    picked = [i for i in range(NUM_BINS) if edges[i] >= low * (1 - 1e-9) and edges[i + 1] <= high * (1 + 1e-9)]
    n = sum(total[i] for i in picked)
    return sum(changed[i] for i in picked) / n if n else None


def adam_update(optimizer: Any, params: Sequence[torch.Tensor], weight: torch.Tensor) -> torch.Tensor | None:
    """The AdamW step just taken, before rounding to the parameters' dtype, rebuilt in float32 from the optimizer's
    state (``-lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) - lr*wd*w``, ``weight``: the flat parameters before the step).
    ``None`` when the optimizer is not Adam-like (no ``exp_avg`` / ``exp_avg_sq`` state) or uses amsgrad."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    parts, offset = [], 0
    for p in params:
        n = p.numel()
        group, state = group_of.get(id(p)), opt.state.get(p, {})
        if group is None or "betas" not in group or group.get("amsgrad") or group.get("maximize"):
            return None
        if "exp_avg" not in state:  # not stepped (no gradient yet)
            parts.append(torch.zeros(n))
        else:
            if "exp_avg_sq" not in state:
                return None
            step = float(state["step"])
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group.get("weight_decay", 0.0))
            m, v = state["exp_avg"].float().reshape(-1), state["exp_avg_sq"].float().reshape(-1)
            denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
            u = -(lr / (1 - beta1**step)) * m / denom
            if wd:
                u = u - lr * wd * weight[offset : offset + n]
            parts.append(u)
        offset += n
    return torch.cat(parts)


# ---- one training run ----------------------------------------------------------------------------------------------


def make_callback(precision: str) -> Any:
    """A ``TrainerCallback`` that keeps the BF16 snapshots and the per-step mechanism records of one run."""
    from transformers import TrainerCallback

    class SnapshotCallback(TrainerCallback):
        def __init__(self) -> None:
            self.params: list[torch.Tensor] = []
            self.snapshots: list[torch.Tensor] = []
            self.steps: list[dict[str, Any]] = []
            self.rebuild_errors: list[float] = []
            self.prev = torch.zeros(0)
            self.rebuild_ok = True
            self.step_times: list[float] = []
            self.ever_changed = torch.zeros(0, dtype=torch.bool)

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            self.params = list(model.parameters())  # tied weights once
            self.snapshots = [bf16_view(self.params)]
            self.prev = flat_float(self.params)
            self.step_times = [time.monotonic()]
            self.ever_changed = torch.zeros(self.snapshots[0].numel(), dtype=torch.bool)

        def on_step_end(
            self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any
        ) -> None:  # fmt: skip
            self.step_times.append(time.monotonic())
            snap = bf16_view(self.params)
            changed = snap.view(torch.int16) != self.snapshots[-1].view(torch.int16)
            self.snapshots.append(snap)
            self.ever_changed |= changed
            now = flat_float(self.params)
            rebuilt = adam_update(optimizer, self.params, self.prev) if optimizer is not None else None
            if precision == "fp32":
                update = now - self.prev
                if rebuilt is not None:
                    nonzero = update != 0
                    if bool(nonzero.any()):
                        err = ((rebuilt - update).abs()[nonzero] / update.abs()[nonzero]).median()
                        self.rebuild_errors.append(float(err))
            else:
                update = rebuilt if rebuilt is not None else torch.zeros(0)
                self.rebuild_ok = self.rebuild_ok and rebuilt is not None
            record: dict[str, Any] = {"density": float(changed.double().mean())}
            if update.numel():
                record.update(step_mechanism(update, self.prev, changed))
            self.steps.append(record)
            self.prev = now

    return SnapshotCallback()


def grpo_argv(args: argparse.Namespace, model_dir: str, output_dir: str, lr: float) -> list[str]:
    """The recipe's flags for one run: the config, the flags after ``--``, then what the study sets."""
    return [
        "--config", str(args.config), *args.extra,
        "--model_name_or_path", model_dir, "--output_dir", output_dir, "--learning_rate", repr(lr),
        "--max_steps", str(args.steps), "--seed", str(args.seed), "--lr_scheduler_type", "constant",
        "--warmup_steps", "0", "--bf16", "false", "--fp16", "false", "--use_cpu", "true", "--report_to", "none",
        "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true",
    ]  # fmt: skip


def run_one(args: argparse.Namespace, model_dir: str, precision: str, lr: float, work_dir: Path) -> dict[str, Any]:
    """Train one (precision, lr) run and measure it; returns its record for sparsity.json."""
    from transformers import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, ModelConfig

    from pulseloco.integrations.args import PulseLoCoArguments

    output_dir = work_dir / f"{precision}-{lr:g}"
    task_args, training_args, _model_args, _pulse_args = common.parse_args(
        (grpo.TaskArguments, GRPOConfig, ModelConfig, PulseLoCoArguments),
        grpo_argv(args, model_dir, str(output_dir), lr),
        PROG,
    )
    spec = tasks.spec_for_model(model_dir, task_args.task, task_args.max_operand)
    callback = make_callback(precision)
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
    sparsity = k_step_sparsity(callback.snapshots, args.ks)
    record: dict[str, Any] = {
        "precision": precision,
        "lr": lr,
        "steps": args.steps,
        "seconds": round(seconds, 2),
        "step_seconds": [round(b - a, 3) for a, b in itertools.pairwise(callback.step_times)],
        "optim": str(getattr(training_args.optim, "value", training_args.optim)),
        "S": {str(k): {**summarize(v), "per_window": v} for k, v in sparsity.items()},
        "density_per_step": [s["density"] for s in callback.steps],
        "never_changed": float((~callback.ever_changed).double().mean()),
        "rewards": rewards,
        "reward_mean": mean_or_none([r for _, r in rewards]),
        "reward_first_quarter": mean_or_none([r for s, r in rewards if s <= max(1, args.steps // 4)]),
        "reward_last_quarter": mean_or_none([r for s, r in rewards if s > args.steps - max(1, args.steps // 4)]),
    }
    mech = [s for s in callback.steps if "total" in s]
    if mech and len(mech) == len(callback.steps):
        record["mechanism"] = {
            "update": "exact FP32 master change" if precision == "fp32" else "AdamW step before rounding (rebuilt)",
            "total": [sum(s["total"][i] for s in mech) for i in range(NUM_BINS)],
            "changed": [sum(s["changed"][i] for s in mech) for i in range(NUM_BINS)],
            "median_r_per_step": [s["median_r"] for s in mech],
            "frac_r_ge_1_per_step": [s["frac_r_ge_1"] for s in mech],
        }
    else:
        record["mechanism"] = None
    if callback.rebuild_errors:
        record["adam_rebuild_rel_error"] = summarize(callback.rebuild_errors)
    del trainer, callback
    return record


def mean_or_none(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def model_facts(model_dir: str) -> dict[str, Any]:
    """Parameters and median |w| of the model as loaded (float32), over all parameters and over matrices."""
    from pulseloco.integrations.models import load_causal_lm

    model = load_causal_lm(model_dir, dtype=torch.float32, device="cpu")
    params = list(model.parameters())
    flat = flat_float(params).abs()
    matrices = torch.cat([p.detach().abs().reshape(-1) for p in params if p.dim() > 1])
    facts: dict[str, Any] = {
        "path": model_dir,
        "num_parameters": flat.numel(),
        "median_abs_weight": float(flat.median()),
        "median_abs_weight_matrices": float(matrices.median()),
    }
    marker = Path(model_dir) / "pulseloco_warm.json"
    if marker.is_file():
        try:
            warm = json.loads(marker.read_text(encoding="utf-8"))
            facts["warm"] = {key: warm.get(key) for key in ("size", "hash", "task", "max_operand", "reward")}
        except (OSError, ValueError):
            pass
    return facts


def build_warm_model(size: str) -> str:
    """``scripts/warm_model.py --size SIZE`` (built once and cached, else reused): the directory it prints last."""
    log(f"warm model: scripts/warm_model.py --size {size} (cached after the first build)")
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "warm_model.py"), "--size", size],
            cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=WARM_MODEL_TIMEOUT, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"scripts/warm_model.py --size {size} took over {WARM_MODEL_TIMEOUT:.0f} s") from None
    found = re.findall(r"^warm model: (.+)$", proc.stdout, flags=re.MULTILINE)
    if proc.returncode != 0 or not found or not Path(found[-1].strip()).is_dir():
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:])
        raise RuntimeError(
            f"scripts/warm_model.py --size {size} exited {proc.returncode} without a `warm model: DIR` line ({tail})"
        )
    return found[-1].strip()


# ---- report --------------------------------------------------------------------------------------------------------


def pct(x: float) -> str:
    return f"{100 * x:.2f}"


def run_facts(run: dict[str, Any]) -> dict[str, Any]:
    """Per-run summary numbers for the second table and the explanation."""
    mech = run.get("mechanism")
    facts: dict[str, Any] = {"density": 1 - run["S"]["1"]["mean"], "median_r": None, "frac_r_ge_1": None}
    if mech:
        facts["median_r"] = sorted(mech["median_r_per_step"])[len(mech["median_r_per_step"]) // 2]
        facts["frac_r_ge_1"] = sum(mech["frac_r_ge_1_per_step"]) / len(mech["frac_r_ge_1_per_step"])
    facts["frozen"] = max(run["density_per_step"]) == 0
    return facts


def explanation(report: dict[str, Any]) -> list[str]:
    """Short sentences written from the numbers."""
    lines: list[str] = []
    runs = report["runs"]
    for precision in report["settings"]["precisions"]:
        mine = [r for r in runs if r["precision"] == precision]
        if not mine:
            continue
        facts = [(r["lr"], run_facts(r)) for r in mine]
        what = "FP32 master weights" if precision == "fp32" else "pure BF16 parameters"
        parts = []
        for lr, f in facts:
            text = f"lr {lr:g}: {pct(f['density'])}%"
            if f["median_r"] is not None:
                text += f" (median r {f['median_r']:.3g}, r >= 1 for {pct(f['frac_r_ge_1'])}%)"
            parts.append(text)
        lines.append(
            f"- **{precision}** ({what}): per-step density 1 - S_1 (BF16 values changed per step) at "
            + "; ".join(parts)
            + "."
        )
        frozen = [lr for lr, f in facts if f["frozen"]]
        if frozen:
            lines.append(
                f"- **{precision}**: at lr {', '.join(f'{lr:g}' for lr in frozen)} no parameter changed its BF16 "
                f"value in any of the {report['settings']['steps']} steps: the model is frozen (every AdamW step "
                "was rounded away)."
            )
        never = ", ".join(f"{r['lr']:g}: {pct(r['never_changed'])}%" for r in mine)
        lines.append(f"- **{precision}**: never changed in all {report['settings']['steps']} steps, by lr: {never}.")
        first = [r for r in mine if r["S"]["1"]["per_window"].index(r["S"]["1"]["min"]) == 0]
        if first:
            quarter = max(1, report["settings"]["steps"] // 4)
            tail = [sum(r["density_per_step"][-quarter:]) / quarter for r in mine]
            trend = ", ".join(f"{r['lr']:g}: {pct(r['density_per_step'][0])}% -> {pct(t)}%" for r, t in zip(mine, tail))
            lines.append(
                f"- **{precision}**: the minimum of S_1 is the first step in {len(first)} of {len(mine)} runs (a fresh "
                "AdamW's first update is lr x sign(g), the largest of a run); density at the first step -> mean over "
                f"the last {quarter} steps, by lr: {trend}."
            )
        kmax = str(max(report["settings"]["ks"]))
        if kmax != "1":
            drops = ", ".join(f"{r['lr']:g}: {pct(r['S']['1']['mean'])}% -> {pct(r['S'][kmax]['mean'])}%" for r in mine)
            lines.append(f"- **{precision}**: S_1 -> S_{kmax} (mean) by lr: {drops}.")
        total = [sum(r["mechanism"]["total"][i] for r in mine if r["mechanism"]) for i in range(NUM_BINS)]
        changed = [sum(r["mechanism"]["changed"][i] for r in mine if r["mechanism"]) for i in range(NUM_BINS)]
        if sum(total):
            bands = []
            for low, high, name in BANDS:
                d = band_density(total, changed, low, high)
                if d is not None:
                    bands.append(f"{name}: {pct(d)}%")
            lines.append(f"- **{precision}**, all lrs and steps, fraction changed by r band: " + "; ".join(bands) + ".")
    paper = [r for r in runs if r["precision"] == "fp32" and 1e-6 <= r["lr"] <= 3e-6]
    if paper:
        lines.append(
            "- PULSE reports ~99% per-step sparsity at lr 1e-6..3e-6; here (fp32 master weights) S_1 mean "
            + ", ".join(f"{pct(r['S']['1']['mean'])}% at lr {r['lr']:g}" for r in paper)
            + "."
        )
    changes = [
        r["reward_last_quarter"] - r["reward_first_quarter"]
        for r in runs
        if r["reward_first_quarter"] is not None and r["reward_last_quarter"] is not None
    ]
    if changes:
        lines.append(
            f"- Sampled reward (TRL's logged mean), last quarter of the steps minus the first: {min(changes):+.3f} to "
            f"{max(changes):+.3f} over the runs"
            + (" (no learning visible in this many steps at these lrs)." if max(map(abs, changes)) < 0.05 else ".")
        )
    lines.append(
        "- Mechanism: r = |update| / (|w|/256), and |w|/256 lies between half a BF16 unit in the last place (ulp) "
        "of w and one ulp. With FP32 master weights a BF16 value changes when the master value crosses a rounding "
        "boundary: about always for r >= ~1-2, with probability about r/2..r below (sub-ulp steps accumulate in the "
        "FP32 master and cross later), so the density follows the fraction of entries whose update reaches "
        "|w|/256. With pure BF16 parameters an update below half an ulp (r below ~0.5..1) is rounded away every "
        "time: nothing accumulates, so small learning rates freeze those weights for good."
    )
    rebuild = [r["adam_rebuild_rel_error"]["mean"] for r in runs if "adam_rebuild_rel_error" in r]
    if rebuild:
        lines.append(
            f"- Check of the rebuilt AdamW step used for the bf16 runs' r: on the fp32 runs its median relative "
            f"error against the exact FP32 change is {max(rebuild):.2g} at most (mean over steps)."
        )
    return lines


def write_markdown(report: dict[str, Any], path: Path) -> None:
    ks = report["settings"]["ks"]
    rest = [k for k in ks if k != 1]
    head = ["precision", "lr", "S_1 mean", "S_1 min", *[f"S_{k} mean (min)" for k in rest]]
    lines = [
        "# Sparsity of per-step BF16 weight updates under GRPO",
        "",
        "S_k: fraction (%) of parameters whose BF16 value is bitwise unchanged between optimizer steps t and t+k, "
        "mean and minimum over all windows t.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|",
    ]
    for run in report["runs"]:
        s = run["S"]
        cells = [run["precision"], f"{run['lr']:g}", pct(s["1"]["mean"]), pct(s["1"]["min"])]
        cells += [f"{pct(s[str(k)]['mean'])} ({pct(s[str(k)]['min'])})" for k in rest]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| precision | lr | density 1-S_1 (%) | never changed (%) | median r | r >= 1 (%) | sampled reward: mean, "
        "first -> last quarter | seconds |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        f = run_facts(run)
        median_r = f"{f['median_r']:.3g}" if f["median_r"] is not None else "n/a"
        frac = pct(f["frac_r_ge_1"]) if f["frac_r_ge_1"] is not None else "n/a"
        mean, first, last = (
            "n/a" if run[key] is None else f"{run[key]:.3f}"
            for key in ("reward_mean", "reward_first_quarter", "reward_last_quarter")
        )
        cells = [run["precision"], f"{run['lr']:g}", pct(f["density"]), pct(run["never_changed"]), median_r, frac]
        cells += [f"{mean}, {first} -> {last}", f"{run['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    model, st = report["model"], report["settings"]
    warm = model.get("warm") or {}
    warm_text = f"warm model `{warm.get('size')}` (hash {warm.get('hash')})" if warm else "model"
    lines += [
        "",
        "## Notes",
        "",
        f"- Model: {warm_text} at `{model['path']}`: {model['num_parameters']:,} parameters, median |w| "
        f"{model['median_abs_weight']:.4g} (all parameters; {model['median_abs_weight_matrices']:.4g} over the "
        f"matrices); task {st['task']} with operands 0..{st['max_operand']}.",
        f"- Training: TRL GRPOTrainer in one process on CPU ({st['threads']} threads), {st['steps']} optimizer steps "
        f"per run, fresh {st['optim']} per run, constant lr, no warmup, seed {st['seed']}; the rest of "
        f"`{st['config']}`: {st['grpo']}. Extra flags: {' '.join(st['extra']) or 'none'}.",
        "- Precisions: fp32 = FP32 master weights, BF16 view `p.to(torch.bfloat16)`; bf16 = model loaded in "
        "bfloat16, AdamW updates the bf16 parameters (no autocast).",
        "- r = |update| / (|w|/256) per entry and step (fp32: exact FP32 change; bf16: the AdamW step before "
        "rounding, rebuilt from the optimizer state); median r: median over steps of the per-step median. The "
        "sampled reward is TRL's logged mean reward of the GRPO samples.",
        f"- Date {report['date']}, commit {report['commit']}, torch {report['versions']['torch']}, transformers "
        f"{report['versions']['transformers']}, trl {report['versions']['trl']}; total {report['seconds']:.0f} s.",
        f"- Command: `{report['command']}`",
        "",
        "## What the data say",
        "",
        *explanation(report),
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def write_plots(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    lrs = sorted({r["lr"] for r in runs})
    colors = {lr: plt.get_cmap("viridis")(i / max(1, len(lrs) - 1)) for i, lr in enumerate(lrs)}
    centers = [math.sqrt(RATIO_EDGES[i] * RATIO_EDGES[i + 1]) for i in range(NUM_BINS)]
    precisions = [p for p in report["settings"]["precisions"] if any(r["precision"] == p for r in runs)]
    fig, axes = plt.subplots(1, len(precisions), figsize=(6.5 * len(precisions), 4.5), squeeze=False)
    for ax, precision in zip(axes[0], precisions):
        for run in (r for r in runs if r["precision"] == precision):
            mech = run["mechanism"]
            if not mech:
                continue
            xs = [c for c, n in zip(centers, mech["total"]) if n]
            ys = [m / n for m, n in zip(mech["changed"], mech["total"]) if n]
            ax.plot(xs, ys, marker=".", color=colors[run["lr"]], label=f"lr {run['lr']:g}")
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("r = |update| / (|w| / 256)")
        ax.set_ylabel("fraction of entries whose BF16 value changed")
        label = "FP32 master weights" if precision == "fp32" else "pure BF16 parameters (update before rounding)"
        ax.set_title(f"{precision}: {label}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sparsity_ratio.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for run in runs:
        ks = sorted(int(k) for k in run["S"])
        ax.plot(
            ks, [100 * run["S"][str(k)]["mean"] for k in ks], marker="o", color=colors[run["lr"]],
            linestyle="-" if run["precision"] == "fp32" else "--", label=f"{run['precision']} lr {run['lr']:g}",
        )  # fmt: skip
    ax.set_xscale("log", base=2)
    all_ks = report["settings"]["ks"]
    ax.set_xticks(all_ks, [str(k) for k in all_ks])
    ax.minorticks_off()
    ax.set_xlabel("k (optimizer steps)")
    ax.set_ylabel("S_k mean: BF16 values unchanged over k steps (%)")
    ax.set_title("k-step sparsity (solid fp32 master, dashed pure bf16)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "sparsity_k.png", dpi=120)
    plt.close(fig)


# ---- main ----------------------------------------------------------------------------------------------------------


def parse_list(ap: argparse.ArgumentParser, flag: str, text: str, kind: type, example: str) -> list[Any]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        values = [kind(t) for t in items]
    except ValueError:
        ap.error(f"{flag}: {text!r} is not a comma-separated list of {kind.__name__}s, e.g. {example}")
    if not values:
        ap.error(f"{flag}: give at least one value, e.g. {example}")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
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
    ap.add_argument("--out", type=Path, default=REPO / "results", help="where sparsity.md/.json/*.png go")
    ap.add_argument("--json", type=Path, default=None, help="also write sparsity.json to this path")
    args = ap.parse_args(argv)
    args.extra = extra
    args.warm_size = args.warm_size or "demo"
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
    for token in extra:
        name = token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") else None
        if name in CONTROLLED:
            ap.error(f"after --: --{name} is set by the study itself (use its own flags: --lrs, --steps, --seed ...)")
    if args.model_name_or_path is not None:
        path = Path(args.model_name_or_path).expanduser()
        if not path.is_dir():
            ap.error(f"--model_name_or_path: {args.model_name_or_path} is not a directory (a Hugging Face model)")
        args.model_name_or_path = str(path.resolve())
    return args


def study(args: argparse.Namespace) -> dict[str, Any]:
    if importlib.util.find_spec("matplotlib") is None:  # before hours of runs, not at the plots
        raise ConfigError("matplotlib is not installed: pip install -e '.[scripts]' (scripts/_setup.sh installs it)")
    import transformers
    import trl
    from trl import GRPOConfig, ModelConfig

    from pulseloco.integrations.args import PulseLoCoArguments

    started = time.monotonic()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    common.quiet_libraries()
    model_dir = args.model_name_or_path or build_warm_model(args.warm_size)
    facts = model_facts(model_dir)
    log(
        f"model {model_dir}: {facts['num_parameters']:,} parameters, median |w| {facts['median_abs_weight']:.4g}; "
        f"{len(args.precisions)} precision(s) x {len(args.lrs)} lr(s) x {args.steps} steps, {threads} threads"
    )
    work_dir = Path(tempfile.mkdtemp(prefix="pulseloco-sparsity-"))
    runs: list[dict[str, Any]] = []
    try:
        task_args, training_args, _, _ = common.parse_args(
            (grpo.TaskArguments, GRPOConfig, ModelConfig, PulseLoCoArguments),
            grpo_argv(args, model_dir, str(work_dir / "settings"), args.lrs[0]),
            PROG,
        )
        spec = tasks.spec_for_model(model_dir, task_args.task, task_args.max_operand)
        grpo_keys = (
            "per_device_train_batch_size", "num_generations", "max_completion_length", "temperature", "beta",
            "num_iterations", "max_grad_norm", "gradient_accumulation_steps", "weight_decay", "adam_beta1",
            "adam_beta2", "adam_epsilon",
        )  # fmt: skip
        grpo_settings = {key: getattr(training_args, key, None) for key in grpo_keys}
        optim = str(getattr(training_args.optim, "value", training_args.optim))
        for precision in args.precisions:
            for lr in args.lrs:
                run = run_one(args, model_dir, precision, lr, work_dir)
                f = run_facts(run)
                median_r = "n/a" if f["median_r"] is None else f"{f['median_r']:.3g}"
                reward = "n/a" if run["reward_mean"] is None else f"{run['reward_mean']:.3f}"
                log(
                    f"{precision} lr {lr:g}: S_1 mean {pct(run['S']['1']['mean'])}% min {pct(run['S']['1']['min'])}%"
                    f", S_{args.ks[-1]} mean {pct(run['S'][str(args.ks[-1])]['mean'])}%, median r {median_r}, "
                    f"sampled reward {reward}, {run['seconds']:.0f} s"
                )
                runs.append(run)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "scripts/sparsity_study.py", *sys.argv[1:]])
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": git_revision(),
        "command": command,
        "seconds": round(time.monotonic() - started, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "model": facts,
        "settings": {
            "precisions": args.precisions,
            "lrs": args.lrs,
            "steps": args.steps,
            "ks": args.ks,
            "seed": args.seed,
            "threads": threads,
            "config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(REPO) else str(args.config),
            "extra": args.extra,
            "optim": optim,
            "task": spec.task,
            "max_operand": spec.max_operand,
            "grpo": grpo_settings,
            "ratio_bin_edges": RATIO_EDGES,
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = study(args)
        args.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(report, indent=1) + "\n"
        (args.out / "sparsity.json").write_text(text, encoding="utf-8")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text, encoding="utf-8")
        write_markdown(report, args.out / "sparsity.md")
        write_plots(report, args.out)
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
