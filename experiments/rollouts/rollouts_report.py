"""What ``experiments/rollouts/bench_rollouts.py`` makes of its runs: one run's metrics from its records
(:func:`summarize_run`), the markdown tables over every case (:func:`build_tables`) and the two output files
(:func:`write_outputs`: ``bench_rollouts.json`` and ``bench_rollouts.md``, also what ``--report-only`` rebuilds).

``summarize_run`` and ``build_tables`` are pure (the tests feed them sample JSON lines); a metric that cannot be
computed (no train seconds, no samples) is None, and a case without measurements is left out of a table.
``write_outputs`` raises OSError when the output directory cannot be written.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from harness.report import cell, mb, md_table, percentile

BATCH = 16  # per_device_train_batch_size of grpo-tiny.yaml: completions per step


def summarize_run(
    *,
    steps: int,
    train_seconds: float,
    rollouts: list[dict[str, Any]],
    published: list[dict[str, Any]],
    workers: list[list[dict[str, Any]]],
    batch: int = BATCH,
    outer_rounds: list[dict[str, Any]] | None = None,
    leases: list[list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The metrics of one run from its records (pure: the tests feed it sample JSON lines). ``outer_rounds``: the
    trainer's ``pulseloco_rounds.jsonl``, its outer rounds (the bench's lone trainer runs one, at the end: its
    ``inner_steps`` is the step count); their ``seconds_blocked`` (the inner optimizer stopped) add up to
    ``outer_round_seconds``. ``leases``: each worker's ``leases.jsonl``; over all workers, the seconds leases
    waited for their version (``began`` to ``started``: the lease's ``min_version``, or the engine's load of a
    version just applied) and generated."""
    train_rounds = [r for r in rollouts if r.get("mode", "train") == "train"]
    waiting = sum(float(r.get("seconds_waiting", 0.0)) for r in train_rounds)
    checking = sum(float((r.get("verify") or {}).get("seconds", 0.0)) for r in train_rounds)
    lags: Counter[int] = Counter()
    for r in train_rounds:
        lags.update(int(x) for x in r.get("lags", []))
    last = train_rounds[-1] if train_rounds else {}
    by_worker: Counter[str] = Counter()
    for r in train_rounds:
        by_worker.update({k: int(v) for k, v in r.get("by_worker", {}).items()})
    versions = [p for p in published if p.get("event", "publish") == "publish"]
    patch_bytes = [int(p["patch_bytes"]) for p in versions if p.get("patch_bytes") is not None]
    serve = [float(v["seconds_to_serve"]) for w in workers for v in w if v.get("seconds_to_serve") is not None]
    received = [int(v["bytes_received"]) for w in workers for v in w if v.get("bytes_received") is not None]
    paths = Counter(str(v.get("path")) for w in workers for v in w)
    samples = steps * batch
    way = _version_way([v for w in workers for v in w])
    publish = [float(p["seconds_publish"]) for p in versions if p.get("seconds_publish") is not None]
    # from the first batch handed to TRL to the last: the steps of a long run, without the start (the first version's
    # way to the workers) and the run's end (the last step, the outer round, the last version's flush)
    span = float(last["time"]) - float(train_rounds[0]["time"]) if len(train_rounds) > 1 else 0.0
    return {
        "steps": steps,
        "samples": samples,
        "train_seconds": round(train_seconds, 2),
        "samples_per_s": round(samples / train_seconds, 3) if train_seconds > 0 else None,
        "steps_per_min": round(60 * steps / train_seconds, 2) if train_seconds > 0 else None,
        "rounds": len(train_rounds),
        "steady_seconds": round(span, 2),
        "steady_samples_per_s": round((len(train_rounds) - 1) * batch / span, 3) if span > 0 else None,
        "seconds_waiting": round(waiting, 2),
        "wait_fraction": round(waiting / train_seconds, 3) if train_seconds > 0 else None,
        "seconds_checking": round(checking, 2),
        "check_fraction": round(checking / train_seconds, 3) if train_seconds > 0 else None,
        "seconds_publish_median": round(percentile(publish, 0.5), 3) if publish else None,
        "outer_round_seconds": round(sum(float(r.get("seconds_blocked", 0.0)) for r in outer_rounds or []), 2),
        **_lease_times(leases or []),
        **way,
        "lag_histogram": {str(k): lags[k] for k in sorted(lags)},
        "stale_dropped": int(last.get("stale_dropped", 0)),
        "refused": int(last.get("refused", 0)),
        "failed": int(last.get("failed", 0)),
        "local_rounds": sum(1 for r in train_rounds if r.get("local")),
        "completions_by_worker": dict(sorted(by_worker.items())),
        "versions_published": len(versions),
        "patch_bytes": patch_bytes,
        "patch_bytes_median": percentile([float(b) for b in patch_bytes[1:]], 0.5),  # version 1 is the anchor
        "worker_versions": [len(w) for w in workers],
        "worker_paths": dict(sorted(paths.items())),
        "bytes_received_per_version_median": percentile([float(b) for b in received], 0.5),
        "seconds_to_serve": [round(s, 3) for s in serve],
        "seconds_to_serve_median": round(percentile(serve, 0.5), 3) if serve else None,
        "seconds_to_serve_p90": round(percentile(serve, 0.9), 3) if serve else None,
        "seconds_to_serve_max": round(max(serve), 3) if serve else None,
    }


def _version_way(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of a version's way to a worker, over every worker and version after the first (the first anchor's
    fetch is the start-up): from publishing to the fetch's start (``seconds_to_serve - seconds_update -
    seconds_load``: the head's discovery), the fetch and apply (``seconds_update``), the engine's load."""
    later = [v for v in records if v.get("path") != "anchor" or v.get("version", 0) > 1]
    keys = ("seconds_to_serve", "seconds_update", "seconds_load")
    full = [v for v in later if all(v.get(k) is not None for k in keys)]
    found = [float(v["seconds_to_serve"]) - float(v["seconds_update"]) - float(v["seconds_load"]) for v in full]

    def median(values: list[float]) -> float | None:
        return round(percentile(values, 0.5), 3) if values else None

    return {
        "version_found_median": median(found),
        "version_fetch_median": median([float(v["seconds_update"]) for v in full]),
        "version_load_median": median([float(v["seconds_load"]) for v in full]),
    }


def _lease_times(leases: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Over every worker's lease records: seconds waiting for a version and generating (None without records)."""
    records = [r for worker in leases for r in worker if all(k in r for k in ("began", "started", "seconds"))]
    if not records:
        return {"leases": 0, "lease_version_wait_seconds": None, "lease_generate_seconds": None}
    return {
        "leases": len(records),
        "lease_version_wait_seconds": round(sum(float(r["started"]) - float(r["began"]) for r in records), 2),
        "lease_generate_seconds": round(sum(float(r["seconds"]) for r in records), 2),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded to 3 places; None when either is None or zero."""
    return round(a / b, 3) if a and b else None


Done = dict[tuple[str, Any], dict[str, Any]]
"""The results with a throughput, by ``(case name, seed)``."""


def seed_ratios(by: Done, numerator: str, denominator: str, key: str = "samples_per_s") -> str:
    """``numerator``'s samples per second (``key``) over ``denominator``'s, each seed that has both paired with
    itself: one ratio, or every seed's and their mean (``0.918 / 0.841 (seeds 0 / 1), mean 0.880``); ``-`` when no
    seed has both (runs of a report older than ``key`` lack it)."""
    seeds = sorted(
        {seed for name, seed in by if name == numerator and (denominator, seed) in by},
        key=lambda seed: (str(type(seed)), seed),
    )
    ratios = [ratio(by[numerator, s].get(key), by[denominator, s].get(key)) for s in seeds]
    seeds = [s for s, r in zip(seeds, ratios, strict=True) if r is not None]
    values = [r for r in ratios if r is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return cell(values[0], 3)
    listed = " / ".join(cell(v, 3) for v in values)
    return f"{listed} (seeds {' / '.join(map(str, seeds))}), mean {sum(values) / len(values):.3f}"


def _throughput_table(results: list[dict[str, Any]], by: Done) -> list[str]:
    """(a): the tiny model's cases against the local run of the same seed."""
    out: list[str] = []
    tiny = [r for r in results if r.get("model") == "tiny" and r.get("steps")]
    if tiny:
        rows = []
        for r in tiny:
            local = by.get(("local", r.get("seed")))
            rows.append([
                r["name"], r.get("seed"), r["workers"], r["steps"], r["train_seconds"], r["samples_per_s"],
                r["steps_per_min"],
                ratio(r["samples_per_s"], local["samples_per_s"]) if local else None,
                r["seconds_waiting"], r["wait_fraction"], r["reward_before"], r["reward_after"],
                r["train_reward_last"],
            ])  # fmt: skip
        out.append("### (a) Throughput vs rollout workers (tiny warm model, loopback)\n")
        out.append("(x local: against the local run of the same seed)\n")
        out.append(md_table(
            ["case", "seed", "workers", "steps", "train s", "samples/s", "steps/min", "x local", "wait s", "wait frac",
             "greedy reward before", "after", "last train reward"], rows))  # fmt: skip
    return out


def _rate_limited_table(results: list[dict[str, Any]], by: Done) -> list[str]:
    """(b): the net model's cases, patches against full copies, and the throughput ratios, seed by seed."""
    out: list[str] = []
    net = [r for r in results if r.get("model") == "net" and r.get("steps")]
    if net:
        rows = []
        for r in net:
            rows.append([
                r["name"], r["workers"], "full BF16" if r["full"] else "patches", r["steps"], r["train_seconds"],
                r["samples_per_s"], r["steps_per_min"], r["wait_fraction"], mb(r["patch_bytes_median"]),
                mb(r["bytes_received_per_version_median"]), r["seconds_to_serve_median"], r["reward_after"],
            ])  # fmt: skip
        out.append("\n### (b) Rate-limited links: patches vs full copies\n")
        out.append(md_table(
            ["case", "workers", "sync", "steps", "train s", "samples/s", "steps/min", "wait frac",
             "published/version (median)", "received/version (median)", "to serve median s", "reward after"],
            rows))  # fmt: skip
        names = {name for name, _ in by}
        out.append("")
        out.append(f"- throughput patches / full copies (same link): {seed_ratios(by, 'netns-patch', 'netns-full')}")
        out.append(
            "- throughput patches over the link / same workers without a link limit: "
            f"{seed_ratios(by, 'netns-patch', 'nolimit-patch')}; from the first batch to the last (steady state: "
            "without the start and the run's end, its outer round and last flush): "
            f"{seed_ratios(by, 'netns-patch', 'nolimit-patch', 'steady_samples_per_s')}"
        )
        if "netns-open" in names:
            out.append(
                "- throughput patches over the link / through the same emulators without limits (netns-open): "
                f"{seed_ratios(by, 'netns-patch', 'netns-open')}; netns-open / without a link limit: "
                f"{seed_ratios(by, 'netns-open', 'nolimit-patch')}"
            )
        if "netns-slow" in names:
            out.append(
                "- throughput with one worker on the slow link / without a link limit: "
                f"{seed_ratios(by, 'netns-slow', 'nolimit-patch')}"
            )
    return out


def _time_table(results: list[dict[str, Any]]) -> list[str]:
    """(d): where the time went, on the trainer and on a version's way to the workers."""
    done = [r for r in results if r.get("steps") and r["workers"] and r.get("train_seconds")]
    if not done:
        return []
    rows = []
    for r in done:
        train, wait, check = r["train_seconds"], r["seconds_waiting"], r.get("seconds_checking") or 0.0
        rows.append([
            r["name"], train, round(wait - check, 2), check, round(train - wait, 2), r.get("outer_round_seconds"),
            r.get("trainer_cpu_seconds"), r.get("lease_generate_seconds"), r.get("lease_version_wait_seconds"),
            r.get("seconds_publish_median"),
            r.get("version_found_median"), r.get("version_fetch_median"), r.get("version_load_median"),
            r["seconds_to_serve_median"], r.get("emulator_cpu_seconds"), r.get("machine_busy_seconds"),
            r.get("machine_busy_share"),
        ])  # fmt: skip
    columns = [
        "case", "train s", "waiting for workers s", "checking s", "steps and publishing s",
        "of which outer round s", "trainer CPU s", "workers generating s", "leases waiting for a version s",
        "publish median s",
        "found median s", "fetch median s", "load median s", "to serve median s", "emulators' CPU s",
        "machine busy CPU s", "machine busy share",
    ]  # fmt: skip
    return [
        "\n### (d) Where the time went\n",
        "(trainer: its train seconds split into waiting for the workers' completions, checking them, and the rest: its "
        "own steps and publishing, of which the outer round (the lone trainer's exchange over the DHT, its inner "
        "optimizer stopped: one at the end of these runs), and the CPU seconds the trainer's process used in those "
        "train seconds (all its threads: steps, checks, publishing; not its DHT's processes); the workers' seconds, "
        "all of them together, generating leases and holding a lease while waiting for the version it needs (its "
        "min_version, or the engine's load of a version just applied); a version's way to a "
        "worker, medians over the versions after the first: publishing "
        "to the fetch's start, the fetch and apply, the engine's load, and publishing to serving; the link "
        "emulators' CPU seconds over the whole case, all of them together: what the emulation took from the cores; the "
        "machine's busy CPU seconds while the trainer ran, every process of the case on every core, and their share "
        "of the cores' time: near 1, the processes slow each other down, which separate machines would not)\n",
        md_table(columns, rows),
    ]


def _lag_table(results: list[dict[str, Any]]) -> list[str]:
    """(c): every swarm case's lag histogram, drops, versions and publish-to-serving latency."""
    out: list[str] = []
    done = [r for r in results if r.get("steps") and r["workers"]]
    if done:
        rows = []
        for r in done:
            hist = " ".join(f"{k}:{v}" for k, v in r["lag_histogram"].items()) or "-"
            rows.append([
                r["name"], hist, r["stale_dropped"], r["refused"], r["failed"], r["local_rounds"],
                r["versions_published"], "/".join(str(v) for v in r["worker_versions"]),
                " ".join(f"{k}:{v}" for k, v in r["worker_paths"].items()),
                r["seconds_to_serve_median"], r["seconds_to_serve_p90"], r["seconds_to_serve_max"],
            ])  # fmt: skip
        out.append("\n### (c) Lag, drops, publish-to-serving latency\n")
        out.append(md_table(
            ["case", "lag histogram (lag:completion groups)", "stale dropped", "refused", "failed", "local rounds",
             "versions published", "versions served per worker", "update paths", "to serve median s", "p90 s",
             "max s"], rows))  # fmt: skip
    return out


def _quality_table(results: list[dict[str, Any]]) -> list[str]:
    """The held-out greedy reward over seeds, when some case ran more than once."""
    out: list[str] = []
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("reward_after") is not None:
            by_case.setdefault(r["name"], []).append(r)
    if any(len(runs) > 1 for runs in by_case.values()):
        rows = []
        for name, runs in by_case.items():
            after = [r["reward_after"] for r in runs]
            train = [r["train_reward_last"] for r in runs if r.get("train_reward_last") is not None]
            rows.append([
                name, " ".join(str(r.get("seed")) for r in runs), runs[0]["reward_before"],
                " ".join(f"{x:.3f}" for x in after), sum(after) / len(after), min(after), max(after),
                " ".join(f"{x:.3f}" for x in train), sum(train) / len(train) if train else None,
            ])  # fmt: skip
        out.append("\n### Quality over seeds: held-out greedy reward after training\n")
        out.append(md_table(
            ["case", "seeds", "greedy before", "greedy after (per seed)", "mean", "min", "max",
             "last train reward (per seed)", "mean"], rows))  # fmt: skip
    return out


def build_tables(results: list[dict[str, Any]]) -> str:
    """Markdown tables of the results (pure): (a), (b), (c), (d), quality over seeds and the failed cases, each only
    when some result belongs in it."""
    by = {(r["name"], r.get("seed")): r for r in results if r.get("samples_per_s")}
    out = _throughput_table(results, by) + _rate_limited_table(results, by) + _lag_table(results)
    out += _time_table(results)
    out += _quality_table(results)
    failed = [r for r in results if "error" in r]
    if failed:
        out.append("\n### Failed cases\n")
        out += [f"- {r['name']} (rows above: partial, up to the stall): {r['error'].splitlines()[0]}" for r in failed]
    return "\n".join(out) + "\n"


def write_outputs(payload: dict[str, Any], out: Path) -> str:
    """Write ``payload`` (the script's JSON) to ``out``/bench_rollouts.json and its header and tables to
    ``out``/bench_rollouts.md (``out`` made if missing); returns the markdown. Raises OSError when they cannot be
    written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rollouts.json").write_text(json.dumps(payload, indent=1) + "\n")
    head = [f"# bench_rollouts ({payload.get('date', '')})", "", f"command: `{payload.get('command', '')}`", ""]
    if payload.get("net_model"):
        m = payload["net_model"]
        head.append(
            f"netns model: tiny warm model grown to {m['num_hidden_layers']} layers x hidden {m['hidden_size']} "
            f"x MLP {m['intermediate_size']}: {m['num_params'] / 1e6:.1f}M parameters, "
            f"{m['bf16_bytes'] / 1e6:.1f} MB in BF16; greedy reward {m['greedy_reward_base']:.3f} (tiny) -> "
            f"{m['greedy_reward_grown']:.3f} (grown); link {payload.get('rate_label', '')}"
        )
        head.append("")
    core = payload.get("args", {}).get("trainer_core")
    if core is not None:
        head += [f"trainer pinned to core {core} with one torch thread; every other process on the other cores", ""]
    text = "\n".join(head) + build_tables(payload["results"])
    (out / "bench_rollouts.md").write_text(text)
    return text
