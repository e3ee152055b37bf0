#!/usr/bin/env python
"""The table at the end of scripts/demo.sh, from the metrics files of a demo run directory.

    python scripts/demo_report.py runs/demo-20260101 [--seconds S] [--json PATH]

Reads, per GRPO trainer peer ``RUN_DIR/peer*/``: ``pulseloco_rounds.jsonl`` (PulseLoCo's rounds),
``trainer_state.json`` (TRL's logs), ``grpo_eval.json`` (held-out greedy reward before and after) and, for the
publisher, ``pulsesync_versions.jsonl`` and its version store ``versions/``; and ``RUN_DIR/worker/rollouts.jsonl``
(the rollout worker) and, with ``--rollouts swarm``, ``RUN_DIR/peer*/rollouts.jsonl`` (each trainer's rollout
rounds). It prints:

* per peer: steps, outer rounds, the sampled GRPO reward (first and last log), the held-out greedy reward before
  and after, the bytes it sent, and what DiLoCo and DDP would have sent for the same run:
  DiLoCo all-reduces the dense FP32 pseudo-gradient once per round, DDP the FP32 gradients once per optimizer step;
  a ring all-reduce sends ``2 (W - 1) / W * 4 * params`` bytes per worker (``4 * params`` with W = 2 workers);
  then those bytes per selected entry, split (:func:`pulseloco.loco.metrics.traffic_summary`): the payload (the
  whole selection as one frame, what the paper's all-gather uploads), indices in bits per entry against their
  entropy bound, values, the shard sums served per union entry, and headers; ``-`` where a metrics file
  lacks the split;
* PULSESync: the version store's patches against full BF16 checkpoints (``2 * params`` bytes, the store's anchor
  size), and what the rollout worker received against one full checkpoint per version;
* rollouts: per trainer, the completions each rollout worker generated (and any generated locally), the version
  lag they were trained at, dropped-stale and refused counts, and the sampled reward at each log step;
* digests: every round's ``theta_digest`` equal across peers, and every version the rollout worker held equal to
  the digest the publisher announced for it.

Exits 1 when a digest did not match or an expected file is missing, else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from harness.report import fmt, human, mean, read_json, read_records
from harness.report import text_table as table
from harness.run_outputs import allreduce_bytes, store_summary


def ratio(baseline: float, value: float) -> str:
    """``baseline`` against ``value`` as ``39x less`` (``3.6x less`` under 10); ``n/a`` for a value of 0 or less."""
    if value <= 0:
        return "n/a"
    r = baseline / value
    return f"{r:.0f}x less" if r >= 10 else f"{r:.1f}x less"


def phase_bytes(rounds: list[dict[str, Any]], num_params: int, num_workers: int, steps: int) -> dict[str, Any]:
    """Bytes sent in ``rounds`` against DiLoCo (one dense all-reduce per round) and DDP (one per inner step), and
    their split per selected entry (``traffic``: :func:`pulseloco.loco.metrics.traffic_summary`)."""
    from pulseloco.loco.metrics import traffic_summary  # here: importing pulseloco loads torch and hivemind

    sent = sum(r["bytes_sent"] for r in rounds)
    dense = allreduce_bytes(num_params, num_workers)
    return {
        "rounds": len(rounds),
        "bytes_sent": sent,
        "density": sum(r["density"] for r in rounds) / len(rounds) if rounds else None,
        "diloco_bytes": dense * len(rounds),
        "ddp_bytes": dense * steps,
        "traffic": traffic_summary(rounds),
    }


def split_rows(peers: list[dict[str, Any]]) -> list[list[str]]:
    """Per peer with rounds: its bytes per selected entry and their split (``-`` where unknown)."""
    rows = []
    for p in peers:
        t = p["bytes"]["traffic"]
        if not p["bytes"]["rounds"]:
            continue
        rows.append(
            [p["name"], fmt(t["payload_bytes_per_entry"], ".2f"), fmt(t["wire_bytes_per_entry"], ".2f"),
             f"{fmt(t['index_bits_per_entry'], '.2f')} / {fmt(t['payload_index_bits_per_entry'], '.2f')} / "
             f"{fmt(t['index_bound_bits_per_entry'], '.2f')}",
             fmt(t["value_bytes_per_entry"], ".2f"), fmt(t["sum_bytes_per_entry"], ".2f"),
             fmt(t["header_bytes_per_entry"], ".3f")]
        )  # fmt: skip
    return rows


def binomial_se(p: float, n: int) -> float:
    """Standard error of a success rate ``p`` measured on ``n`` problems."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n > 0 else float("nan")


SPARSE_REGIME_DENSITY = 0.05
"""Mean fraction of entries sent per round at or below which a run is in PULSE's sparse regime. The paper measures
about 99% of the per-step BF16 updates invisible at lr 1e-6 to 3e-6 (about 1% of the entries change per step), a few
percent per round of H steps; above this the byte ratio is that of a learning rate the paper's argument does not
cover."""


def regime(p: dict[str, Any]) -> str:
    """Where a peer's run stands against PULSE's sparse regime: its learning rate and mean density per round."""
    density = p["bytes"]["density"]
    if density is None:
        return "-"
    lr = f"lr {p['learning_rate']:.0e}, " if p.get("learning_rate") else ""
    where = "sparse regime" if density <= SPARSE_REGIME_DENSITY else "ABOVE the sparse regime"
    return f"{where} ({lr}{density:.1%}/round)"


def gain_lines(peers: list[dict[str, Any]]) -> list[str]:
    """What RL gained: the consensus model's greedy reward before and after, with standard errors, its held-out
    sampled reward before and after (where grpo_eval.json has it), and the sampled reward of TRL's logs over the
    first and last quarter of the run."""
    p = next((p for p in peers if p["greedy_reward_after"] is not None and p["num_eval_prompts"]), None)
    if p is None or p["greedy_reward_before"] is None:
        return ["what RL gained: unknown (no peer wrote grpo_eval.json)"]
    n, before, after = int(p["num_eval_prompts"]), float(p["greedy_reward_before"]), float(p["greedy_reward_after"])
    lines = [
        f"what RL gained: greedy reward {before:.3f} +- {binomial_se(before, n):.3f} -> {after:.3f} +- "
        f"{binomial_se(after, n):.3f} ({after - before:+.3f}) on {n} problems (+- one standard error)"
    ]
    if p.get("heldout_sampled_after") is not None and p.get("heldout_sampled_before") is not None:
        sb, sa = float(p["heldout_sampled_before"]), float(p["heldout_sampled_after"])
        lines.append(
            f"                held-out sampled reward ({p['num_eval_samples']} draws per problem): {sb:.3f} +- "
            f"{float(p['heldout_sampled_se_before']):.3f} -> {sa:.3f} +- {float(p['heldout_sampled_se_after']):.3f} "
            f"({sa - sb:+.3f})"
        )
    first = mean([q["sampled_reward_first_quarter"] for q in peers])
    last = mean([q["sampled_reward_last_quarter"] for q in peers])
    if first is not None and last is not None:
        lines.append(
            f"                sampled reward (TRL's logs, mean over the peers): first quarter {first:.3f} -> last "
            f"quarter {last:.3f} ({last - first:+.3f})"
        )
    return lines


def peer_summary(peer_dir: Path, num_workers: int) -> dict[str, Any]:
    """One GRPO trainer's rounds (pulseloco_rounds.jsonl), TRL's logs (trainer_state.json) and its held-out
    greedy reward before and after training (grpo_eval.json)."""
    rounds = read_records(peer_dir / "pulseloco_rounds.jsonl")
    state = read_json(peer_dir / "trainer_state.json")
    evaluation = read_json(peer_dir / "grpo_eval.json")
    sampled = [e["reward"] for e in state.get("log_history", []) if "reward" in e]
    rates = [e["learning_rate"] for e in state.get("log_history", []) if "learning_rate" in e]
    num_params = rounds[0]["numel"] if rounds else 0
    steps = int(state.get("global_step", 0))
    inner_steps = steps // len(rounds) if rounds else None
    return {
        "name": peer_dir.name,
        "finished": bool(evaluation),
        "num_params": num_params,
        "inner_steps": inner_steps,
        "steps": steps,
        "rounds": len(rounds),
        "num_peers": [r["num_peers"] for r in rounds],
        "sampled_reward_first": sampled[0] if sampled else None,
        "sampled_reward_last": sampled[-1] if sampled else None,
        "greedy_reward_before": evaluation.get("reward_before"),
        "greedy_reward_after": evaluation.get("reward_after"),
        "num_eval_prompts": evaluation.get("num_eval_prompts"),
        "num_eval_samples": evaluation.get("num_eval_samples"),
        "heldout_sampled_before": evaluation.get("sampled_reward_before"),
        "heldout_sampled_se_before": evaluation.get("sampled_se_before"),
        "heldout_sampled_after": evaluation.get("sampled_reward_after"),
        "heldout_sampled_se_after": evaluation.get("sampled_se_after"),
        "sampled_reward_first_quarter": mean(sampled[: max(1, len(sampled) // 4)]),
        "sampled_reward_last_quarter": mean(sampled[-max(1, len(sampled) // 4) :]),
        "learning_rate": max(rates, default=None),
        "bytes": phase_bytes(rounds, num_params, num_workers, steps),
        "density_first": rounds[0]["density"] if rounds else None,
        "density_last": rounds[-1]["density"] if rounds else None,
        "theta_digests": [r["theta_digest"] for r in rounds],
        "seconds": evaluation.get("seconds"),
    }


def build_report(run_dir: Path, seconds: float | None) -> tuple[str, dict[str, Any], bool]:
    """The report's text, its numbers (``--json``) and whether the run was whole: every peer finished, a version was
    published, and every digest matched. Missing or cut-short files read as empty (never raises for them)."""
    peer_dirs = sorted(p for p in run_dir.glob("peer*") if p.is_dir())
    rollouts = read_records(run_dir / "worker" / "rollouts.jsonl")
    num_workers = len(peer_dirs)
    peers = [peer_summary(p, num_workers) for p in peer_dirs]
    num_params = max((p["num_params"] for p in peers), default=0)
    h = next((p["inner_steps"] for p in peers if p["inner_steps"]), None)
    took = f", {seconds:.0f} s" if seconds is not None else ""
    out = [
        f"PULSELoCo GRPO demo (TRL GRPOTrainer): {num_workers} trainer peers + 1 rollout worker on 127.0.0.1, "
        f"{num_params / 1e6:.2f}M parameters, H={h}{took}",
        "",
        *peer_tables(peers, num_workers),
    ]
    publisher = next((p for p in peer_dirs if (p / "pulsesync_versions.jsonl").exists()), None)
    published: dict[int, str] = {}
    sync: dict[str, Any] = {}
    if publisher is None:
        out.append("\nPULSESync: no peer published a version")
    else:
        published = {e["version"]: e["digest"] for e in read_records(publisher / "pulsesync_versions.jsonl")}
        sync = sync_summary(publisher, published, num_params, rollouts)
        out.extend(sync_lines(sync, rollouts))
    digests = digest_summary(peers, published, rollouts)
    out.extend(digest_lines(digests, rollouts, max(published, default=None)))
    out.extend(serving_lines(rollouts))
    loop = rollout_loop(peer_dirs)
    if loop["peers"]:
        out.append("")
        out.extend(loop["lines"])
    finished = bool(peers) and all(p["finished"] for p in peers)
    ok = finished and publisher is not None and digests["theta_ok"] and digests["worker_ok"]
    data = {"peers": peers, "sync": sync, "digests": digests, "rollouts": loop["peers"], "seconds": seconds, "ok": ok}
    return "\n".join(out), data, ok


def peer_tables(peers: list[dict[str, Any]], num_workers: int) -> list[str]:
    """The per-peer tables: rewards (and what RL gained), bytes against DiLoCo and DDP, bytes per selected entry."""
    rows = [
        [p["name"] + ("" if p["finished"] else " (unfinished)"), str(p["steps"]), str(p["rounds"]),
         f"{fmt(p['sampled_reward_first'])} -> {fmt(p['sampled_reward_last'])}",
         f"{fmt(p['greedy_reward_before'])} -> {fmt(p['greedy_reward_after'])}"]
        for p in peers
    ]  # fmt: skip
    out = [table(["peer", "steps", "rounds", "sampled reward (first -> last log)", "greedy reward"], rows)]
    out.append(
        "(greedy reward: the evaluation problems of pulseloco/recipes/tasks.py before and after GRPO, the consensus "
        "model; every problem where the task has no more than --num_eval_prompts)"
    )
    out.extend(gain_lines(peers))
    out.append("")
    rows = []
    for p in peers:
        b = p["bytes"]
        if not b["rounds"]:
            continue
        rows.append(
            [p["name"], str(b["rounds"]), f"{fmt(p['density_first'], '.4f')} -> {fmt(p['density_last'], '.4f')}",
             human(b["bytes_sent"]), f"{human(b['diloco_bytes'])} ({ratio(b['diloco_bytes'], b['bytes_sent'])})",
             f"{human(b['ddp_bytes'])} ({ratio(b['ddp_bytes'], b['bytes_sent'])})", regime(p)]
        )  # fmt: skip
    header = ["peer", "rounds", "density (first -> last)", "bytes sent", "DiLoCo would send", "DDP would send",
              "regime"]  # fmt: skip
    out.append(table(header, rows))
    out.append(
        f"(DiLoCo: dense FP32 pseudo-gradient all-reduced once per round; DDP: FP32 gradients once per optimizer "
        f"step; ring all-reduce among {num_workers}: {2 * (num_workers - 1) / max(num_workers, 1) * 4:g} bytes x "
        "params; pulseloco: bytes measured on the wire, indices and FP32 values plus headers; regime: PULSE's "
        f"sparse regime is at most {SPARSE_REGIME_DENSITY:.0%} of the entries per round (the paper: about 1% per step "
        "at lr 1e-6 to 3e-6); above it the ratio is not the paper's)"
    )
    rows = split_rows(peers)
    if rows:
        header = ["peer", "payload B/entry", "wire B/entry", "index bits/entry: parts / payload / bound",
                  "values B/entry", "sums B/union entry", "headers B/entry"]  # fmt: skip
        out.append("")
        out.append(table(header, rows))
        out.append(
            "(per selected entry; payload: the whole selection as one frame, what the paper's all-gather uploads; "
            "wire: parts pushed to the other shard owners plus the sums of its shard served to them; indices and "
            "values: the pushed parts' sections per entry pushed (and the payload's indices), against the bound "
            "log2 C(params, k) / k of k uniformly random indices; sums: per entry of the union of the group's "
            "indices served)"
        )
    return out


def sync_summary(
    publisher: Path, published: dict[int, str], num_params: int, rollouts: list[dict[str, Any]]
) -> dict[str, Any]:
    """PULSESync's numbers: the versions ``publisher`` published, its store's anchors and patches (bytes by
    version), a full BF16 checkpoint's size (the largest anchor, else ``2 * num_params``), and what the rollout
    worker held and received."""
    store = store_summary(publisher / "versions")
    full = max(store["anchors"].values(), default=2 * num_params)
    received = sum(r["bytes_received"] for r in rollouts)
    return {"publisher": publisher.name, "versions": sorted(published), "full_checkpoint_bytes": full, **store,
            "worker_versions": [r["version"] for r in rollouts], "worker_bytes_received": received}  # fmt: skip


def sync_lines(sync: dict[str, Any], rollouts: list[dict[str, Any]]) -> list[str]:
    """The PULSESync lines: what was published and stored, a mean patch and the rollout worker's bytes against
    full BF16 checkpoints."""
    full, patches = sync["full_checkpoint_bytes"], sync["patches"]
    out = [
        f"\nPULSESync: {sync['publisher']} published {len(sync['versions'])} versions; its store holds "
        f"{len(sync['anchors'])} anchors and {len(patches)} patches (retention may have pruned older ones)"
    ]
    rows = []
    if patches:
        mean_patch = sum(patches.values()) / len(patches)
        rows.append(["one version (mean patch)", human(mean_patch), human(full), ratio(full, mean_patch)])
    if rollouts:
        full_total, received = full * len(rollouts), sync["worker_bytes_received"]
        paths = sorted({r["path"] for r in rollouts})
        rows.append(
            [f"rollout worker, {len(rollouts)} versions ({'/'.join(paths)})", human(received), human(full_total),
             ratio(full_total, received)]
        )  # fmt: skip
    if rows:
        out.append(table(["", "PULSESync", "full BF16 checkpoints", "ratio"], rows))
    return out


def digest_summary(
    peers: list[dict[str, Any]], published: dict[int, str], rollouts: list[dict[str, Any]]
) -> dict[str, Any]:
    """Whether every round's ``theta_digest`` is equal across the peers, and every version the rollout worker held
    equal to the digest the publisher announced (the last one included)."""
    theta = [p["theta_digests"] for p in peers]
    num_rounds = min((len(t) for t in theta), default=0)
    rounds_match = sum(len({t[i] for t in theta}) == 1 for i in range(num_rounds))
    versions_match = sum(published.get(r["version"]) == r["digest"] for r in rollouts)
    last_version = max(published, default=None)
    return {
        "theta_rounds_matching": rounds_match,
        "theta_rounds": num_rounds,
        "theta_ok": num_rounds > 0 and rounds_match == num_rounds and len({len(t) for t in theta}) == 1,
        "worker_versions_matching": versions_match,
        "worker_versions": len(rollouts),
        "worker_ok": bool(rollouts) and versions_match == len(rollouts) and rollouts[-1]["version"] == last_version,
    }


def digest_lines(digests: dict[str, Any], rollouts: list[dict[str, Any]], last_version: int | None) -> list[str]:
    """The digest verdicts, and the rollout worker's greedy reward at its first and last scored version."""
    d = digests
    held = f", last v{rollouts[-1]['version']} of v{last_version}" if rollouts else ""
    out = [
        f"\ndigests: peers' theta after each round: {d['theta_rounds_matching']}/{d['theta_rounds']} rounds equal -> "
        f"{'MATCH' if d['theta_ok'] else 'MISMATCH'}",
        f"digests: rollout worker vs publisher: {d['worker_versions_matching']}/{len(rollouts)} versions "
        f"equal{held} -> {'MATCH' if d['worker_ok'] else 'MISMATCH'}",
    ]
    scored = [r for r in rollouts if r.get("reward") is not None]
    if scored:
        first, last = scored[0], scored[-1]
        out.append(
            f"rollout worker greedy reward: v{first['version']} {first['reward']:.3f} -> "
            f"v{last['version']} {last['reward']:.3f}"
        )
    return out


def rollout_loop(peer_dirs: list[Path]) -> dict[str, Any]:
    """Per trainer peer with ``rollouts.jsonl`` (``--rollouts swarm``): completions per worker, lag histogram,
    dropped and refused counts, and the sampled reward at each of TRL's log steps."""
    peers: dict[str, Any] = {}
    lines: list[str] = []
    rows = []
    for peer_dir in peer_dirs:
        rounds = [r for r in read_records(peer_dir / "rollouts.jsonl") if r.get("mode") == "train"]
        if not rounds:
            continue
        by_worker: dict[str, int] = {}
        lags: dict[int, int] = {}
        for r in rounds:
            for worker, count in r.get("by_worker", {}).items():
                by_worker[worker] = by_worker.get(worker, 0) + count
            per_lag = r["completions"] // max(1, len(r.get("lags") or [1]))
            for lag in r.get("lags", []):
                lags[lag] = lags.get(lag, 0) + per_lag
        last = rounds[-1]
        history = read_json(peer_dir / "trainer_state.json").get("log_history", [])
        curve = [round(h["reward"], 3) for h in history if "reward" in h]
        peers[peer_dir.name] = {
            "rounds": len(rounds), "by_worker": by_worker, "lag_histogram": lags,
            "stale_dropped": last.get("stale_dropped", 0), "refused": last.get("refused", 0),
            "seconds_waiting": round(sum(r.get("seconds_waiting", 0.0) for r in rounds), 2), "reward_curve": curve,
        }  # fmt: skip
        workers = ", ".join(f"{'local' if w == 'local' else w[-6:]}: {n}" for w, n in sorted(by_worker.items()))
        histogram = " ".join(f"{lag}:{n}" for lag, n in sorted(lags.items()))
        rows.append(
            [peer_dir.name, str(len(rounds)), workers, histogram, str(peers[peer_dir.name]["stale_dropped"]),
             str(peers[peer_dir.name]["refused"]), f"{peers[peer_dir.name]['seconds_waiting']:.1f}"]
        )  # fmt: skip
        runtime = next((h["train_runtime"] for h in reversed(history) if "train_runtime" in h), None)
        peers[peer_dir.name]["checks"] = check_summary(last.get("verify"), runtime)
    if rows:
        header = ["peer", "rounds", "completions by worker", "lag: completions", "stale dropped", "refused", "wait s"]
        lines.append("rollouts (TRL's rollout_func, from the swarm's workers):")
        lines.append(table(header, rows))
        for name, peer in peers.items():
            lines.append(f"{name} sampled reward per log step: {' '.join(f'{x:.3f}' for x in peer['reward_curve'])}")
        for name, peer in peers.items():
            lines.extend(check_lines(name, peer["checks"]))
    return {"peers": peers, "lines": lines}


def check_summary(verify: dict[str, Any] | None, runtime: float | None) -> dict[str, Any] | None:
    """The rollout checks of one trainer over its run (the last round's ``verify`` record, cumulative): seconds in
    all, those of the first checks' forward pass (with ``--verify_weights shared`` the pass whose log-probabilities
    answered TRL's importance-sampling forward pass, which TRL then did not run), what the checks added beyond it,
    and that against TRL's ``train_runtime``; ``None`` without checks (``--no_verify_rollouts``) or records written
    before these fields."""
    if not verify or "first_forward_seconds" not in verify:
        return None
    shared = verify.get("shared_forwards", 0) > 0
    added = verify["total_seconds"] - (verify["first_forward_seconds"] if shared else 0.0)
    return {
        "seconds": verify["total_seconds"],
        "first_forward_seconds": verify["first_forward_seconds"],
        "shared_forwards": verify.get("shared_forwards", 0),
        "completions": verify["completions"],
        "shared_completions": verify.get("shared_completions", 0),
        "added_seconds": round(added, 3),
        "train_runtime": runtime,
        "added_share": added / runtime if runtime else None,
        "failed_leases": verify["failed_leases"],
        "worst_passing_gap": verify["worst_passing_gap"],
    }


def check_lines(name: str, checks: dict[str, Any] | None) -> list[str]:
    """One line on a trainer's rollout checks (:func:`check_summary`); none without them."""
    if checks is None:
        return []
    passed = checks["shared_completions"] / max(checks["completions"], 1)
    fraction = checks["added_share"]
    share = "" if fraction is None else f" = {fraction:.1%} of {checks['train_runtime']:.0f} s"
    return [
        f"{name} checks: {checks['seconds']:.1f} s for {checks['completions']} completions, {passed:.0%} passed with "
        f"the trainer's weights; their forward pass ({checks['first_forward_seconds']:.1f} s) answered TRL's in "
        f"{checks['shared_forwards']} rounds; added beyond it {checks['added_seconds']:.1f} s{share} of training; "
        f"failed leases {checks['failed_leases']}, largest honest gap {checks['worst_passing_gap']:.2f} nats"
    ]


def serving_lines(rollouts: list[dict[str, Any]]) -> list[str]:
    """The rollout engine's update times per version: publish to serving, loading the change into the engine, and
    (``--compare_full_reload``) loading every tensor into the same engine."""
    lines: list[str] = []
    if not rollouts:  # the rollout worker recorded nothing (it failed or never started)
        return lines
    engine = rollouts[-1].get("engine", "transformers")
    patched = [r for r in rollouts if r.get("path") != "anchor"]
    to_serve = [r["seconds_to_serve"] for r in patched if r.get("seconds_to_serve") is not None]
    load = [r["seconds_load"] for r in patched if r.get("seconds_load") is not None]
    full = [r["seconds_full_reload"] for r in patched if r.get("seconds_full_reload") is not None]
    if to_serve:
        lines.append(
            f"rollout worker ({engine}), {len(to_serve)} versions after the first: publish -> serving median "
            f"{statistics.median(to_serve):.2f} s (max {max(to_serve):.2f} s)"
        )
    if load and full:
        lines.append(
            f"  loading into the engine: the change {statistics.median(load) * 1000:.1f} ms, every tensor "
            f"{statistics.median(full) * 1000:.1f} ms (medians over the same versions)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the report (and write ``--json``); exit code 0 when the run was whole, else 1 (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path, help="the demo's output directory (peer0/, peer1/, worker/)")
    ap.add_argument("--seconds", type=float, default=None, help="wall time of the demo, for the title")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    text, data, ok = build_report(args.run_dir, args.seconds)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
