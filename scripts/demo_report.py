#!/usr/bin/env python
"""The table at the end of scripts/demo.sh, from the metrics files of a demo run directory.

    python scripts/demo_report.py runs/demo-20260101 [--seconds S] [--json PATH]

Reads ``RUN_DIR/peer*/metrics.jsonl`` (GRPO trainer peers; the one with ``publish`` events is the publisher, its
version store is ``RUN_DIR/peerN/versions``) and ``RUN_DIR/worker/metrics.jsonl`` (the rollout worker), and prints:

* per peer: outer rounds, the last warm-up (SFT) loss, the last GRPO step's sampled reward, the greedy reward at the
  end, the bytes it sent, and what DiLoCo and DDP would have sent for the same run:
  DiLoCo all-reduces the dense FP32 pseudo-gradient once per round, DDP the FP32 gradients once per inner step;
  a ring all-reduce sends ``2 (W - 1) / W * 4 * params`` bytes per worker (``4 * params`` with W = 2 workers);
* PULSESync: the version store's patches against full BF16 checkpoints (``2 * params`` bytes, the store's anchor
  size), and what the rollout worker received against one full checkpoint per version;
* digests: every round's ``theta_digest`` equal across peers, and every version the rollout worker held equal to
  the digest the publisher announced for it.

Exits 1 when a digest did not match or an expected file is missing, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a killed process
                continue
    return records


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def human(num_bytes: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(num_bytes) < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError("unreachable")


def ratio(baseline: float, value: float) -> str:
    if value <= 0:
        return "n/a"
    r = baseline / value
    return f"{r:.0f}x less" if r >= 10 else f"{r:.1f}x less"


def allreduce_bytes(num_params: int, num_workers: int) -> float:
    """FP32 bytes one worker sends in a ring all-reduce of ``num_params`` values among ``num_workers``."""
    return 2 * (num_workers - 1) / num_workers * 4 * num_params


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def phase_bytes(rounds: list[dict[str, Any]], num_params: int, num_workers: int, steps: int) -> dict[str, Any]:
    """Bytes sent in ``rounds`` against DiLoCo (one dense all-reduce per round) and DDP (one per inner step)."""
    sent = sum(r["bytes_sent"] for r in rounds)
    dense = allreduce_bytes(num_params, num_workers)
    return {
        "rounds": len(rounds),
        "bytes_sent": sent,
        "density": sum(r["density"] for r in rounds) / len(rounds) if rounds else None,
        "diloco_bytes": dense * len(rounds),
        "ddp_bytes": dense * steps,
    }


def peer_summary(name: str, events: list[dict[str, Any]], num_workers: int) -> dict[str, Any]:
    start = of(events, "start")
    steps = of(events, "step")
    rounds = of(events, "round")
    done = of(events, "done")
    evals = of(events, "eval")
    num_params = start[0]["num_params"] if start else 0
    config = start[0]["config"] if start else {}
    inner_steps = config.get("swarm", {}).get("inner_steps") or 1
    sft_steps = config.get("grpo", {}).get("sft_steps", 0)
    sft = [s for s in steps if s.get("phase") == "sft"]
    grpo = [s for s in steps if s.get("phase") == "grpo" and s.get("reward") is not None]
    sft_rounds = [r for r in rounds if r["step"] <= sft_steps]
    grpo_rounds = [r for r in rounds if r["step"] > sft_steps]
    phases = {
        "warm-up": phase_bytes(sft_rounds, num_params, num_workers, len(sft_rounds) * inner_steps),
        "grpo": phase_bytes(grpo_rounds, num_params, num_workers, len(grpo_rounds) * inner_steps),
        "total": phase_bytes(rounds, num_params, num_workers, len(rounds) * inner_steps),
    }
    return {
        "name": name,
        "finished": bool(done),
        "num_params": num_params,
        "inner_steps": inner_steps,
        "sft_lr": config.get("grpo", {}).get("sft_lr"),
        "grpo_lr": config.get("grpo", {}).get("lr"),
        "rounds": len(rounds),
        "num_peers": [r["num_peers"] for r in rounds],
        "sft_loss": sft[-1]["loss"] if sft else None,
        "grpo_reward": grpo[-1]["reward"] if grpo else None,
        "greedy_reward": evals[-1].get("reward") if evals else None,
        "bytes_sent_total": done[-1]["bytes_sent_total"] if done else None,
        "phases": phases,
        "theta_digests": [r["theta_digest"] for r in rounds],
        "seconds": done[-1]["seconds"] if done else None,
    }


def store_summary(store: Path) -> dict[str, Any]:
    """Sizes of the publisher's version store (payload plus signed envelope per object), by version."""
    sizes: dict[str, dict[int, int]] = {"anchor": {}, "patch": {}}
    if store.is_dir():
        for env in sorted(store.glob("v*.*.env")):
            payload = env.with_suffix("")
            kind = payload.suffix.lstrip(".")
            if kind in sizes and payload.exists():
                version = int(payload.stem.lstrip("v"))
                sizes[kind][version] = payload.stat().st_size + env.stat().st_size
    return {"anchors": sizes["anchor"], "patches": sizes["patch"]}


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def build_report(run_dir: Path, seconds: float | None) -> tuple[str, dict[str, Any], bool]:
    peer_dirs = sorted(p for p in run_dir.glob("peer*") if p.is_dir())
    peer_events = {p.name: read_events(p / "metrics.jsonl") for p in peer_dirs}
    worker_events = read_events(run_dir / "worker" / "metrics.jsonl")
    num_workers = len(peer_dirs)
    peers = [peer_summary(name, events, num_workers) for name, events in peer_events.items()]
    ok = bool(peers) and all(p["finished"] for p in peers)
    out: list[str] = []
    num_params = max((p["num_params"] for p in peers), default=0)
    h = next((p["inner_steps"] for p in peers if p["inner_steps"]), None)
    took = f", {seconds:.0f} s" if seconds is not None else ""
    out.append(
        f"PULSELoCo GRPO demo: {num_workers} trainer peers + 1 rollout worker on 127.0.0.1, "
        f"{num_params / 1e6:.2f}M parameters, H={h}{took}"
    )
    out.append("")
    rows = [
        [p["name"] + ("" if p["finished"] else " (unfinished)"), str(p["rounds"]), fmt(p["sft_loss"]),
         fmt(p["grpo_reward"]), fmt(p["greedy_reward"])]
        for p in peers
    ]  # fmt: skip
    out.append(table(["peer", "rounds", "sft loss", "grpo reward", "greedy reward"], rows))
    out.append("(sft loss: last warm-up step; grpo reward: last GRPO step, sampled; greedy: 64 fixed problems)")
    out.append("")
    rows = []
    for p in peers:
        lrs = {"warm-up": p["sft_lr"], "grpo": p["grpo_lr"], "total": None}
        for phase, b in p["phases"].items():
            if not b["rounds"]:
                continue
            label = f"{phase} (lr {lrs[phase]:g})" if lrs[phase] is not None else phase
            rows.append(
                [p["name"], label, str(b["rounds"]), fmt(b["density"], ".4f"), human(b["bytes_sent"]),
                 f"{human(b['diloco_bytes'])} ({ratio(b['diloco_bytes'], b['bytes_sent'])})",
                 f"{human(b['ddp_bytes'])} ({ratio(b['ddp_bytes'], b['bytes_sent'])})"]
            )  # fmt: skip
    header = ["peer", "phase", "rounds", "density", "bytes sent", "DiLoCo would send", "DDP would send"]
    out.append(table(header, rows))
    out.append(
        f"(DiLoCo: dense FP32 pseudo-gradient all-reduced once per round; DDP: FP32 gradients once per inner step; "
        f"ring all-reduce among {num_workers}: {2 * (num_workers - 1) / max(num_workers, 1) * 4:g} bytes x params)"
    )

    # PULSESync
    publisher = next((p for p in peer_dirs if of(peer_events[p.name], "publish")), None)
    published: dict[int, str] = {}
    sync: dict[str, Any] = {}
    if publisher is None:
        out.append("\nPULSESync: no peer published a version")
        ok = False
    else:
        published = {e["version"]: e["digest"] for e in of(peer_events[publisher.name], "publish")}
        store = store_summary(publisher / "versions")
        full = max(store["anchors"].values(), default=2 * num_params)
        patches = store["patches"]
        # version v holds the model after v - 1 rounds (version 1 is the initial model)
        sft_steps = max((p["phases"]["warm-up"]["rounds"] for p in peers), default=0) * (h or 1)
        grpo_patches = [size for v, size in patches.items() if (v - 1) * (h or 1) > sft_steps]
        rollouts = of(worker_events, "rollout")
        paths = sorted({r["path"] for r in rollouts})
        received = sum(r["bytes_received"] for r in rollouts)
        sync = {"publisher": publisher.name, "versions": sorted(published), "full_checkpoint_bytes": full, **store,
                "worker_versions": [r["version"] for r in rollouts], "worker_bytes_received": received}  # fmt: skip
        out.append(
            f"\nPULSESync: {publisher.name} published {len(published)} versions; its store holds "
            f"{len(store['anchors'])} anchors and {len(patches)} patches (retention may have pruned older ones)"
        )
        sync_rows = []
        for label, sizes in (("one version (mean patch)", list(patches.values())),
                             ("one GRPO-phase version (mean patch)", grpo_patches)):  # fmt: skip
            if sizes:
                mean_patch = sum(sizes) / len(sizes)
                sync_rows.append([label, human(mean_patch), human(full), ratio(full, mean_patch)])
        if rollouts:
            full_total = full * len(rollouts)
            sync_rows.append(
                [f"rollout worker, {len(rollouts)} versions ({'/'.join(paths)})", human(received), human(full_total),
                 ratio(full_total, received)]
            )  # fmt: skip
        if sync_rows:
            out.append(table(["", "PULSESync", "full BF16 checkpoints", "ratio"], sync_rows))

    # digests
    digests: dict[str, Any] = {}
    theta = [p["theta_digests"] for p in peers]
    num_rounds = min((len(t) for t in theta), default=0)
    rounds_match = sum(len({t[i] for t in theta}) == 1 for i in range(num_rounds))
    theta_ok = num_rounds > 0 and rounds_match == num_rounds and len({len(t) for t in theta}) == 1
    rollouts = of(worker_events, "rollout")
    versions_match = sum(published.get(r["version"]) == r["digest"] for r in rollouts)
    last_version = max(published, default=None)
    worker_ok = bool(rollouts) and versions_match == len(rollouts) and rollouts[-1]["version"] == last_version
    digests = {
        "theta_rounds_matching": rounds_match,
        "theta_rounds": num_rounds,
        "theta_ok": theta_ok,
        "worker_versions_matching": versions_match,
        "worker_versions": len(rollouts),
        "worker_ok": worker_ok,
    }
    out.append(
        f"\ndigests: peers' theta after each round: {rounds_match}/{num_rounds} rounds equal -> "
        f"{'MATCH' if theta_ok else 'MISMATCH'}"
    )
    held = f", last v{rollouts[-1]['version']} of v{last_version}" if rollouts else ""
    out.append(
        f"digests: rollout worker vs publisher: {versions_match}/{len(rollouts)} versions equal{held} -> "
        f"{'MATCH' if worker_ok else 'MISMATCH'}"
    )
    if rollouts:
        first, last = rollouts[0], rollouts[-1]
        out.append(
            f"rollout worker greedy reward: v{first['version']} {first['reward']:.3f} -> "
            f"v{last['version']} {last['reward']:.3f}"
        )
    ok = ok and theta_ok and worker_ok
    data = {"peers": peers, "sync": sync, "digests": digests, "seconds": seconds, "ok": ok}
    return "\n".join(out), data, ok


def main(argv: list[str] | None = None) -> int:
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
