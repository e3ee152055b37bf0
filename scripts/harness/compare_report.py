"""The outputs of ``scripts/compare.py``: ``compare.md`` (a table per learning rate, the byte tables, the targets and
quality verdicts, how the numbers were made), the four plots and ``compare.json``, from the runs' results and the
rows of :func:`harness.compare_results.aggregate`.

The functions read the keys ``scripts/compare.py`` writes (``meta``, rows, results): a dictionary without one raises
``KeyError``; rows of an older ``compare.json`` without the newer byte fields print ``-``. Files that cannot be
written raise ``OSError``; the plots need matplotlib (``ImportError`` without it).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from harness.compare_results import MIN_GAIN, SAMPLED_Z, aggregate
from harness.compare_runs import STRATEGIES
from harness.report import fmt, human, pyplot

TARGETS = {"diloco": 1 / 17, "ddp": 1 / 100, "pulsesync": 1 / 50}
"""The paper's claims: pulseloco's bytes against DiLoCo's and DDP's, PULSESync patches against a BF16 copy."""


def fraction(value: float | None) -> str:
    """``0.0588`` as ``1/17``; ``-`` for none."""
    if value is None:
        return "-"
    return f"1/{1 / value:.3g}" if 0 < value < 1 else f"{value:.3g}x"


def reward_cell(row: dict[str, Any]) -> str:
    """The final metric's cell: ``mean ± sd [min, max]`` over the seeds (the mean alone for one seed; ``-``)."""
    if row["final_mean"] is None:
        return "-"
    text = f"{row['final_mean']:.3f}"
    if row["final_std"] is not None:
        text += f" ± {row['final_std']:.3f} [{row['final_min']:.3f}, {row['final_max']:.3f}]"
    return text


def sampled_cell(row: dict[str, Any]) -> str:
    """The held-out sampled reward's cell: before -> after, with the sampling standard error for one seed, else the
    mean and [min, max] over the seeds; ``-`` where the runs wrote none (``--num_eval_samples 0``, older results)."""
    if row.get("sampled_mean") is None:
        return "-"
    before = row.get("sampled_before")
    text = "" if before is None else f"{before:.3f} -> "
    if len(row["sampled_after"]) == 1:
        se = row["sampled_se_after"][0]
        return text + f"{row['sampled_mean']:.3f}" + ("" if se is None else f" ± {se:.3f}")
    return text + f"{row['sampled_mean']:.3f} [{row['sampled_min']:.3f}, {row['sampled_max']:.3f}]"


def lr_label(lr: float | None) -> str:
    """``lr 1e-06``, or the config's learning rate for ``None``."""
    return "the config's learning rate" if lr is None else f"lr {lr:g}"


def verdict(value: float | None, target: float) -> str:
    """A ratio against its target: ``1/17 (met)`` or ``1/10 (missed by 1.7x)``; ``not measured`` for ``None``."""
    if value is None:
        return "not measured"
    return f"{fraction(value)} ({'met' if value <= target else f'missed by {value / target:.2g}x'})"


def learned_rule(row: dict[str, Any]) -> str:
    """What ``learned`` meant for ``row`` (:func:`harness.compare_results.aggregate`'s ``learned_by``)."""
    if row.get("learned_by") == "sampled":
        return f"every seed's held-out sampled gain beyond {SAMPLED_Z:g} standard errors"
    return f"every seed above the warm model, mean gain >= {MIN_GAIN:g}"


def quality_verdict(row: dict[str, Any], diloco: dict[str, Any] | None) -> str:
    """Whether ``row``'s quality matches DiLoCo's at the same learning rate (its mean within DiLoCo's range over
    seeds, by the metric that judged learning: the held-out sampled reward where every run has it, else the final
    metric), or why it is not judged (no DiLoCo run, one of them did not learn, DiLoCo has one seed)."""
    if diloco is None:
        return "no diloco run to compare with"
    if not diloco["improved"] or not row["improved"]:
        who = [name for name, r in (("diloco", diloco), (row["strategy"], row)) if not r["improved"]]
        return f"not judged: {' and '.join(who)} did not learn ({learned_rule(row)})"
    if row["within_diloco_range"] is None:
        return "not judged: DiLoCo needs at least 2 seeds for a range"
    where = "within" if row["within_diloco_range"] else "outside"
    key, name = ("sampled", " of the held-out sampled reward") if row.get("learned_by") == "sampled" else ("final", "")
    return (
        f"mean{name} {row[f'{key}_mean']:.3f} {where} DiLoCo's range [{diloco[f'{key}_min']:.3f}, "
        f"{diloco[f'{key}_max']:.3f}] over {diloco['seeds']} seeds"
    )


def byte_tables(at: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of the two byte tables of one learning rate's rows: wire and payload bytes per worker
    and round with their ratios to DiLoCo and DDP (every strategy), then the wire bytes per selected entry split
    into indices, values, shard sums and headers, with the index bits per entry against the entropy bound (the
    sparse strategies: swarm rows other than diloco). Rows without the fields (an older compare.json): ``-``."""
    lines = [
        "| strategy | wire B / worker / round | wire vs DiLoCo | wire vs DDP | payload B / worker / round | "
        "payload vs DiLoCo | payload vs DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in at:
        est = "" if r["bytes_measured"] else " (est.)"
        wire, payload = r.get("wire_bytes_per_round"), r.get("payload_bytes_per_round")
        cells = [
            r["strategy"],
            "-" if wire is None else human(wire) + est,
            fraction(r["vs_diloco"]),
            fraction(r["vs_ddp"]),
            "-" if payload is None else human(payload) + est,
            fraction(r.get("payload_vs_diloco")),
            fraction(r.get("payload_vs_ddp")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    sparse = [r for r in at if r["strategy"] not in ("ddp", "diloco") and r.get("bytes_per_entry")]
    if not sparse:
        return lines
    lines += [
        "| strategy | entries / worker / round | wire B/entry | = indices | + values | + sums (index + value) | "
        "+ headers | payload B/entry | index bits/entry: pushed / payload / bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sparse:
        e = r["bytes_per_entry"]
        bits = " / ".join(fmt(e[k], ".2f") for k in ("index_bits_pushed", "index_bits_payload", "index_bits_bound"))
        cells = [r["strategy"], fmt(r.get("entries_per_round"), ",.0f")]
        cells += [fmt(e[k], ".2f") for k in ("wire_bytes", "index_bytes", "value_bytes", "sum_bytes")]
        cells += [fmt(e["header_bytes"], ".3f"), fmt(e["payload_bytes"], ".2f"), bits]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _lr_section(lr: float, rows: list[dict[str, Any]], metric: str) -> list[str]:
    """compare.md's section of one learning rate: the main table, the byte tables, the pulseloco targets."""
    lines: list[str] = []
    at = [r for r in rows if r["lr"] == lr]
    diloco = next((r for r in at if r["strategy"] == "diloco"), None)
    before = next((r["reward_before"] for r in at if r["reward_before"] is not None), None)
    seeds = sorted({r["seeds"] for r in at})
    head = f"## {lr_label(lr)}, {'/'.join(map(str, seeds))} seed{'s' if seeds != [1] else ''}"
    lines += [head + (f", {metric} before training {before:.3f}" if before is not None else ""), ""]
    lines += [
        f"| strategy | final {metric}: mean ± sd [min, max] | learned | held-out sampled reward: before -> after | "
        "bytes sent per worker | vs DiLoCo | vs DDP | density: round 1 → last | PULSESync patch / BF16 copy | "
        "train s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in at:
        b = r["bytes_per_worker"]
        density = r["density"]
        cells = [
            r["strategy"],
            reward_cell(r),
            ("yes" if r["improved"] else "no") if r["reward_before"] is not None else "-",
            sampled_cell(r),
            "-" if b is None else f"{human(b)}{'' if r['bytes_measured'] else ' (est.)'}",
            fraction(r["vs_diloco"]),
            fraction(r["vs_ddp"]),
            f"{density[0]:.2%} → {density[-1]:.2%}" if density else "-",
            fraction(r["patch_vs_bf16"]),
            "-" if r["train_seconds"] is None else f"{r['train_seconds']:.0f}",
            "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    rules = sorted({learned_rule(r) for r in at if r["reward_before"] is not None})
    lines += ["", *(f"- learned: {rule}." for rule in rules), ""] if rules else [""]
    lines += byte_tables(at)
    for r in at:
        if r["strategy"].startswith("pulseloco"):
            lines.append(
                f"- {r['strategy']} targets: bytes vs DiLoCo {verdict(r['vs_diloco'], TARGETS['diloco'])}, "
                f"vs DDP {verdict(r['vs_ddp'], TARGETS['ddp'])}; payload vs DiLoCo "
                f"{verdict(r.get('payload_vs_diloco'), TARGETS['diloco'])}, vs DDP "
                f"{verdict(r.get('payload_vs_ddp'), TARGETS['ddp'])}; PULSESync patch vs BF16 copy "
                f"{verdict(r['patch_vs_bf16'], TARGETS['pulsesync'])}; quality: {quality_verdict(r, diloco)}."
            )
    lines.append("")
    return lines


def _failed_section(results: list[dict[str, Any]]) -> list[str]:
    """compare.md's list of failed runs (none: no section)."""
    lines: list[str] = []
    failed = [r for r in results if r["error"]]
    if failed:
        lines += ["## Failed runs", ""]
        lines += [
            f"- {r['strategy']} {lr_label(r['lr'])} seed {r['seed']}: {r['error'].splitlines()[0]}" for r in failed
        ]
        lines.append("")
    return lines


def _loopback_section(results: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """compare.md's training times of a ``--bandwidth`` run against loopback (none: no section)."""
    lines: list[str] = []
    reference = [r for r in results if not r["limited"] and not r["error"]]
    if reference:
        lines += [f"## Training time at {meta['bandwidth']} against loopback", ""]
        lines += ["| strategy | train s, loopback | train s, limited | slowdown |", "|---|---|---|---|"]
        for ref in reference:
            limited = next(
                (r for r in results if r["limited"] and not r["error"] and (r["strategy"], r["lr"], r["seed"])
                 == (ref["strategy"], ref["lr"], ref["seed"])), None,
            )  # fmt: skip
            slow = limited["train_seconds"] if limited else None
            fast = ref["train_seconds"]
            cells = [ref["strategy"], f"{fast:.0f}" if fast else "-", f"{slow:.0f}" if slow else "-"]
            cells.append(f"{slow / fast:.2f}x" if slow and fast else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _notes_section(results: list[dict[str, Any]], meta: dict[str, Any], metric: str) -> list[str]:
    """compare.md's "How these numbers were made"."""
    lines: list[str] = []
    params = next((r["num_params"] for r in results if r.get("num_params")), None)
    lines += [
        "## How these numbers were made",
        "",
        f"- {meta['workers']} workers per strategy, {meta['steps'] or 'the config’s'} optimizer steps each, the same "
        f"batch size per worker; ddp is {meta['ddp_launch']}; the swarm strategies are peers of one process each "
        "(`accelerate launch`) through a bootstrap DHT, every round averaged by all of them.",
        "- bytes sent per worker: the swarm strategies' wire bytes measured by PulseLoCo (`bytes_sent` summed over "
        "the rounds in each peer's `pulseloco_rounds.jsonl`, mean over the peers and seeds); ddp's (est.) are not "
        f"measured: a ring all-reduce of FP32 gradients every optimizer step, 2(W-1)/W x 4 bytes x "
        f"{f'{params:,}' if params else 'N'} parameters x steps per worker, W = {meta['workers']}; where ddp did "
        "not run, 'vs DDP' is against the same estimate.",
        f"- final {metric}: {meta['metric_note']}; mean over the workers (swarm peers end on the consensus model), "
        "then mean, sample standard deviation and range over the seeds. 'learned': where every run at a learning "
        "rate wrote the held-out sampled reward, every seed's gain in it (after - before) above "
        f"{SAMPLED_Z:g} standard errors of the difference, sqrt(se_before^2 + se_after^2) (each the mean of the "
        "workers' errors: conservative for the mean over workers); else every seed's final reward above the warm "
        f"model's and the mean gain at least {MIN_GAIN:g}. Where a strategy did not learn, it is not judged on "
        "quality at that learning rate. Quality matches DiLoCo when the mean of the same metric lies within "
        "DiLoCo's range over its seeds.",
        "- wire vs payload (second table): wire bytes are what a worker sent, as above (a swarm peer's pushed "
        "parts plus the sums of its shard it served to the others, with headers); payload bytes are its own "
        "compressed pseudo-gradient as ONE frame of the same codec and value precision (`payload_bytes` in "
        "`pulseloco_rounds.jsonl`): what an all-gather through an object store, as in the paper, would upload. "
        "DiLoCo's payload is its dense FP32 frame, measured the same way; ddp's (est.) is its FP32 gradient, 4 "
        "bytes x parameters, once per optimizer step. Per worker and round: over every peer's rounds of a run, "
        "then mean over seeds; ddp has no rounds, so its bytes are over as many optimizer steps as one round of the "
        "swarm strategies at that learning rate (inner_steps). The ratios are of the totals per worker over the "
        "run (the same steps for every strategy).",
        "- bytes per selected entry (third table, sparse strategies): each total over every peer's rounds of a "
        "run divided by the entries the peers selected (`num_sent`), then mean over seeds; indices + values + "
        "sums + headers = wire (up to the cells' rounding). Indices and values: the sections of the parts pushed "
        "to the other shard owners; sums: the index and value sections of the shard sums a peer served (the "
        "union of the group's indices in its shard, with FP32 sums), once per member served; headers: everything "
        "else (stream and frame headers, checksums, protobuf framing, fetch requests, replies). Index bits per "
        "entry: of the pushed parts per entry pushed, and of the payload per entry selected, against the bound "
        "log2 C(N, k) / k of k uniformly random positions of N (`pulseloco.loco.metrics.traffic_summary`, "
        "`index_entropy_bits`).",
        "- density: the fraction of the parameters a peer sent in a round (mean over peers and seeds); DiLoCo "
        "sends all of them, top-k its fixed share.",
        "- PULSESync: peer 0 of each swarm run published every consensus version (`--publish`); the mean size of "
        "a version's patch file plus its signed envelope in the version store, against a full BF16 copy "
        "(2 bytes x parameters). The store also holds a full anchor every `anchor_every` versions (not counted).",
        "- train time: the Trainer's `train_runtime` of the slowest worker (swarm peers: with the outer rounds); "
        "wall time: from launch to exit, with imports, DHT start, evaluation and saving; mean over the seeds.",
        f"- network: {meta['network']}; "
        + (
            "the runs of one learning rate and seed ran concurrently (times are not comparable)."
            if meta["parallel"]
            else "runs ran one at a time."
        ),
        f"- recipe `{meta['recipe_path']}`, config `{meta['config']}`, seeds {meta['seed_note']}, "
        + (f"model `{meta['model']}`, " if meta.get("model") else "")
        + f"extra arguments: `{' '.join(meta['extra']) or 'none'}`.",
        "- plots: `compare_reward_bytes.png` and `compare_reward_time.png` (the "
        f"{meta['curve_label']} logged every few steps by the first worker, mean over seeds, running mean over "
        f"{SMOOTH} points, against bytes sent by then and training time), `compare_final.png` (final metric, mean "
        "and range, against bytes sent), `compare_density.png` (density per round). Every run is in `compare.json`.",
    ]
    return lines


def write_markdown(path: Path, rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """Write ``compare.md`` to ``path`` and return its text: per learning rate the main table, the byte tables and
    the pulseloco targets, then failed runs, the loopback comparison of a ``--bandwidth`` run, and the notes."""
    metric = meta["metric_label"]
    lrs = list(dict.fromkeys(r["lr"] for r in rows))
    lines = [f"# {meta['recipe']}: {', '.join(meta['strategies'])}", ""]
    lines += [f"Command: `{meta['command']}` ({meta['seconds'] / 60:.0f} min)", ""]
    lines += [f"{meta['date']}, commit {meta['commit']}, {meta['machine']}.", ""]
    for lr in lrs:
        lines += _lr_section(lr, rows, metric)
    lines += _failed_section(results)
    lines += _loopback_section(results, meta)
    lines += _notes_section(results, meta, metric)
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


SMOOTH = 4
"""The curve plots show a running mean over this many logged points (the sampled reward of 16 completions is
noisy)."""


def _smooth(values: list[float], window: int) -> list[float]:
    """Running mean over the last ``window`` values (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def _mean_curve(curves: list[list[tuple[float, float, float]]]) -> list[tuple[float, float, float]]:
    """The pointwise mean of curves logged at the same steps (cut to the shortest)."""
    length = min((len(c) for c in curves), default=0)
    return [tuple(statistics.fmean(c[i][k] for c in curves) for k in range(3)) for i in range(length)]  # type: ignore[misc]


def plot(out_dir: Path, rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Write the four plots (one panel per learning rate) and return their names."""
    plt = pyplot()

    lrs = list(dict.fromkeys(r["lr"] for r in rows)) or [None]
    styles = {"ddp": "-", "diloco": "--", "pulseloco": "-", "pulseloco-bf16": "-.", "sparseloco": ":"}
    colors = dict(zip(STRATEGIES, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))  # every plot
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    names = ["compare_reward_bytes.png", "compare_reward_time.png", "compare_final.png", "compare_density.png"]

    def panels() -> tuple[Any, list[Any]]:
        fig, axes = plt.subplots(1, len(lrs), figsize=(5.0 * len(lrs), 4.0), squeeze=False)
        for ax, lr in zip(axes[0], lrs):
            ax.set_title(lr_label(lr))
            ax.grid(True, alpha=0.3)
        return fig, list(axes[0])

    def save(fig: Any, axes: list[Any], name: str) -> None:
        handles, labels = axes[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)

    for name, x_index, x_label in ((names[0], 0, "bytes sent per worker"), (names[1], 1, "training time (s)")):
        fig, axes = panels()
        for ax, lr in zip(axes, lrs):
            for strategy in strategies:
                curves = [r["curve"] for r in results if r["lr"] == lr and r["strategy"] == strategy
                          and r["limited"] and not r["error"] and r["curve"]]  # fmt: skip
                curve = _mean_curve(curves)
                if curve:
                    xs, ys = [p[x_index] for p in curve], _smooth([p[2] for p in curve], SMOOTH)
                    ax.plot(xs, ys, styles[strategy], color=colors[strategy], marker="o", markersize=2, label=strategy)
            if x_index == 0:
                ax.set_xscale("symlog", linthresh=1e4)
            ax.set_xlabel(x_label)
            ax.set_ylabel(meta["curve_label"])
        save(fig, axes, name)

    fig, axes = panels()
    for ax, lr in zip(axes, lrs):
        for r in (r for r in rows if r["lr"] == lr and r["final_mean"] is not None and r["bytes_per_worker"]):
            low = r["final_mean"] - (r["final_min"] if r["final_min"] is not None else r["final_mean"])
            high = (r["final_max"] if r["final_max"] is not None else r["final_mean"]) - r["final_mean"]
            ax.errorbar([r["bytes_per_worker"]], [r["final_mean"]], yerr=[[low], [high]], fmt="o", capsize=3,
                        color=colors[r["strategy"]], label=r["strategy"])  # fmt: skip
        before = next((r["reward_before"] for r in rows if r["lr"] == lr and r["reward_before"] is not None), None)
        if before is not None:
            ax.axhline(before, color="grey", linewidth=0.8, linestyle=":", label="before training")
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker")
        ax.set_ylabel(f"final {meta['metric_label']}")
    save(fig, axes, names[2])

    fig, axes = panels()
    for ax, lr in zip(axes, lrs):
        for r in (r for r in rows if r["lr"] == lr and r["density"]):
            rounds = range(1, len(r["density"]) + 1)
            ax.plot(
                rounds,
                r["density"],
                styles[r["strategy"]],
                color=colors[r["strategy"]],
                marker="o",
                markersize=2,
                label=r["strategy"],
            )
        ax.set_yscale("log")
        ax.set_xlabel("outer round")
        ax.set_ylabel("fraction of parameters sent")
    save(fig, axes, names[3])
    return names


def write_outputs(out: Path, json_path: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Aggregate ``results`` and write compare.md (also printed), the plots and the JSON."""
    rows = aggregate(results)
    out.mkdir(parents=True, exist_ok=True)
    meta["plots"] = plot(out, rows, results, meta)
    print(write_markdown(out / "compare.md", rows, results, meta))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows, "results": results}, indent=1) + "\n")
