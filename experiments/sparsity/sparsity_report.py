"""The report of ``experiments/sparsity/sparsity_study.py``: ``sparsity.md`` (the tables in the PULSE paper's layout,
notes, and sentences written from the numbers) and the plots ``sparsity_ratio.png`` and ``sparsity_k.png``, all from the
report dictionary the study writes as ``sparsity.json``. matplotlib loads inside :func:`write_plots`.

The functions read the report's keys as ``experiments/sparsity/sparsity_study.py`` writes them: a report without one
raises ``KeyError``; files that cannot be written raise ``OSError``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.report import pyplot
from sparsity import NUM_BINS, RATIO_EDGES, band_density

BANDS = (
    (0.0, 0.1, "r < 0.1"), (0.1, 10**-0.5, "0.1 <= r < 0.32"), (10**-0.5, 1.0, "0.32 <= r < 1"),
    (1.0, 10**0.5, "1 <= r < 3.2"), (10**0.5, math.inf, "r >= 3.2"),
)  # fmt: skip
"""Bands of r (bin edges) for the explanation in sparsity.md."""


def pct(x: float) -> str:
    """A fraction as a percentage with two decimals, without the sign: ``0.9912`` -> ``99.12``."""
    return f"{100 * x:.2f}"


def mean_and_se(values: list[float]) -> tuple[float, float] | None:
    """Mean and standard error (sample standard deviation / sqrt(n); 0 for one value) of ``values``; ``None`` when
    it is empty."""
    if not values:
        return None
    n = len(values)
    mean = sum(values) / n
    var = sum((x - mean) ** 2 for x in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def reward_quarters(run: dict[str, Any], steps: int) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """Mean and standard error of the sampled rewards TRL logged in the first and in the last quarter of the steps
    (``None`` for a quarter without a logged reward)."""
    quarter = max(1, steps // 4)
    first = [r for s, r in run["rewards"] if s <= quarter]
    last = [r for s, r in run["rewards"] if s > steps - quarter]
    return mean_and_se(first), mean_and_se(last)


def late_window_density(run: dict[str, Any], k: int) -> float:
    """1 - S_k averaged over the last quarter of the windows (at least one): the density of k steps once the
    optimizer's moments have warmed up (a fresh AdamW's first steps move every entry by about lr)."""
    windows = run["S"][str(k)]["per_window"]
    tail = windows[-max(1, len(windows) // 4) :]
    return 1 - sum(tail) / len(tail)


def late_round_density_ef(run: dict[str, Any]) -> float | None:
    """The density per round under error feedback (``density_per_round_ef``) averaged over the last quarter of the
    rounds (at least one); ``None`` for a run without rounds (fewer steps than a round, or a sparsity.json written
    before the field)."""
    rounds = run.get("density_per_round_ef") or []
    tail = rounds[-max(1, len(rounds) // 4) :]
    return sum(tail) / len(tail) if tail else None


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
    """Short sentences written from the numbers (the "What the data say" section of sparsity.md)."""
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
            ef = [d for d in map(late_round_density_ef, mine) if d is not None]
            if len(ef) == len(mine):
                pairs = ", ".join(
                    f"{r['lr']:g}: {pct(late_window_density(r, int(kmax)))}% -> {pct(d)}%" for r, d in zip(mine, ef)
                )
                lines.append(
                    f"- **{precision}**: over the last quarter, 1 - S_{kmax} (a round's own changes) -> the density "
                    f"per round of {kmax} steps with error feedback (what a peer sends: the residual of earlier "
                    f"rounds' invisible changes becomes visible too), by lr: {pairs}."
                )
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
    gains = []
    for r in runs:
        early, late = reward_quarters(r, report["settings"]["steps"])
        if early is not None and late is not None:
            gain, se = late[0] - early[0], math.hypot(early[1], late[1])
            verdict = "learned" if gain > 2 * se else "not beyond 2 standard errors"
            gains.append(f"{r['precision']} lr {r['lr']:g}: {gain:+.3f} ± {se:.3f} ({verdict})")
    if gains:
        lines.append(
            "- Sampled reward (TRL's logged mean per step), last quarter of the steps minus the first, ± the standard "
            "error of the difference: " + "; ".join(gains) + "."
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
    """``sparsity.md``: the S_k table, the per-run table, notes and :func:`explanation`."""
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
    kmax = max(ks)
    lines += [
        "",
        f"| precision | lr | density 1-S_1 (%) | 1-S_1, last quarter (%) | 1-S_{kmax}, last quarter (%) | per round "
        f"of {kmax} with error feedback, last quarter (%) | never changed (%) | median r | r >= 1 (%) | sampled "
        "reward: mean, first -> last quarter (± standard error) | seconds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        f = run_facts(run)
        median_r = f"{f['median_r']:.3g}" if f["median_r"] is not None else "n/a"
        frac = pct(f["frac_r_ge_1"]) if f["frac_r_ge_1"] is not None else "n/a"
        mean = "n/a" if run["reward_mean"] is None else f"{run['reward_mean']:.3f}"
        first, last = ("n/a" if q is None else f"{q[0]:.3f} ± {q[1]:.3f}" for q in reward_quarters(run, run["steps"]))
        cells = [run["precision"], f"{run['lr']:g}", pct(f["density"]), pct(late_window_density(run, 1))]
        ef = late_round_density_ef(run)
        cells += [pct(late_window_density(run, kmax)), "n/a" if ef is None else pct(ef)]
        cells += [pct(run["never_changed"]), median_r, frac]
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
    """``sparsity_ratio.png`` (fraction changed against r, a panel per precision) and ``sparsity_k.png`` (S_k mean
    against k) in ``out``; raises ImportError without matplotlib."""
    plt = pyplot()

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
