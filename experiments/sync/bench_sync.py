#!/usr/bin/env python
"""Benchmark PULSESync end to end: patches against full BF16 checkpoints over the same swarm, in the same run.

Setup (every peer is a process of its own, with its own hivemind DHT and libp2p daemon):
  * trainer + publisher: a Qwen2 (Llama-style) model built from a config with random init (~122M parameters,
    FP32 master weights), AdamW (lr 3e-6, no weight decay) on a synthetic LM loss over seeded random token ids.
    Version 1 is the initial model (an anchor: a warm-up, not counted); each measured version is one optimizer
    step followed by ``Publisher.publish(model)``.
  * subscribers (rollout workers): ``Subscriber.follow`` on a BF16 state dict; each reports to the coordinator
    the time at which it holds a version and the digest of the tensors it holds.
  * modes: ``patches`` (the library defaults: an anchor every 10 versions, patches otherwise, subscribers relay
    to each other) and ``full`` (the baseline: ``Publisher(anchor_every=1)`` and
    ``Subscriber(full_checkpoints=True)``, a full BF16 checkpoint per version over the same transport and relays).
  * conditions: ``loopback`` (127.0.0.1) and, when running as root with ``ip netns`` and ``tc``, a private
    network: one namespace per peer (the publisher's too), veth pairs to a bridge in a hub namespace on
    10.77.0.0/24, and a token bucket (``tc tbf``) at --rate on both ends of every veth, so each peer's uplink
    and downlink are limited. Nothing is configured outside the namespaces this script creates, and they are
    removed on exit (also on errors and Ctrl-C).

Per version the coordinator measures: the patch (or checkpoint) size in the version store against a full BF16
copy (2 bytes per element), the publisher's upload (the growth of ``Publisher.bytes_uploaded`` until every
subscriber holds the version), the seconds from the ``publish`` call to the publisher having encoded, stored and
announced the version ("encode"), and to the last subscriber holding it ("latency"), and whether every
subscriber's digest equals the publisher's.

Prints a table per condition and a summary (patches vs full checkpoints); ``--json PATH`` writes everything.
Progress goes to stderr; worker logs go to files under a temporary directory (printed on failure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

from harness import memory, procs
from harness.logs import progress
from harness.machine import library_revision
from harness.models import MODEL_CONFIGS
from harness.netns import NetNS, open_netns, rate_label
from harness.report import comma_list, parse_ints
from sync_coordinator import Coordinator, WorkerFailed
from sync_report import PUBLISHER_FANOUT, CaseResult, format_bound_table, format_table, summarize
from sync_workers import BATCH_SIZE, LR, SEQ_LEN, worker_main

MODES = ("patches", "full")
GB = memory.GB
MEMORY_MARGIN = 2 * GB
"""Memory left for everything else on the machine when deciding whether a case fits."""

log = progress("bench_sync")


# --------------------------------------------------------------------------------------------------
# Memory (the machine is shared: a case that would not fit is skipped, never left to the OOM killer)
# --------------------------------------------------------------------------------------------------


def estimate_memory(
    num_elements: int, n_subs: int, mode: str, *, warmup_batch: int = 1, relay_max_bytes: float | None = None
) -> float:
    """Peak bytes of one case, from measurements of this script (USS of each process and its helpers).

    With F = one BF16 copy: the trainer and publisher about 1.2 GB + 10 F (FP32 weights and AdamW moments,
    BF16 snapshots, the anchor being encoded) plus one F per payload it serves at once (the store reads the
    whole object per request). A subscriber about 0.7 GB (torch, its DHT process, libp2p daemon) + its state
    and its relay's copy of the anchor (F, or nothing when ``relay_max_bytes`` is below F, then only patches);
    receiving a checkpoint adds about 2.5 F at once (the chunks and their join, the decoded anchor, the backup
    kept until the update verifies). In full mode every subscriber receives a checkpoint per version at about
    the same time; with patches only during the warm-up, ``warmup_batch`` subscribers at a time.
    Measured (122M model, F = 245 MB, 100 Mbit/s): 16 subscribers with relays keeping the anchor peaked at
    about 20 GB at the end of the warm-up.
    """
    f = 2 * num_elements
    relay = f if relay_max_bytes is None or relay_max_bytes >= f else relay_max_bytes
    if mode == "full":
        return 1.2 * GB + 10 * f + n_subs * f + n_subs * (0.7 * GB + 4.5 * f)
    return 1.2 * GB + 12 * f + n_subs * (0.7 * GB + f + relay) + 2.5 * f * min(warmup_batch, n_subs)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=10, help="measured versions per case (after the initial anchor)")
    ap.add_argument("--subscribers", type=parse_ints, default=[1, 8], help="subscriber counts (comma list)")
    ap.add_argument("--small", action="store_true", help="~5M-parameter model instead of ~122M (smoke run)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only: skip the rate-limited namespaces")
    ap.add_argument("--rate", default="100mbit", help="tc rate of every link in the namespace condition")
    ap.add_argument("--modes", type=comma_list, default=list(MODES), help="subset of patches,full")
    ap.add_argument("--lr", type=float, default=LR, help="AdamW learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--poll",
        type=float,
        default=0.2,
        help="subscribers' follow interval in seconds (each poll is a DHT read of the head: with 8 subscribers on "
        "2 cores, 0.05 s doubled the publisher's encode time against 0.2 s)",
    )
    ap.add_argument("--fetch-timeout", type=float, default=600.0, help="subscribers' per-update fetch timeout")
    ap.add_argument(
        "--relay-wait",
        type=float,
        default=None,
        help="override SwarmSource.relay_wait: seconds a subscriber turned away by a busy publisher waits before "
        "looking for relays again (default: the library's)",
    )
    ap.add_argument(
        "--relay-max-mb",
        type=float,
        default=None,
        help="Subscriber(relay_max_bytes=) in MB (default: the library's); below a full BF16 copy plus a patch, a "
        "relay drops its anchor once patches arrive (memory with many subscribers)",
    )
    ap.add_argument(
        "--conditions",
        type=comma_list,
        default=["loopback", "netns"],
        help="subset of loopback,netns (netns: the rate-limited namespaces)",
    )
    ap.add_argument(
        "--warmup-batch",
        type=int,
        default=1,
        help="subscribers that fetch the initial anchor at once (memory: each holds about 2.5 copies meanwhile)",
    )
    ap.add_argument("--version-timeout", type=float, default=1800.0, help="bound on one version's distribution")
    ap.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run cases whose estimated peak memory exceeds MemAvailable minus a margin (default: skip them)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write every measurement as JSON to PATH")
    ap.add_argument("--role", choices=("publisher", "subscriber"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    return ap


def open_conditions(args: argparse.Namespace) -> tuple[list[dict[str, Any]], NetNS | None]:
    """The conditions to measure (loopback, the rate-limited namespaces or why they are skipped), and the network
    of the latter when it could be set up."""
    conditions: list[dict[str, Any]] = []
    if "loopback" in args.conditions:
        conditions.append({"name": "loopback", "rate": None, "skipped": None})
    netns: NetNS | None = None
    label = rate_label(args.rate)
    if "netns" not in args.conditions:
        pass
    elif args.no_netns:
        conditions.append({"name": label, "rate": args.rate, "skipped": "--no-netns"})
    else:
        netns, reason = open_netns(max(args.subscribers) + 1, args.rate)
        conditions.append({"name": label, "rate": args.rate, "skipped": reason})
        if reason is not None:
            log(f"{label}: skipped ({reason})")
    return conditions, netns


def run_cases(
    coordinator: Coordinator,
    conditions: list[dict[str, Any]],
    netns: NetNS | None,
    cases: list[CaseResult],
    skipped_cases: list[dict[str, Any]],
) -> None:
    """Every (condition, subscriber count, mode) case into ``cases``, or into ``skipped_cases`` when it would not
    fit in memory. Raises WorkerFailed or TimeoutError when a case fails (the cases so far stay)."""
    args = coordinator.args
    for cond in conditions:
        if cond["skipped"] is not None:
            continue
        ns = netns if cond["rate"] else None
        for n in args.subscribers:
            for mode in args.modes:
                need = estimate_memory(
                    coordinator.num_elements,
                    n,
                    mode,
                    warmup_batch=args.warmup_batch,
                    relay_max_bytes=None if args.relay_max_mb is None else args.relay_max_mb * 1e6,
                )
                reason = None if args.no_memory_check else memory.shortfall(need, MEMORY_MARGIN)
                if reason is not None:
                    reason += " (--no-memory-check to run anyway)"
                    skipped_cases.append({"condition": cond["name"], "subscribers": n, "mode": mode, "reason": reason})
                    log(f"{cond['name']} subscribers={n} mode={mode}: skipped: {reason}")
                    continue
                cases.append(coordinator.run_case(cond["name"], ns, n, mode))


def print_condition(
    args: argparse.Namespace,
    cond: dict[str, Any],
    cases: list[CaseResult],
    skipped_cases: list[dict[str, Any]],
    summary: list[dict[str, Any]],
) -> None:
    """One condition's tables and lines: the cases, the bound (rate-limited), skipped cases, the summary."""
    print()
    if cond["skipped"] is not None:
        print(f"{cond['name']}: skipped ({cond['skipped']})")
        return
    mine = [c for c in cases if c.condition == cond["name"]]
    print("loopback (127.0.0.1)" if cond["rate"] is None else f"{cond['name']} links (tc tbf, network namespaces)")
    print(format_table(mine))
    if cond["rate"] and any(c.bound_summary() for c in mine):
        print(
            f"\nBound: minimal relay-tree depth d (publisher serves {PUBLISHER_FANOUT}, every relay "
            f"{PUBLISHER_FANOUT} more: {PUBLISHER_FANOUT} + {PUBLISHER_FANOUT}^2 + ... + "
            f"{PUBLISHER_FANOUT}^d >= subscribers) x one transfer of the object at {cond['name']}; ratio = "
            "publish() -> last subscriber / bound (mean and worst version); after_encode: from the version "
            "stored and announced; depth_formed: deepest subscriber in the tree of who served whom."
        )
        print(format_bound_table(mine))
    for sk in skipped_cases:
        if sk["condition"] == cond["name"]:
            print(f"  {sk['subscribers']} subscriber(s) {sk['mode']}: skipped ({sk['reason']})")
    for s in summary:
        if s["condition"] == cond["name"]:
            print(
                f"  {s['subscribers']} subscriber(s): patches reach the last subscriber "
                f"{s['latency_speedup']:.1f}x sooner than full checkpoints on average "
                f"({s['patches_mean_latency_s']:.2f} s vs {s['full_mean_latency_s']:.2f} s; "
                f"{s['max_latency_speedup']:.1f}x on the max), {1 / s['bytes_ratio']:.0f}x fewer bytes per "
                f"version, publisher upload {1 / s['upload_ratio']:.0f}x lower"
            )
    for c in mine:
        initial = next((v for v in c.versions if not v.counted), None)
        if c.warnings:
            print(f"  {c.subscribers} subscriber(s) {c.mode}: {len(c.warnings)} warning(s) from the library")
        if initial is not None and c.mode == "patches":
            print(
                f"  {c.subscribers} subscriber(s): initial anchor ({initial.object_bytes / 1e6:.1f} MB) reached "
                f"all subscribers, {args.warmup_batch} at a time, {initial.latency_s:.2f} s after publish "
                "(not counted)"
            )


def print_header(args: argparse.Namespace, cases: list[CaseResult], load_at_start: float) -> None:
    """What was measured, with which model, and what the columns mean."""
    first = cases[0] if cases else None
    if first is not None:
        print(
            f"pulseloco PULSESync benchmark: model={'small' if args.small else 'default'} "
            f"({first.num_params / 1e6:.1f}M params, full BF16 copy "
            f"{first.full_bf16_bytes / 1e6:.1f} MB), AdamW lr={args.lr:g}, {args.versions} versions per case "
            f"(+1 initial anchor, not counted), load average {os.getloadavg()[0]:.2f} (at start {load_at_start:.2f})"
        )
    print(
        "patches: Publisher defaults (anchor every 10 versions, publisher serves each version at most twice before "
        "sending subscribers to relays); full: anchor_every=1 + Subscriber(full_checkpoints=True), same transport."
    )
    print(
        "MB/version: what a subscriber fetches per version (patch or checkpoint file); upload_x_obj: publisher upload "
        "per version / that size; encode_s: publish() -> stored and announced; latency: publish() -> last subscriber "
        "holds the version (digest checked against the publisher's); recv_MB/sub: bytes a subscriber actually "
        "received per version; off_path: subscriber updates that fell back to another path (anchor + chain)."
    )


def report_json(
    args: argparse.Namespace, results: dict[str, Any], incomplete: CaseResult | None, revision: dict[str, Any]
) -> dict[str, Any]:
    """Everything measured, as ``--json`` writes it. ``results``: conditions, cases, skipped_cases, summary,
    completed, elapsed_s, load_average."""
    model = "small" if args.small else "default"
    return {
        "config": {
            "model": model,
            "model_config": MODEL_CONFIGS[model],
            "lr": args.lr,
            "versions": args.versions,
            "subscribers": args.subscribers,
            "modes": args.modes,
            "seed": args.seed,
            "poll_s": args.poll,
            "relay_wait_s": args.relay_wait,
            "relay_max_mb": args.relay_max_mb,
            "warmup_batch": args.warmup_batch,
            "fetch_timeout_s": args.fetch_timeout,
            "batch_size": BATCH_SIZE,
            "seq_len": SEQ_LEN,
            "rate": args.rate,
            "library": revision,
        },
        "conditions": results["conditions"],
        "cases": [
            {
                **{k: v for k, v in asdict(c).items() if k != "versions"},
                "all_digests_match": c.all_digests_match,
                "summary": c.summary(),
                "versions": [asdict(v) for v in c.versions],
            }
            for c in results["cases"]
        ],
        "skipped_cases": results["skipped_cases"],
        # versions measured before a failure or interruption (not in the tables)
        "incomplete_case": asdict(incomplete) if incomplete is not None else None,
        "summary": results["summary"],
        "completed": results["completed"],
        "elapsed_s": results["elapsed_s"],
        "load_average": {"start": results["load_at_start"], "end": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.role:
        return worker_main(args.role, args.spec)
    if set(args.modes) - set(MODES) or not args.modes:
        ap.error(f"--modes must be a subset of {','.join(MODES)}")
    if args.versions < 1 or not args.subscribers or min(args.subscribers) < 1:
        ap.error("--versions and --subscribers must be positive")
    if set(args.conditions) - {"loopback", "netns"} or not args.conditions or args.warmup_batch < 1:
        ap.error("--conditions must be a subset of loopback,netns and --warmup-batch positive")
    procs.exit_on_signals()
    t_start = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    revision = library_revision()
    conditions, netns = open_conditions(args)

    workdir = Path(tempfile.mkdtemp(prefix="bsync"))  # short: AF_UNIX paths are limited to ~100 bytes
    cases: list[CaseResult] = []
    skipped_cases: list[dict[str, Any]] = []
    coordinator = Coordinator(args, workdir, Path(__file__).resolve())
    failed, exit_code = False, 1
    try:
        run_cases(coordinator, conditions, netns, cases, skipped_cases)
    except (WorkerFailed, TimeoutError) as exc:
        failed = True
        log(f"benchmark failed: {exc}")
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, SIGHUP: clean up, then report what completed
        failed, exit_code = True, 130
        log("interrupted")
    finally:
        coordinator.close()
        if netns is not None:
            netns.teardown()
        if not failed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"worker logs kept in {workdir}")

    elapsed = time.perf_counter() - t_start
    summary = summarize(cases)
    print_header(args, cases, load_at_start)
    for cond in conditions:
        print_condition(args, cond, cases, skipped_cases, summary)
    if failed:
        print("\nThe benchmark did not finish; the tables show the cases that completed.")
    print(f"\nTotal time {elapsed:.0f}s")
    if args.json:
        incomplete = coordinator.current_case
        if not failed or any(c is incomplete for c in cases):
            incomplete = None
        results = dict(conditions=conditions, cases=cases, skipped_cases=skipped_cases, summary=summary)
        results.update(completed=not failed, elapsed_s=elapsed, load_at_start=load_at_start)
        with open(args.json, "w") as f:
            json.dump(report_json(args, results, incomplete, revision), f, indent=2)
    return exit_code if failed else 0


if __name__ == "__main__":
    sys.exit(main())
