"""The outputs of ``experiments/compare/compare.py``: ``compare.md`` (a table per learning rate, the byte tables, the
frontier table, the targets and quality verdicts, where the runs came from, how the numbers were made), the five plots
and ``compare.json``, from the runs' results and the rows of :func:`compare_results.aggregate`; and the merge of
several ``compare.json`` files for ``--report`` (:func:`merge_reports`).

The functions read the keys ``experiments/compare/compare.py`` writes (``meta``, rows, results): a dictionary without
one raises ``KeyError``; rows of an older ``compare.json`` without the newer byte fields print ``-``. Files that cannot
be written raise ``OSError``; the plots need matplotlib (``ImportError`` without it).
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from compare_results import MIN_GAIN, SAMPLED_Z, aggregate
from compare_runs import STRATEGIES
from harness.report import fmt, human, pyplot

TARGETS = {
    "diloco": 1 / 17,
    "ddp": 1 / 100,
    "pulsesync": 1 / 50,
    "sparseloco_wire": 1 / 146,
    "sparseloco_payload": 1 / 180,
    "best_at_diloco_quality": 1 / 146,
}
"""The targets, as fractions of a reference: pulseloco's bytes (wire and payload) against DiLoCo's (``diloco``) and
DDP's (``ddp``), PULSESync patches against a BF16 copy (``pulsesync``); SparseLoCo's (k = 64, the ``sparseloco`` row)
wire and payload bytes against DiLoCo's (``sparseloco_wire``, ``sparseloco_payload``); the wire bytes of the strategy
that sends the fewest among those whose quality matches DiLoCo's (:func:`best_at_diloco_quality`) against DiLoCo's
(``best_at_diloco_quality``)."""
SPARSELOCO_K64 = "sparseloco"
"""The row the SparseLoCo targets judge: SparseLoCo at its default k = 64 per 64x64 tile."""

STYLES: dict[str, tuple[str, Any, str]] = {
    "ddp": ("tab:blue", "-", "s"),
    "diloco": ("tab:orange", "--", "D"),
    "pulseloco": ("tab:green", "-", "o"),
    "pulseloco-bf16": ("tab:red", "-.", "v"),
    "sparseloco": ("tab:purple", ":", "^"),
    "sparseloco-k128": ("tab:brown", (0, (5, 2, 1, 2)), "<"),
    "pulseloco-2bit": ("tab:pink", (0, (3, 1, 1, 1, 1, 1)), ">"),
    "pulseloco-2bit-k64": ("tab:olive", (0, (1, 1)), "P"),
    "sparseloco-gather": ("indigo", "--", "^"),
    "sparseloco-topk": ("orchid", "-", "v"),
    "sparseloco-topk-x1": ("darkviolet", "--", "v"),
    "sparseloco-topk-x4": ("hotpink", ":", "v"),
    "pulseloco-2bit-topk": ("crimson", ":", ">"),
    "pulseloco-topk": ("teal", "--", "o"),
    "diloco-published": ("saddlebrown", ":", "D"),
    "pulseloco-published": ("navy", "-.", "o"),
    "diloco-overlap": ("darkorange", ":", "D"),
    "sparseloco-overlap": ("mediumpurple", "-.", "^"),
}
"""Every strategy's color, line style and marker in every plot (one distinct color each)."""
SPARE_STYLES = (
    ("tab:gray", "-", "X"),
    ("tab:cyan", "--", "*"),
    ("black", "-.", "h"),
    ("gold", ":", "d"),
)
"""Styles, cycled in order, of strategies without an entry in :data:`STYLES` (names in an older compare.json)."""
MERGE_SETTINGS = ("recipe", "config", "model", "steps", "lrs", "workers", "extra", "network", "parallel")
"""The ``meta`` fields that must be equal for :func:`merge_reports` to report several compare.json together."""


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
    """What ``learned`` meant for ``row`` (:func:`compare_results.aggregate`'s ``learned_by``)."""
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
    where = "within" if row["within_diloco_range"] else ("above" if row.get("above_diloco_range") else "below")
    key, name = ("sampled", " of the held-out sampled reward") if row.get("learned_by") == "sampled" else ("final", "")
    return (
        f"mean{name} {row[f'{key}_mean']:.3f} {where} DiLoCo's range [{diloco[f'{key}_min']:.3f}, "
        f"{diloco[f'{key}_max']:.3f}] over {diloco['seeds']} seeds"
    )


def matches_diloco(row: dict[str, Any], diloco: dict[str, Any] | None) -> bool | None:
    """Whether ``row``'s quality is at least DiLoCo's by :func:`quality_verdict`'s rule: its mean within DiLoCo's
    range over seeds, or above it; ``None`` where that rule does not judge (no DiLoCo row, either did not learn,
    DiLoCo with fewer than 2 seeds)."""
    if diloco is None or not diloco["improved"] or not row["improved"] or row["within_diloco_range"] is None:
        return None
    return bool(row["within_diloco_range"] or row.get("above_diloco_range"))


def match_cell(row: dict[str, Any], diloco: dict[str, Any] | None) -> str:
    """The frontier table's "matches DiLoCo" cell: ``reference`` (DiLoCo itself), ``yes`` (within DiLoCo's range over
    seeds), ``yes: above its range``, ``no: below its range``, or ``not judged`` with the reason in brief."""
    if row["strategy"] == "diloco":
        return "reference"
    match = matches_diloco(row, diloco)
    if match is not None:
        return ("yes" if row["within_diloco_range"] else "yes: above its range") if match else "no: below its range"
    if diloco is None:
        return "not judged: no DiLoCo run"
    if not diloco["improved"] or not row["improved"]:
        return "not judged: did not learn"
    return "not judged: DiLoCo has 1 seed"


def best_at_diloco_quality(at: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """Of one learning rate's rows, the strategy other than DiLoCo with the fewest wire bytes per worker among those
    whose quality matches DiLoCo's (:func:`matches_diloco`), and ``""``; or ``None`` and why none qualifies."""
    diloco = next((r for r in at if r["strategy"] == "diloco"), None)
    if diloco is None:
        return None, "no diloco run to compare with"
    matching = [r for r in at if r["strategy"] != "diloco" and matches_diloco(r, diloco) and r["vs_diloco"]]
    if matching:
        return min(matching, key=lambda r: r["vs_diloco"]), ""
    if not diloco["improved"]:
        return None, f"DiLoCo did not learn ({learned_rule(diloco)})"
    if diloco["seeds"] < 2:
        return None, "quality is not judged: DiLoCo needs at least 2 seeds for a range"
    return None, "no strategy that learned has its mean within or above DiLoCo's range"


def sampled_spread(row: dict[str, Any]) -> tuple[float, float, str] | None:
    """The error bar of ``row``'s held-out sampled reward after training (``sampled_mean``): below and above the
    mean, and its kind: ``range`` (min and max over the seeds, 2 seeds or more), ``se`` (one seed: its sampling
    standard error, the mean of the workers' ``sampled_se_after``) or ``none`` (one seed without a standard error);
    ``None`` where the runs wrote no sampled reward."""
    mean_after = row.get("sampled_mean")
    if mean_after is None:
        return None
    if len([a for a in row["sampled_after"] if a is not None]) > 1:
        # max(0, .): the mean of equal values can land a rounding error outside them
        return max(0.0, mean_after - row["sampled_min"]), max(0.0, row["sampled_max"] - mean_after), "range"
    se = next((e for e in row.get("sampled_se_after") or [] if e is not None), None)
    return (se, se, "se") if se is not None else (0.0, 0.0, "none")


def after_cell(row: dict[str, Any]) -> str:
    """The frontier table's sampled reward after training: ``mean [min, max] (N seeds)``, or for one seed
    ``mean ± se (s.e.)``; ``-`` where the runs wrote none."""
    spread = sampled_spread(row)
    if spread is None:
        return "-"
    low, high, kind = spread
    mean_after = row["sampled_mean"]
    if kind == "range":
        return f"{mean_after:.3f} [{mean_after - low:.3f}, {mean_after + high:.3f}] ({row['seeds']} seeds)"
    return f"{mean_after:.3f}" + (f" ± {low:.3f} (s.e.)" if kind == "se" else "")


def spread_caption(rows: list[dict[str, Any]], short: bool = False) -> str:
    """What the frontier's error bars are, for the kinds :func:`sampled_spread` gives ``rows`` (``short``: for the
    plot)."""
    kinds = {spread[2] for spread in map(sampled_spread, rows) if spread is not None}
    parts = []
    if "range" in kinds:
        parts.append("min to max over seeds" + ("" if short else " (strategies with 2 or more seeds)"))
    if "se" in kinds:
        parts.append(
            "± sampling s.e. of one seed"
            if short
            else "± the sampling standard error of one seed (the mean of the workers' standard errors of the "
            "held-out sampled reward: the spread of the draws, not of seeds)"
        )
    if "none" in kinds:
        parts.append("none where one seed recorded no standard error")
    return "; ".join(parts) or "none (no held-out sampled reward)"


def frontier_table(at: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of one learning rate's frontier table: per strategy (most wire bytes first) its wire bytes
    per worker, wire and payload bytes against DiLoCo's, the held-out sampled reward after training with its spread
    (:func:`after_cell`), whether it learned and whether its quality matches DiLoCo's (:func:`match_cell`); no lines
    where no row has the sampled reward (``--num_eval_samples 0``, pretrain)."""
    if not any(r.get("sampled_mean") is not None for r in at):
        return []
    diloco = next((r for r in at if r["strategy"] == "diloco"), None)
    lines = [
        "| strategy | wire B / worker | wire vs DiLoCo | payload vs DiLoCo | wire / payload vs FP32 DiLoCo "
        "| held-out sampled reward after | learned | matches DiLoCo |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(at, key=lambda r: -(r["bytes_per_worker"] or 0.0)):
        b = r["bytes_per_worker"]
        cells = [
            r["strategy"],
            "-" if b is None else f"{human(b)}{'' if r['bytes_measured'] else ' (est.)'}",
            fraction(r["vs_diloco"]),
            fraction(r.get("payload_vs_diloco")),
            f"{fraction(r.get('vs_fp32_diloco'))} / {fraction(r.get('payload_vs_fp32_diloco'))}",
            after_cell(r),
            ("yes" if r["improved"] else "no") if r["reward_before"] is not None else "-",
            match_cell(r, diloco),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"- frontier (`frontier.png`): error bars {spread_caption(at)}.",
        "- FP32 DiLoCo: DiLoCo as published, uncompressed: a ring all-reduce of FP32 pseudo-gradients a round "
        "(2 (W-1)/W x 4 bytes x parameters) and a 4-byte-a-parameter payload; the measured DiLoCo row is the "
        "project's, whose FP32 frames the codec compresses losslessly.",
        "",
    ]
    return lines


def target_lines(at: list[dict[str, Any]]) -> list[str]:
    """The verdict lines of one learning rate's targets (:data:`TARGETS`): every pulseloco strategy's bytes, payload
    and PULSESync patches; SparseLoCo k = 64's wire and payload bytes; the best strategy at DiLoCo's quality."""
    lines = []
    diloco = next((r for r in at if r["strategy"] == "diloco"), None)
    for r in at:
        if r["strategy"].startswith("pulseloco"):
            lines.append(
                f"- {r['strategy']} targets: bytes vs DiLoCo {verdict(r['vs_diloco'], TARGETS['diloco'])}, "
                f"vs DDP {verdict(r['vs_ddp'], TARGETS['ddp'])}; payload vs DiLoCo "
                f"{verdict(r.get('payload_vs_diloco'), TARGETS['diloco'])}, vs DDP "
                f"{verdict(r.get('payload_vs_ddp'), TARGETS['ddp'])}; PULSESync patch vs BF16 copy "
                f"{verdict(r['patch_vs_bf16'], TARGETS['pulsesync'])}; quality: {quality_verdict(r, diloco)}."
            )
    sparse = next((r for r in at if r["strategy"] == SPARSELOCO_K64), None)
    if sparse is not None:
        lines.append(
            f"- {SPARSELOCO_K64} (k = 64) targets: wire bytes vs DiLoCo "
            f"{verdict(sparse['vs_diloco'], TARGETS['sparseloco_wire'])}, payload vs DiLoCo "
            f"{verdict(sparse.get('payload_vs_diloco'), TARGETS['sparseloco_payload'])} (against FP32 DiLoCo: "
            f"wire {verdict(sparse.get('vs_fp32_diloco'), TARGETS['sparseloco_wire'])}, payload "
            f"{verdict(sparse.get('payload_vs_fp32_diloco'), TARGETS['sparseloco_payload'])}); quality: "
            f"{quality_verdict(sparse, diloco)}."
        )
    best, why = best_at_diloco_quality(at)
    target = fraction(TARGETS["best_at_diloco_quality"])
    if best is None:
        lines.append(f"- best strategy at DiLoCo's quality (target <= {target} of DiLoCo's wire bytes): none ({why}).")
    else:
        lines.append(
            f"- best strategy at DiLoCo's quality: {best['strategy']}, wire bytes vs DiLoCo "
            f"{verdict(best['vs_diloco'], TARGETS['best_at_diloco_quality'])}."
        )
    return lines


def byte_tables(at: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of the two byte tables of one learning rate's rows: wire bytes sent and received and
    payload bytes per worker and round, the ratios of those sent and of the payload to DiLoCo's and DDP's, and the
    wire bytes sent and received in payloads (per round: how many of its own payloads a worker's exchange costs)
    (every strategy; ddp's estimated, received = sent), then the wire bytes per selected entry split into indices,
    values, shard sums and headers, with the index bits per entry against the entropy bound (the sparse
    strategies: swarm rows other than diloco). Rows without the fields (an older compare.json): ``-``."""
    lines = [
        "| strategy | wire B sent / worker / round | wire B received / worker / round | sent vs DiLoCo | sent vs DDP "
        "| payload B / worker / round | payload vs DiLoCo | payload vs DDP | payloads sent / round "
        "| payloads received / round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in at:
        est = "" if r["bytes_measured"] else " (est.)"
        wire, payload = r.get("wire_bytes_per_round"), r.get("payload_bytes_per_round")
        received = r.get("received_bytes_per_round")
        cells = [
            r["strategy"],
            "-" if wire is None else human(wire) + est,
            "-" if received is None else human(received) + est,
            fraction(r["vs_diloco"]),
            fraction(r["vs_ddp"]),
            "-" if payload is None else human(payload) + est,
            fraction(r.get("payload_vs_diloco")),
            fraction(r.get("payload_vs_ddp")),
            fmt(r.get("payloads_sent_per_round"), ".2f"),
            fmt(r.get("payloads_received_per_round"), ".2f"),
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
    """compare.md's section of one learning rate: the main table, the byte tables, the frontier table, the
    targets."""
    lines: list[str] = []
    at = [r for r in rows if r["lr"] == lr]
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
    lines += frontier_table(at)
    lines += target_lines(at)
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
        "- wire vs payload (second table): wire bytes sent are what a worker sent, as above (a swarm peer's pushed "
        "parts plus what it served to the others of its shard: the sums, the relayed parts or the kept aggregate, "
        "by the exchange; with headers), wire bytes received what it received (`bytes_received`; ddp's (est.): as "
        "many as sent); payload bytes are its own "
        "compressed pseudo-gradient as ONE frame of the same codec and value precision (`payload_bytes` in "
        "`pulseloco_rounds.jsonl`): what an all-gather through an object store, as in the paper, would upload. "
        "DiLoCo's payload is its dense FP32 frame, measured the same way; ddp's (est.) is its FP32 gradient, 4 "
        "bytes x parameters, once per optimizer step. Per worker and round: over every peer's rounds of a run, "
        "then mean over seeds; ddp has no rounds, so its bytes are over as many optimizer steps as one round of the "
        "swarm strategies at that learning rate (inner_steps). The ratios are of the totals per worker over the "
        "run (the same steps for every strategy). Payloads per round: wire bytes sent (received) per worker and "
        "round / payload bytes per worker and round, how many of its own payloads a worker's exchange costs it "
        "(an all-gather receives about W - 1; ddp's (est.) ring all-reduce sends and receives 2 (W - 1) / W).",
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
        "and range, against bytes sent), `compare_density.png` (density per round), `frontier.png` (the held-out "
        "sampled reward after training, mean over seeds, against wire bytes and against payload bytes per worker, "
        "one point per strategy; error bars as under each frontier table; the band: DiLoCo's range over its "
        "seeds). Every run is in `compare.json`.",
        "- targets: pulseloco strategies' wire and payload bytes <= "
        f"{fraction(TARGETS['diloco'])} of DiLoCo's and <= {fraction(TARGETS['ddp'])} of DDP's, PULSESync patches <= "
        f"{fraction(TARGETS['pulsesync'])} of a BF16 copy; SparseLoCo (k = 64) wire bytes <= "
        f"{fraction(TARGETS['sparseloco_wire'])} and payload <= {fraction(TARGETS['sparseloco_payload'])} of "
        "DiLoCo's; the strategy with the fewest wire bytes among those whose quality matches DiLoCo's (the rule "
        f"above) <= {fraction(TARGETS['best_at_diloco_quality'])} of DiLoCo's wire bytes. 'missed by Fx': the "
        "ratio is F times its target.",
    ]
    return lines


def _sources_section(meta: dict[str, Any]) -> list[str]:
    """compare.md's list of the compare.json files a ``--report`` read (:func:`merge_reports`' ``sources``): path,
    commit, date, command, the runs each contributed and those it replaced; none: no section."""
    sources = meta.get("sources") or []
    if not sources:
        return []
    lines = ["", "## Reported from", ""]
    if meta.get("reported_by"):
        lines += [f"Reported by commit {meta['reported_by']} from {len(sources)} compare.json:", ""]
    for src in sources:
        runs = ", ".join(f"{name} x{count}" for name, count in src.get("kept", {}).items()) or "none"
        line = f"- `{src['path']}`"
        if src.get("reported_from"):
            origins = "; ".join(
                f"`{o['path']}` (commit {o.get('commit') or 'not recorded'})" for o in src["reported_from"]
            )
            line += f", itself reported from {origins}"
        else:
            line += f": commit {src.get('commit') or 'not recorded'}, {src.get('date') or 'date not recorded'}"
            line += f", {src['machine']}" if src.get("machine") else ""
            line += f", `{src['command']}`" if src.get("command") else ""
        line += f"; runs kept: {runs}"
        if src.get("replaced"):
            line += f"; replaced {src['replaced']} run(s) of earlier files (same strategy, learning rate and seed)"
        lines.append(line + ".")
    return lines


def write_markdown(path: Path, rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """Write ``compare.md`` to ``path`` and return its text: per learning rate the main table, the byte tables, the
    frontier table and the targets, then failed runs, the loopback comparison of a ``--bandwidth`` run, the notes,
    and (``--report``) the compare.json files the runs came from."""
    metric = meta["metric_label"]
    lrs = list(dict.fromkeys(r["lr"] for r in rows))
    lines = [f"# {meta['recipe']}: {', '.join(meta['strategies'])}", ""]
    sources = meta.get("sources") or []
    if len(sources) > 1 or any(src.get("reported_from") for src in sources):
        lines += [f"Runs of {len(sources)} compare.json ({meta['seconds'] / 60:.0f} min in all), listed under "
                  "'Reported from'.", ""]  # fmt: skip
    else:
        lines += [f"Command: `{meta['command']}` ({meta['seconds'] / 60:.0f} min)", ""]
        lines += [f"{meta['date']}, commit {meta['commit']}, {meta['machine']}.", ""]
    for lr in lrs:
        lines += _lr_section(lr, rows, metric)
    lines += _failed_section(results)
    lines += _loopback_section(results, meta)
    lines += _notes_section(results, meta, metric)
    lines += _sources_section(meta)
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


def plot_styles(strategies: list[str]) -> dict[str, tuple[str, Any, str]]:
    """Color, line style and marker of each strategy: its :data:`STYLES` entry, else the next of
    :data:`SPARE_STYLES` (cycled) in the order given."""
    spare = itertools.cycle(SPARE_STYLES)
    return {s: STYLES[s] if s in STYLES else next(spare) for s in dict.fromkeys(strategies)}


def plot(out_dir: Path, rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Write the five plots (one panel per learning rate; the frontier: a row per learning rate, wire and payload
    bytes side by side) and return their names."""
    plt = pyplot()

    lrs = list(dict.fromkeys(r["lr"] for r in rows)) or [None]
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    styles = plot_styles([*STRATEGIES, *strategies, *(r["strategy"] for r in results)])
    names = ["compare_reward_bytes.png", "compare_reward_time.png", "compare_final.png", "compare_density.png"]

    def panels() -> tuple[Any, list[Any]]:
        fig, axes = plt.subplots(1, len(lrs), figsize=(max(7.0, 5.0 * len(lrs)), 4.5), squeeze=False)
        for ax, lr in zip(axes[0], lrs):
            ax.set_title(lr_label(lr))
            ax.grid(True, alpha=0.3)
        return fig, list(axes[0])

    def save(fig: Any, axes: list[Any], name: str) -> None:
        handles, labels = axes[0].get_legend_handles_labels()
        ncol = max(1, min(len(labels), int(fig.get_figwidth() / 1.7)))
        legend_rows = -(-len(labels) // ncol) if labels else 0
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize="small")
        fig.tight_layout(rect=(0, min(0.4, 0.02 + 0.3 * legend_rows / fig.get_figheight()), 1, 1))
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)

    def draw(ax: Any, xs: Any, ys: Any, strategy: str) -> None:
        color, linestyle, marker = styles[strategy]
        ax.plot(xs, ys, linestyle=linestyle, color=color, marker=marker, markersize=3, label=strategy)

    for name, x_index, x_label in ((names[0], 0, "bytes sent per worker"), (names[1], 1, "training time (s)")):
        fig, axes = panels()
        for ax, lr in zip(axes, lrs):
            for strategy in strategies:
                curves = [r["curve"] for r in results if r["lr"] == lr and r["strategy"] == strategy
                          and r["limited"] and not r["error"] and r["curve"]]  # fmt: skip
                curve = _mean_curve(curves)
                if curve:
                    draw(ax, [p[x_index] for p in curve], _smooth([p[2] for p in curve], SMOOTH), strategy)
            if x_index == 0:
                ax.set_xscale("symlog", linthresh=1e4)
            ax.set_xlabel(x_label)
            ax.set_ylabel(meta["curve_label"])
        save(fig, axes, name)

    fig, axes = panels()
    for ax, lr in zip(axes, lrs):
        for r in (r for r in rows if r["lr"] == lr and r["final_mean"] is not None and r["bytes_per_worker"]):
            low = max(0.0, r["final_mean"] - (r["final_min"] if r["final_min"] is not None else r["final_mean"]))
            high = max(0.0, (r["final_max"] if r["final_max"] is not None else r["final_mean"]) - r["final_mean"])
            color, _, marker = styles[r["strategy"]]
            ax.errorbar([r["bytes_per_worker"]], [r["final_mean"]], yerr=[[low], [high]], fmt=marker, capsize=3,
                        color=color, label=r["strategy"])  # fmt: skip
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
            draw(ax, range(1, len(r["density"]) + 1), r["density"], r["strategy"])
        ax.set_yscale("log")
        ax.set_xlabel("outer round")
        ax.set_ylabel("fraction of parameters sent")
    save(fig, axes, names[3])
    names.append(plot_frontier(plt, out_dir / "frontier.png", rows, lrs, styles))
    return names


def plot_frontier(
    plt: Any, path: Path, rows: list[dict[str, Any]], lrs: list[float | None], styles: dict[str, tuple[str, Any, str]]
) -> str:
    """Write ``frontier.png``: per learning rate (a row of panels) the held-out sampled reward after training (mean
    over seeds, error bars of :func:`sampled_spread`) against wire bytes per worker (left) and payload bytes per
    worker (right), log x, one labelled point per strategy; the warm model's sampled reward as a dotted line and
    DiLoCo's range over seeds as a band. A panel without sampled rewards says so. Returns the file's name."""
    fig, axes = plt.subplots(len(lrs), 2, figsize=(12.0, 4.5 * len(lrs)), squeeze=False)
    for (wire_ax, payload_ax), lr in zip(axes, lrs):
        at = [r for r in rows if r["lr"] == lr]
        diloco = next((r for r in at if r["strategy"] == "diloco"), None)
        before = next((r["sampled_before"] for r in at if r.get("sampled_before") is not None), None)
        for ax, key, label in ((wire_ax, "bytes_per_worker", "wire"), (payload_ax, "payload_bytes_per_worker",
                                                                          "payload")):  # fmt: skip
            ax.set_title(f"{lr_label(lr)}: {label} bytes")
            ax.grid(True, alpha=0.3)
            points = [(r, sampled_spread(r)) for r in at if r.get(key) and r.get("sampled_mean") is not None]
            for r, spread in points:
                low, high, _ = spread or (0.0, 0.0, "none")
                color, _, marker = styles[r["strategy"]]
                ax.errorbar([r[key]], [r["sampled_mean"]], yerr=[[low], [high]], fmt=marker, capsize=3, color=color,
                            label=r["strategy"])  # fmt: skip
                ax.annotate(r["strategy"], (r[key], r["sampled_mean"]), textcoords="offset points", xytext=(5, 4),
                            fontsize="x-small", color=color)  # fmt: skip
            if not points:
                ax.text(0.5, 0.5, "no held-out sampled reward", ha="center", va="center", transform=ax.transAxes)
                continue
            if before is not None:
                ax.axhline(before, color="grey", linewidth=0.8, linestyle=":", label="before training")
            if diloco is not None and diloco["seeds"] > 1 and diloco.get("sampled_min") is not None:
                ax.axhspan(diloco["sampled_min"], diloco["sampled_max"], color=styles["diloco"][0], alpha=0.12,
                           label="DiLoCo's range over seeds")  # fmt: skip
            ax.set_xscale("log")
            ax.set_xlabel(f"{label} bytes per worker (log)")
            ax.set_ylabel("held-out sampled reward after")
    height = fig.get_figheight()  # inches; below the panels: the caption, above it the legend
    fig.text(0.5, 0.08 / height, f"error bars: {spread_caption(rows, short=True)}", ha="center", va="bottom",
             fontsize="small")  # fmt: skip
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.35 / height), ncol=min(len(labels), 5),
                   fontsize="small")  # fmt: skip
    legend_rows = -(-len(labels) // 5) if labels else 0
    fig.tight_layout(rect=(0, min(0.5, (0.45 + 0.22 * legend_rows) / height), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def merge_reports(reports: list[tuple[str, dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The runs and ``meta`` of several compare.json (``(path, parsed JSON)``, in the order given) as one: every
    run of every file, where two files hold a run of the same strategy, learning rate, seed and network the later
    file's; ``meta`` of the first file with the union of the strategies, the seed counts of the merged runs, the
    runs' seconds summed, and ``sources``: per file its path, commit, date, machine and command as recorded, the
    runs it kept per strategy (``kept``) and how many of the earlier files' it replaced (a file written by an
    earlier ``--report``: instead of commit, date, machine and command, the sources it lists, ``reported_from``).
    Raises ValueError naming the settings
    (:data:`MERGE_SETTINGS`) that differ between files, and KeyError or TypeError for a file without ``meta`` or
    ``results``."""
    if not reports:
        raise ValueError("no compare.json given")
    metas = [data["meta"] for _, data in reports]
    if not all(isinstance(m, dict) and isinstance(data["results"], list) for m, (_, data) in zip(metas, reports)):
        raise TypeError("meta must be an object and results a list")
    first_path, first = reports[0][0], metas[0]
    for path, meta in zip((p for p, _ in reports[1:]), metas[1:]):
        differ = [key for key in MERGE_SETTINGS if meta.get(key) != first.get(key)]
        if differ:
            detail = "; ".join(f"{key}: {first.get(key)!r} vs {meta.get(key)!r}" for key in differ)
            raise ValueError(f"{path} was run with other settings than {first_path} ({detail})")
    kept: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}
    replaced = Counter[int]()
    for index, (_, data) in enumerate(reports):
        for run in data["results"]:
            key = (run["strategy"], run["lr"], run["seed"], run["limited"])
            if key in kept:
                replaced[index] += 1
            kept[key] = (index, run)
    results = [run for _, run in kept.values()]
    merged = dict(first)
    merged["strategies"] = list(dict.fromkeys(s for m in metas for s in m.get("strategies", [])))
    merged["seeds"] = [
        len({r["seed"] for r in results if r["lr"] == lr and r["limited"]}) for lr in first.get("lrs", [])
    ]
    merged["seconds"] = sum(m.get("seconds") or 0.0 for m in metas)
    merged["metric_sources"] = sorted({s for m in metas for s in m.get("metric_sources", [])})
    sources: list[dict[str, Any]] = []
    for index, ((path, _), meta) in enumerate(zip(reports, metas)):
        counts = Counter(run["strategy"] for i, run in kept.values() if i == index)
        own = {
            "path": path,
            "commit": meta.get("commit"),
            "date": meta.get("date"),
            "machine": meta.get("machine"),
            "command": meta.get("command"),
            "kept": dict(counts),
            "replaced": replaced[index],
        }
        if meta.get("sources"):  # written by --report: its meta's command, date and commit are its first file's
            own.update(commit=None, date=None, machine=None, command=None, reported_from=meta["sources"])
        sources.append(own)
    merged["sources"] = sources
    return results, merged


def write_outputs(out: Path, json_path: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Aggregate ``results`` and write compare.md (also printed), the plots and the JSON."""
    rows = aggregate(results)
    out.mkdir(parents=True, exist_ok=True)
    meta["plots"] = plot(out, rows, results, meta)
    print(write_markdown(out / "compare.md", rows, results, meta))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows, "results": results}, indent=1) + "\n")
