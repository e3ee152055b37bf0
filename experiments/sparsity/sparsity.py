"""The measurements of ``experiments/sparsity/sparsity_study.py``: how many BF16 values of a model change per optimizer
step.

Pure functions of tensors (the BF16 view of the parameters, the k-step sparsity S_k, the ratio r of an update to
about one BF16 unit in the last place and its bins, the AdamW step rebuilt from the optimizer's state) and the
``TrainerCallback`` that applies them to a training run step by step. The module docstring of
``experiments/sparsity/sparsity_study.py`` says what they mean; ``tests/test_sparsity_study.py`` checks them on
hand-made tensors. Importing this module imports torch; transformers loads inside :func:`make_callback`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

RATIO_DECADES = (-3, 3)
BINS_PER_DECADE = 8
NUM_BINS = (RATIO_DECADES[1] - RATIO_DECADES[0]) * BINS_PER_DECADE
RATIO_EDGES = [10 ** (RATIO_DECADES[0] + i / BINS_PER_DECADE) for i in range(NUM_BINS + 1)]
"""Edges of the r bins: 1e-3 .. 1e3, 8 a decade (0.1, 10^-0.5, 1, 10^0.5 and 10 are edges)."""
ULP_DIVISOR = 256.0
"""r = |update| / (|w| / 256): |w|/256 lies between half a BF16 unit in the last place of w and one unit."""


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
    """Mean, minimum and maximum of ``values``; raises ``ZeroDivisionError`` or ``ValueError`` when it is empty."""
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def ratio_bins(update: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r = |update| / (|weight| / 256) per entry (float64; 0 where the update is 0, inf where the weight is 0) and
    its bin index in :data:`RATIO_EDGES` (r outside 1e-3 .. 1e3 goes to the first or last bin). Tensors of other
    sizes raise torch's ``RuntimeError``."""
    u = update.reshape(-1).double().abs()
    w = weight.reshape(-1).double().abs() / ULP_DIVISOR
    r = torch.where(u == 0, torch.zeros_like(u), u / w)
    low, high = RATIO_EDGES[0], RATIO_EDGES[-1]
    logs = torch.log10(r.clamp(low, high))
    index = ((logs - RATIO_DECADES[0]) * BINS_PER_DECADE).floor().long().clamp(0, NUM_BINS - 1)
    return r, index


def step_mechanism(update: torch.Tensor, weight: torch.Tensor, changed: torch.Tensor) -> dict[str, Any]:
    """One step's entries binned by r (:func:`ratio_bins`): ``total`` and ``changed`` counts per bin, the median
    of r and the fraction of entries with r >= 1. Raises torch's ``RuntimeError`` for tensors of other sizes."""
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
    ``high`` should be bin edges: a bin that straddles one is left out. Raises ``IndexError`` for lists shorter
    than :data:`NUM_BINS`."""
    edges = RATIO_EDGES
    picked = [i for i in range(NUM_BINS) if edges[i] >= low * (1 - 1e-9) and edges[i + 1] <= high * (1 + 1e-9)]
    n = sum(total[i] for i in picked)
    return sum(changed[i] for i in picked) / n if n else None


def adam_update(optimizer: Any, params: Sequence[torch.Tensor], weight: torch.Tensor) -> torch.Tensor | None:
    """The AdamW step just taken, before rounding to the parameters' dtype, rebuilt in float32 from the optimizer's
    state (``-lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) - lr*wd*w``, ``weight``: the flat parameters before the step).
    ``None`` when the optimizer is not Adam-like (no ``exp_avg`` / ``exp_avg_sq`` state) or uses amsgrad or
    maximize; never raises for those."""
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


def error_feedback_round(
    theta_start: torch.Tensor, theta_end: torch.Tensor, residual: torch.Tensor
) -> tuple[float, torch.Tensor]:
    """One outer round of PULSELoCo's selection on a single trajectory: the signal is the residual plus the round's
    pseudo-gradient ``theta_start - theta_end``; PULSE's gate (:class:`pulseloco.loco.selection.PulseSelector`, FP32
    values) sends the entries whose BF16 value at ``theta_start`` it would change, and the new residual keeps the
    signal everywhere else. Returns the fraction sent and the new residual. Raises ``TypeError`` / ``ValueError``
    as the selector does (tensors that are not flat FP32 of one length)."""
    from pulseloco.loco.selection import PulseSelector

    selection = PulseSelector().select(theta_start, residual + (theta_start - theta_end))
    return selection.num_sent / theta_start.numel(), selection.residual_N


def make_callback(precision: str, round_steps: int = 0) -> Any:
    """A ``TrainerCallback`` that keeps the BF16 snapshots and the per-step mechanism records of one run
    (``precision``: ``fp32`` measures the exact master-weight change, else the rebuilt AdamW step), and with
    ``round_steps`` > 0 the density of every round of that many steps under error feedback
    (:func:`error_feedback_round`; ``ef_density``). Raises ``ImportError`` without transformers; a bf16 step whose
    AdamW step cannot be rebuilt gets no mechanism record (``rebuild_ok`` turns False)."""
    from transformers import TrainerCallback

    class SnapshotCallback(TrainerCallback):
        """The run's BF16 snapshots, per-step records, rebuild errors and step times, filled step by step."""

        def __init__(self) -> None:
            self.params: list[torch.Tensor] = []
            self.snapshots: list[torch.Tensor] = []
            self.steps: list[dict[str, Any]] = []
            self.rebuild_errors: list[float] = []
            self.prev = torch.zeros(0)
            self.rebuild_ok = True
            self.step_times: list[float] = []
            self.ever_changed = torch.zeros(0, dtype=torch.bool)
            self.round_start = torch.zeros(0)
            self.residual = torch.zeros(0)
            self.ef_density: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            """The first snapshot: the model's parameters before the first step."""
            self.params = list(model.parameters())  # tied weights once
            self.snapshots = [bf16_view(self.params)]
            self.prev = flat_float(self.params)
            self.step_times = [time.monotonic()]
            self.ever_changed = torch.zeros(self.snapshots[0].numel(), dtype=torch.bool)
            self.round_start, self.residual = self.prev, torch.zeros_like(self.prev)
            self.ef_density = []

        def on_step_end(
            self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any
        ) -> None:  # fmt: skip
            """A snapshot after the optimizer step, what changed, and the step's update binned by r."""
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
            if round_steps > 0 and len(self.steps) % round_steps == 0:
                density, self.residual = error_feedback_round(self.round_start, now, self.residual)
                self.ef_density.append(density)
                self.round_start = now

    return SnapshotCallback()


def window_summary(snapshots: Sequence[torch.Tensor], ks: Iterable[int]) -> dict[str, dict[str, Any]]:
    """The ``S`` record of a run: for every k (a string key) the :func:`summarize` of S_k(t) over the windows and
    ``per_window``, every S_k(t). Raises ``ValueError`` as :func:`k_step_sparsity` does."""
    windows = k_step_sparsity(snapshots, ks)
    return {str(k): {**summarize(v), "per_window": v} for k, v in windows.items()}


def mechanism_summary(steps: Sequence[dict[str, Any]], precision: str) -> dict[str, Any] | None:
    """The ``mechanism`` record of a run from the callback's per-step records: the bins' counts summed over the
    steps, the median of r and the fraction with r >= 1 per step; ``None`` when a step has no mechanism record (a
    bf16 run whose optimizer state could not be rebuilt)."""
    mech = [s for s in steps if "total" in s]
    if not mech or len(mech) != len(steps):
        return None
    return {
        "update": "exact FP32 master change" if precision == "fp32" else "AdamW step before rounding (rebuilt)",
        "total": [sum(s["total"][i] for s in mech) for i in range(NUM_BINS)],
        "changed": [sum(s["changed"][i] for s in mech) for i in range(NUM_BINS)],
        "median_r_per_step": [s["median_r"] for s in mech],
        "frac_r_ge_1_per_step": [s["frac_r_ge_1"] for s in mech],
    }
