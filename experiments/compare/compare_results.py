"""The numbers of ``experiments/compare/compare.py``: what each run's workers wrote (:func:`summarize_worker`,
:func:`summarize`) and the rows of its tables, per learning rate and strategy over the seeds (:func:`aggregate`).

A run's files are read tolerantly (:mod:`harness.report`, :mod:`harness.run_outputs`): a file that is missing or cut
short gives ``None`` values, never an exception. :func:`aggregate` also reads the results of a ``compare.json``
written by an earlier version: fields it lacks give ``None``; a result without the oldest fields (``strategy``,
``lr``, ``final``, ``density``, ...) raises ``KeyError``.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from pathlib import Path
from typing import Any

from compare_runs import StrategyRun
from harness.report import mean, read_json, read_records
from harness.run_outputs import allreduce_bytes, count_parameters, store_summary

MIN_GAIN = 0.05
"""By the greedy reward, a strategy learned at a learning rate when every seed's final reward beats the starting
model's and the mean gain is at least this (5 of the 100 evaluation prompts; one answer more is 0.01)."""

SAMPLED_Z = 2.0
"""By the held-out sampled reward (used wherever every run at a learning rate has it), a strategy learned when every
seed's gain exceeds this many standard errors of the difference, sqrt(se_before^2 + se_after^2)."""


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x), held constant beyond the last one."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def summarize_worker(out: Path, recipe: str, num_workers: int, swarm: bool) -> dict[str, Any]:
    """What one worker's output directory says: final metric (and where it came from), bytes sent (wire) and
    payload bytes, train time, steps, rounds, density per round, its round records (swarm peers, for
    :func:`summarize`), and its curve of (bytes sent, training seconds, logged loss or reward) per logging step."""
    state = read_json(out / "trainer_state.json")
    history = [e for e in state.get("log_history", []) if isinstance(e, dict)]
    steps = state.get("global_step")
    runtime = next((e["train_runtime"] for e in reversed(history) if "train_runtime" in e), None)
    curve_key = "loss" if recipe == "pretrain" else "reward"
    logged = [e for e in history if e.get(curve_key) is not None and "step" in e]
    final, source = None, None
    evaluation = read_json(out / "grpo_eval.json")
    if recipe == "pretrain":
        evals = [e["eval_loss"] for e in history if e.get("eval_loss") is not None]
        if evals:
            final, source = evals[-1], "eval"
        elif logged:
            final, source = logged[-1][curve_key], "train"
    else:
        final, source = evaluation.get("reward_after"), "greedy"
    rounds = read_records(out / "pulseloco_rounds.jsonl")
    num_params = count_parameters(out)
    result: dict[str, Any] = {
        "final": final,
        "source": source,
        "reward_before": evaluation.get("reward_before"),
        "sampled_before": evaluation.get("sampled_reward_before"),
        "sampled_after": evaluation.get("sampled_reward_after"),
        "sampled_se_before": evaluation.get("sampled_se_before"),
        "sampled_se_after": evaluation.get("sampled_se_after"),
        "steps": steps,
        "train_seconds": runtime,
        "num_params": num_params,
        "rounds": len(rounds),
        "group_sizes": sorted({r["num_peers"] for r in rounds}),
        "density": [r["density"] for r in rounds],
        "incomplete_rounds": sum(1 for r in rounds if not r.get("complete", True)),
    }
    # the curve's x values at a logging step: bytes sent by then, and training seconds by then
    inner = steps // len(rounds) if swarm and rounds and steps else None  # a round every inner_steps steps
    result["round_records"] = rounds if swarm else []  # pooled over the peers by summarize()
    if inner:
        result["bytes_sent"] = sum(r["bytes_sent"] for r in rounds)
        result["bytes_received"] = sum(r["bytes_received"] for r in rounds)
        has_payload = all("payload_bytes" in r for r in rounds)  # files written before the field: unknown
        result["payload_bytes"] = sum(r["payload_bytes"] for r in rounds) if has_payload else None
        ends = [inner * (r["round"] + 1) for r in rounds]  # round r ends at step (r + 1) H, after its outer step
        sent = [(end, r["bytes_sent"]) for end, r in zip(ends, rounds)]

        def sent_by(step: float) -> float:
            return float(sum(num for end, num in sent if end <= step))

        clock = [(0.0, 0.0)]
        for end, r in zip(ends, rounds):
            # the time training stopped for the round (overlapped rounds exchange during the next inner steps)
            clock.append((float(end), clock[-1][1] + r["seconds_inner"] + r.get("seconds_blocked", r["seconds_sync"])))
    else:
        per_step = allreduce_bytes(num_params, num_workers) if num_params is not None and not swarm else None
        result["bytes_sent"] = per_step * steps if per_step is not None and steps is not None else None
        result["bytes_received"] = result["bytes_sent"]
        # ddp's payload: its FP32 gradient once per optimizer step, as an all-gather through a store would upload it
        payload_per_step = 4 * num_params if num_params is not None and not swarm else None
        result["payload_bytes"] = payload_per_step * steps if payload_per_step is not None and steps else None

        def sent_by(step: float) -> float:
            return per_step * step if per_step is not None else 0.0

        clock = [(0.0, 0.0), (float(steps or 0), float(runtime or 0.0))]  # the Trainer logs no time per step
    result["curve"] = [(sent_by(e["step"]), _interpolate(clock, e["step"]), e[curve_key]) for e in logged]
    store = out / "versions"
    if store.is_dir() and num_params:
        sizes = store_summary(store)
        patches = list(sizes["patches"].values())
        result["pulsesync"] = {
            "versions": len(sizes["anchors"]) + len(patches),
            "anchors": len(sizes["anchors"]),
            "patches": len(patches),
            "mean_patch_bytes": sum(patches) / len(patches) if patches else None,
            "mean_anchor_bytes": sum(sizes["anchors"].values()) / len(sizes["anchors"]) if sizes["anchors"] else None,
            "bf16_copy_bytes": 2 * num_params,
        }
    return result


def _per(totals: dict[str, Any] | None, numerator: str, denominator: str) -> float | None:
    """``totals[numerator] / totals[denominator]``; ``None`` without ``totals``, either key, or a denominator."""
    if not totals or totals.get(numerator) is None or not totals.get(denominator):
        return None
    return float(totals[numerator] / totals[denominator])


def entry_split(traffic: dict[str, Any] | None) -> dict[str, float | None] | None:
    """A :func:`~pulseloco.loco.metrics.traffic_summary` as bytes per selected entry: the wire bytes and their
    parts (``index_bytes + value_bytes + sum_bytes + header_bytes == wire_bytes``: the pushed parts' index and
    value sections, the shard sums served, everything else), the payload, and the summary's index bits per entry
    (pushed parts, payload) next to the uniform-subset bound; ``None`` without a summary (ddp), a value ``None``
    where the records lacked its fields."""
    if traffic is None:
        return None
    selected = traffic["num_sent"]

    def per_entry(key: str) -> float | None:
        return traffic[key] / selected if traffic[key] is not None and selected else None

    return {
        "wire_bytes": traffic["wire_bytes_per_entry"],
        "index_bytes": per_entry("sent_index_bytes"),
        "value_bytes": per_entry("sent_value_bytes"),
        "sum_bytes": per_entry("sent_sum_bytes"),
        "header_bytes": traffic["header_bytes_per_entry"],
        "payload_bytes": traffic["payload_bytes_per_entry"],
        "index_bits_pushed": traffic["index_bits_per_entry"],
        "index_bits_payload": traffic["payload_index_bits_per_entry"],
        "index_bits_bound": traffic["index_bound_bits_per_entry"],
        "sum_bytes_per_union_entry": traffic["sum_bytes_per_entry"],
    }


def summarize(run: StrategyRun, recipe: str, num_workers: int) -> dict[str, Any]:
    """One run: final metric (mean over workers), wire bytes sent and received and payload bytes per worker (in
    total and per round; ddp's received: as many as sent, its estimate),
    train seconds (slowest worker), wall seconds, density per round (mean over the peers), the byte split of
    every peer's rounds together (swarm strategies: ``traffic``, a :func:`~pulseloco.loco.metrics.traffic_summary`,
    and ``bytes_per_entry``, its :func:`entry_split`), PULSESync sizes; the curve of the first worker."""
    swarm = run.strategy != "ddp"
    workers = [summarize_worker(out, recipe, num_workers, swarm) for out in run.workers]
    traffic = None
    if swarm:
        from pulseloco.loco.metrics import traffic_summary  # here: importing pulseloco.loco loads torch

        traffic = traffic_summary([r for w in workers for r in w["round_records"]])  # every peer's rounds
    if not swarm:  # ddp: the processes it ran, from the recipe's start line ("processes=W")
        found = [int(m) for p in run.procs for m in re.findall(r"processes=(\d+)", p.text())]
        for worker in workers:
            worker["group_sizes"] = sorted(set(found))
    wall = [p.ended - p.started for p in run.procs if p.ended is not None]
    seconds = [w["train_seconds"] for w in workers if w["train_seconds"] is not None]
    sources = sorted({w["source"] for w in workers if w["final"] is not None})
    num_rounds = min((len(w["density"]) for w in workers), default=0)
    return {
        "strategy": run.strategy,
        "lr": run.plan.lr,
        "seed": run.plan.seed,
        "seed_index": run.plan.seed_index,
        "limited": run.plan.limited,
        "error": run.error,
        "workers": num_workers,
        "final": mean([w["final"] for w in workers]),
        "final_source": sources[0] if len(sources) == 1 else ("mixed" if sources else None),
        "reward_before": mean([w["reward_before"] for w in workers]),
        "sampled_before": mean([w.get("sampled_before") for w in workers]),
        "sampled_after": mean([w.get("sampled_after") for w in workers]),
        "sampled_se_before": mean([w.get("sampled_se_before") for w in workers]),
        "sampled_se_after": mean([w.get("sampled_se_after") for w in workers]),
        "bytes_per_worker": mean([w["bytes_sent"] for w in workers]),
        "bytes_received_per_worker": mean([w["bytes_received"] for w in workers]),
        "bytes_measured": swarm,
        "payload_bytes_per_worker": mean([w["payload_bytes"] for w in workers]),
        "wire_bytes_per_round": _per(traffic, "bytes_sent", "rounds"),
        "received_bytes_per_round": _per(traffic, "bytes_received", "rounds"),
        "payload_bytes_per_round": _per(traffic, "payload_bytes", "rounds"),
        "entries_per_round": _per(traffic, "num_sent", "rounds"),
        "traffic": traffic,
        "bytes_per_entry": entry_split(traffic),
        "train_seconds": max(seconds) if seconds else None,
        "wall_seconds": max(wall) if wall and len(wall) == len(run.procs) else None,
        "steps": workers[0]["steps"] if workers else None,
        "num_params": workers[0]["num_params"] if workers else None,
        "rounds": workers[0]["rounds"] if workers else 0,
        "incomplete_rounds": sum(w["incomplete_rounds"] for w in workers),
        "group_sizes": sorted({g for w in workers for g in w["group_sizes"]}),
        "density": [mean([w["density"][r] for w in workers]) for r in range(num_rounds)],
        "pulsesync": next((w["pulsesync"] for w in workers if "pulsesync" in w), None),
        "curve": workers[0]["curve"] if workers else [],
    }


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (learning rate, strategy) over the seeds of the limited (or only) network: the final metric's mean,
    standard deviation and range, the held-out sampled reward's (:func:`_sampled_stats`), bytes, times, density per
    round, PULSESync; ratios to DiLoCo and DDP at the same learning rate.

    Learning and quality (``learned_by``, ``improved``, ``within_diloco_range``): where every strategy's runs at a
    learning rate have the held-out sampled reward with its standard errors, by that (every seed's gain beyond
    :data:`SAMPLED_Z` standard errors; its mean after training within DiLoCo's range over its seeds), else by
    the final metric (every seed above the starting model and a mean gain of at least :data:`MIN_GAIN`; its mean
    within DiLoCo's range). ``within_diloco_range`` is ``None`` without a DiLoCo row of at least 2 seeds.

    Bytes: wire bytes sent (``bytes_per_worker``, ``vs_diloco``, ``vs_ddp``: against a ddp run's bytes at the same
    learning rate, else against the same estimate, :func:`_ddp_estimate`), wire bytes received
    (``bytes_received_per_worker``; ddp's estimate: as many as sent) and payload (``payload_bytes_per_worker``,
    ``payload_vs_diloco``, ``payload_vs_ddp``) per worker over the run, their means per worker and round
    (``wire_bytes_per_round``, ``received_bytes_per_round``, ``payload_bytes_per_round``; ddp's over
    ``steps_per_round`` optimizer steps, the swarm strategies' round at that learning rate), the wire bytes sent
    and received per round in payloads per round (``payloads_sent_per_round``, ``payloads_received_per_round``:
    how many of its own payloads a worker's exchange costs), the selected entries per worker and round, and the
    mean over seeds of every value of the runs' ``bytes_per_entry``. Results written before these fields existed
    give ``None`` there (received bytes per round: from the run's ``traffic`` where it has one)."""
    groups: dict[tuple[float | None, str], list[dict[str, Any]]] = {}
    for r in results:
        if r["limited"] and not r["error"]:
            groups.setdefault((r["lr"], r["strategy"]), []).append(r)
    rows = []
    for (lr, strategy), runs in groups.items():
        finals = [r["final"] for r in runs if r["final"] is not None]
        befores = [r["reward_before"] for r in runs if r.get("reward_before") is not None]
        rounds = min(len(r["density"]) for r in runs)
        syncs = [r["pulsesync"] for r in runs if r["pulsesync"] and r["pulsesync"]["mean_patch_bytes"]]
        rows.append(
            {
                "lr": lr,
                "strategy": strategy,
                "seeds": len(runs),
                "final_mean": mean(finals),
                "final_std": statistics.stdev(finals) if len(finals) > 1 else None,
                "final_min": min(finals, default=None),
                "final_max": max(finals, default=None),
                "reward_before": mean(befores),
                "sampled_before": mean([r.get("sampled_before") for r in runs]),
                "sampled_after": [r.get("sampled_after") for r in runs],
                "sampled_se_after": [r.get("sampled_se_after") for r in runs],
                "greedy_improved": bool(finals)
                and len(befores) == len(finals)
                and all(f > b for f, b in zip(finals, befores))
                and statistics.fmean(finals) - statistics.fmean(befores) >= MIN_GAIN,
                **_sampled_stats(runs),
                "bytes_per_worker": mean([r["bytes_per_worker"] for r in runs]),
                "bytes_measured": runs[0]["bytes_measured"],
                "payload_bytes_per_worker": mean([r.get("payload_bytes_per_worker") for r in runs]),
                "bytes_received_per_worker": mean([_received(r) for r in runs]),
                "wire_bytes_per_round": mean([r.get("wire_bytes_per_round") for r in runs]),
                "received_bytes_per_round": mean([_received_per_round(r) for r in runs]),
                "payload_bytes_per_round": mean([r.get("payload_bytes_per_round") for r in runs]),
                "steps": mean([r.get("steps") for r in runs]),
                "steps_per_round": mean([_per(r, "steps", "rounds") for r in runs]),
                "entries_per_round": mean([r.get("entries_per_round") for r in runs]),
                "bytes_per_entry": _mean_dicts([r.get("bytes_per_entry") for r in runs]),
                "train_seconds": mean([r["train_seconds"] for r in runs]),
                "wall_seconds": mean([r["wall_seconds"] for r in runs]),
                "density": [mean([r["density"][i] for r in runs]) for i in range(rounds)],
                "patch_bytes": mean([s["mean_patch_bytes"] for s in syncs]),
                "bf16_copy_bytes": syncs[0]["bf16_copy_bytes"] if syncs else None,
                "incomplete_rounds": sum(r["incomplete_rounds"] for r in runs),
                **_ddp_estimate(runs),
            }
        )
    for row in rows:  # ddp has no rounds: its bytes over as many optimizer steps as the swarm's round
        swarm_round = mean([r["steps_per_round"] for r in rows if r["lr"] == row["lr"] and r["strategy"] != "ddp"])
        if row["strategy"] == "ddp" and swarm_round and row["steps"]:
            row["steps_per_round"] = swarm_round
            for key, total_key in _PER_ROUND_TOTALS.items():
                total = row[total_key]
                row[key] = total * swarm_round / row["steps"] if total is not None else None
    for row in rows:
        same_lr = {r["strategy"]: r for r in rows if r["lr"] == row["lr"]}
        # without a ddp run, its bytes are the same estimate a ddp run would report (they are never measured)
        estimate = {
            "bytes_per_worker": row["ddp_bytes_estimate"],
            "payload_bytes_per_worker": row["ddp_payload_estimate"],
        }
        for base in ("diloco", "ddp"):
            ref = same_lr.get(base) or (estimate if base == "ddp" else {})
            b = ref.get("bytes_per_worker")
            row[f"vs_{base}"] = row["bytes_per_worker"] / b if row["bytes_per_worker"] is not None and b else None
            p = ref.get("payload_bytes_per_worker")
            own = row["payload_bytes_per_worker"]
            row[f"payload_vs_{base}"] = own / p if own is not None and p else None
        for key, own_key, ref_key in (
            ("vs_fp32_diloco", "bytes_per_worker", "fp32_diloco_bytes"),
            ("payload_vs_fp32_diloco", "payload_bytes_per_worker", "fp32_diloco_payload"),
        ):
            own, ref = row[own_key], row[ref_key]
            row[key] = own / ref if own is not None and ref else None
        by_sampled = all(r["sampled_improved"] is not None for r in same_lr.values())
        row["learned_by"] = "sampled" if by_sampled else "greedy"
        row["improved"] = row["sampled_improved"] if by_sampled else row["greedy_improved"]
        key = "sampled" if by_sampled else "final"  # the quality metric: the one that judged learning
        diloco = same_lr.get("diloco")
        row["within_diloco_range"] = (
            diloco[f"{key}_min"] <= row[f"{key}_mean"] <= diloco[f"{key}_max"]
            if diloco and diloco["seeds"] > 1 and row[f"{key}_mean"] is not None and diloco[f"{key}_min"] is not None
            else None
        )
        row["above_diloco_range"] = (
            row[f"{key}_mean"] > diloco[f"{key}_max"] if row["within_diloco_range"] is False and diloco else None
        )
        row["patch_vs_bf16"] = row["patch_bytes"] / row["bf16_copy_bytes"] if row["patch_bytes"] else None
        payload = row["payload_bytes_per_round"]
        for key, wire in (("payloads_sent_per_round", "wire_bytes_per_round"),
                          ("payloads_received_per_round", "received_bytes_per_round")):  # fmt: skip
            row[key] = row[wire] / payload if row[wire] is not None and payload else None
    return rows


_PER_ROUND_TOTALS = {
    "wire_bytes_per_round": "bytes_per_worker",
    "received_bytes_per_round": "bytes_received_per_worker",
    "payload_bytes_per_round": "payload_bytes_per_worker",
}
"""ddp's bytes per round (:func:`aggregate`) and the total per worker each is a share of."""


def _received(run: dict[str, Any]) -> float | None:
    """A run's wire bytes received per worker: ``bytes_received_per_worker``; for a run whose bytes are estimated
    (ddp), its bytes sent where a result lacks the field (received = sent, as :func:`summarize_worker` estimates
    them); else ``None`` without the field."""
    received = run.get("bytes_received_per_worker")
    if received is None and not run.get("bytes_measured", True):
        return run.get("bytes_per_worker")
    return received


def _received_per_round(run: dict[str, Any]) -> float | None:
    """A swarm run's wire bytes received per worker and round: ``received_bytes_per_round``, else (a result written
    before the field) from its ``traffic`` (``bytes_received / rounds`` over every peer's rounds); ``None``
    without either (ddp's are set by :func:`aggregate`)."""
    received = run.get("received_bytes_per_round")
    return received if received is not None else _per(run.get("traffic"), "bytes_received", "rounds")


def _ddp_estimate(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """What ddp would send per worker over these runs' steps, as compare estimates it for a ddp run (never
    measured): a ring all-reduce of FP32 gradients every optimizer step (``ddp_bytes_estimate``) and its payload,
    4 bytes per parameter per step (``ddp_payload_estimate``); and what DiLoCo sends without compression over these
    runs' rounds, the published baseline (``fp32_diloco_bytes``: a ring all-reduce of FP32 pseudo-gradients a
    round; ``fp32_diloco_payload``: 4 bytes per parameter a round). Means over the runs, ``None`` where a run lacks
    its parameter count, workers or steps (results written before these fields)."""
    known = bool(runs) and all(r.get("num_params") and r.get("workers") and r.get("steps") for r in runs)
    return {
        "ddp_bytes_estimate": mean([allreduce_bytes(r["num_params"], r["workers"]) * r["steps"] for r in runs])
        if known
        else None,
        "ddp_payload_estimate": mean([4.0 * r["num_params"] * r["steps"] for r in runs]) if known else None,
        "fp32_diloco_bytes": mean([allreduce_bytes(r["num_params"], r["workers"]) * len(r["density"]) for r in runs])
        if known
        else None,
        "fp32_diloco_payload": mean([4.0 * r["num_params"] * len(r["density"]) for r in runs]) if known else None,
    }


def _sampled_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out sampled reward of one learning rate's and strategy's runs: per seed the gain and its standard
    error sqrt(se_before^2 + se_after^2); whether every seed's gain exceeds :data:`SAMPLED_Z` of them
    (``sampled_improved``; ``None`` when a run lacks a value: ``--num_eval_samples 0``, a missing file, results
    written before the fields); the mean and range of the final values over the seeds (``None`` when none)."""
    fields = ("sampled_before", "sampled_after", "sampled_se_before", "sampled_se_after")
    complete = bool(runs) and all(r.get(f) is not None for r in runs for f in fields)
    gains = [r["sampled_after"] - r["sampled_before"] for r in runs] if complete else []
    ses = [math.hypot(r["sampled_se_before"], r["sampled_se_after"]) for r in runs] if complete else []
    after = [r["sampled_after"] for r in runs if r.get("sampled_after") is not None]
    return {
        "sampled_gain": gains,
        "sampled_gain_se": ses,
        "sampled_improved": all(g > SAMPLED_Z * se for g, se in zip(gains, ses)) if complete else None,
        "sampled_mean": statistics.fmean(after) if after else None,
        "sampled_min": min(after, default=None),
        "sampled_max": max(after, default=None),
    }


def _mean_dicts(dicts: list[dict[str, float | None] | None]) -> dict[str, float | None] | None:
    """Key by key :func:`harness.report.mean` of the dicts given (``None`` entries skipped); ``None`` when there are
    none."""
    present = [d for d in dicts if d]
    return {key: mean([d.get(key) for d in present]) for key in present[0]} if present else None
