"""The end of ``experiments/soak/soak.py``: its checks over the files a run left (the peers' round records, the
subscribers' logs) put together into one summary (:func:`summarize`), and the table it prints (:func:`print_table`).

The exactly-once ledger check is :func:`harness.audit.check_ledger`; the digest, divergence and PULSESync
checks are here. Reading a run's files raises OSError only for files that exist but cannot be read.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from harness.report import kv_lines


def diverged(records: list[dict[str, Any]]) -> bool:
    """Whether peers that started a round from the swarm's common state ended it in different states (two
    groups, some left out while others averaged, or an incomplete round). ``records``: one round's."""
    starts = collections.Counter(r["start"] for r in records if "start" in r)
    if not starts:
        return False
    common = starts.most_common(1)[0][0]
    ends = {r["transition"][1] if "transition" in r else r["start"] for r in records if r.get("start") == common}
    return len(ends) > 1


def disagreeing_rounds(records: list[dict[str, Any]]) -> list[int]:
    """The digest check: the rounds after which peers that completed them held different digests, in order."""
    by_end: dict[int, set[str]] = collections.defaultdict(set)
    for r in records:
        # Completed: it averaged in a group with others and applied every shard's sum. A peer left out, alone or
        # with a partial round holds a stale or partial state until it repairs (counted in the summary).
        if "group" in r and r["complete"] and r["num_peers"] > 1:
            by_end[r["end_round"]].add(r["digest"])
    return sorted(rnd for rnd, digests in by_end.items() if len(digests) > 1)


def followed(logs: Path, name: str) -> list[tuple[int, str]]:
    """(version, digest) of every version the subscriber ``name`` printed (or restored) in its incarnations' logs
    ``<logs>/<name>.*.log``; ``[]`` before any. Unreadable bytes are replaced; OSError propagates."""
    lines = []
    for path in sorted(logs.glob(f"{name}.*.log")):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 7 and parts[0].isdigit():
                lines.append((int(parts[0]), parts[4]))
            elif line.startswith("restored version="):
                fields = dict(p.split("=", 1) for p in line.split()[1:3])
                lines.append((int(fields["version"]), fields["digest"]))
    return lines


def sync_check(published: dict[int, str], logs: Path, notes: list[str]) -> dict[str, int]:
    """The PULSESync check: versions a subscriber (``sub0``, ``sub1``) printed with another digest than the
    publisher's (``published``: version -> digest), and subscribers that never reached the last version (each
    also a line in ``notes``)."""
    last = max(published, default=None)
    mismatches = behind = 0
    for name in ("sub0", "sub1"):
        seen = followed(logs, name)
        mismatches += sum(1 for v, d in seen if published.get(v) != d)
        if last is not None and not any(v == last for v, _ in seen):
            behind += 1
            notes.append(f"{name} did not reach version {last}")
    return {"versions": len(published), "mismatches": mismatches, "behind": behind}


def summarize(
    records: list[dict[str, Any]],
    *,
    ledger: dict[str, Any],
    sync: dict[str, int],
    status: dict[str, Any],
    leaked: int,
    peers: int,
    rounds: int,
    seconds: float,
    events: list[str],
    missed: list[str],
) -> dict[str, Any]:
    """The soak's summary (what ``--json`` writes and :func:`print_table` prints) from the peers' round records,
    the ledger check (:func:`harness.audit.check_ledger`), the PULSESync check, ``pulseloco status``'s JSON,
    the leaked processes and the supervisor's notes; ``ok`` is whether every check passed. Never raises for
    missing optional record keys."""
    by_round: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        by_round[r["round"]].append(r)
    disagreements = disagreeing_rounds(records)
    last_downloads: dict[str, int] = {}
    for r in records:
        last_downloads[r["name"]] = max(last_downloads.get(r["name"], 0), r["downloads"])
    summary = {
        "rounds": max((r["end_round"] for r in records), default=0),
        "peers": peers,
        "processes_finished": len({r["name"] for r in records if r["final"]}),
        "group_splits": sum(1 for rs in by_round.values() if len({r["group"] for r in rs if "group" in r}) > 1),
        "diverged_rounds": sum(1 for rs in by_round.values() if diverged(rs)),
        "left_out": sum(1 for r in records if "group" not in r),
        "rounds_alone": sum(1 for r in records if "group" in r and r["num_peers"] <= 1),
        "repairs": sum(1 for r in records if r["repaired"]),
        "downloads": sum(last_downloads.values()),
        "incomplete_rounds": sum(1 for r in records if not r["complete"]),
        "rejected_contributions": sum(r["num_rejected"] for r in records),
        "reconciled": sum(r["num_reconciled"] for r in records),
        "poisoned_applied": ledger["poisoned"],
        "non_finite_peers": len({r["name"] for r in records if r["final"] and not r.get("finite", True)}),
        "empty_rounds": sum(
            1
            for rs in by_round.values()
            if any("group" in r and r["num_peers"] > 1 for r in rs)
            and all(r["num_contributors"] == 0 for r in rs if "group" in r)
        ),
        "double_counts": ledger["violations"],
        "ledger_max_error": ledger["max_error"],
        "ledger_checked": ledger["checked"],
        "ledger_note": ledger["note"],
        "digest_disagreements": len(disagreements),
        "disagreeing_rounds": disagreements,
        "leaked_processes": leaked,
        "sync_versions": sync["versions"],
        "sync_mismatches": sync["mismatches"],
        "sync_behind": sync["behind"],
        "status_exit_code": status.get("exit_code"),
        "status_agreeing_peers": sum(1 for p in status.get("peers", []) if p["status"] == "agree"),
        "status_head_verified": (status.get("head") or {}).get("verified"),
        "seconds": seconds,
        "events": events,
        "missed_events": missed,
    }
    summary["ok"] = bool(
        summary["rounds"] >= rounds
        and ledger["violations"] == 0
        and ledger["note"] == ""
        and summary["poisoned_applied"] == 0
        and summary["non_finite_peers"] == 0
        and not disagreements
        and leaked == 0
        and sync["mismatches"] == 0
        and sync["behind"] == 0
        and status.get("exit_code") in (0, 1)
        and summary["status_head_verified"] is True
        and not missed
    )
    return summary


def print_table(summary: dict[str, Any]) -> None:
    """The summary as aligned lines on stdout, the ledger's note if any, then ``ok`` or ``FAILED``."""
    rows = [
        ("rounds", summary["rounds"]),
        ("peer processes finished", summary["processes_finished"]),
        ("group splits (two groups in a round)", summary["group_splits"]),
        ("rounds that diverged (split, left out, partial)", summary["diverged_rounds"]),
        ("peers left out of a round", summary["left_out"]),
        ("rounds a peer averaged alone (not compared)", summary["rounds_alone"]),
        ("repairs", summary["repairs"]),
        ("state downloads", summary["downloads"]),
        ("incomplete rounds", summary["incomplete_rounds"]),
        ("poisoned contributions rejected", summary["rejected_contributions"]),
        ("poisoned contributions applied (final lineage)", summary["poisoned_applied"]),
        ("peers ending with non-finite parameters", summary["non_finite_peers"]),
        ("rounds in which no group counted anything", summary["empty_rounds"]),
        ("residual reconciliations", summary["reconciled"]),
        ("double counts (ledger)", f"{summary['double_counts']} (max error {summary['ledger_max_error']:.2g})"),
        ("digest disagreements", summary["digest_disagreements"]),
        ("leaked processes", summary["leaked_processes"]),
        ("sync versions / mismatches", f"{summary['sync_versions']} / {summary['sync_mismatches']}"),
        (
            "pulseloco status at the end",
            f"exit {summary['status_exit_code']}, {summary['status_agreeing_peers']} peers agree, "
            f"head verified: {summary['status_head_verified']}",
        ),
        ("seconds", summary["seconds"]),
    ]
    print(kv_lines(rows))
    if summary["ledger_note"]:
        print(f"ledger: {summary['ledger_note']}")
    print("ok" if summary["ok"] else "FAILED")
