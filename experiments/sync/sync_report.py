"""The measurements of ``experiments/sync/bench_sync.py`` and what it prints of them: a version's and a case's results
(:class:`VersionResult`, :class:`CaseResult` with its summary), the latency bound (the minimal relay-tree depth
times one transfer at the link rate: :func:`min_tree_depth`, :func:`tree_depth`), the cases' tables and the
patches-against-full-checkpoints summary.

Pure functions of the results: nothing here starts a process or reads a file. A summary of a case without a counted
version is ``{}``, and the tables leave such cases out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from harness.report import Column, fixed_table


@dataclass
class VersionResult:
    """One published version as the coordinator measured it (sizes in bytes, times in seconds)."""

    version: int
    counted: bool  # False for the initial anchor (warm-up)
    t_call: float
    publish_call_s: float
    encode_s: float
    step_s: float | None
    loss: float | None
    patch_bytes: int | None
    anchor_bytes: int | None
    object_bytes: int  # what subscribers fetch per version in this mode: the patch, or the full checkpoint
    publisher_digest: str
    latency_s: float  # publish call -> last subscriber holds the version
    first_latency_s: float
    mean_latency_s: float
    upload_bytes: int
    uploads: int
    digests_match: bool
    subscribers: list[dict[str, Any]] = field(default_factory=list)
    # the relay tree this version formed: depth of the deepest subscriber (publisher 0; None when a provider was
    # not one of the case's peers), and the bound "minimal tree depth x transfer time at --rate" (None on loopback)
    tree_depth: int | None = None
    min_depth: int = 0
    transfer_s: float | None = None
    bound_s: float | None = None


@dataclass
class CaseResult:
    """One case (condition, subscriber count, mode) and its versions, the initial anchor first."""

    condition: str
    subscribers: int
    mode: str
    num_params: int
    num_elements: int
    full_bf16_bytes: int
    versions: list[VersionResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    library: dict[str, Any] = field(default_factory=dict)  # revision when the workers started (it may change)
    peers: dict[str, int] = field(default_factory=dict)  # libp2p peer id -> worker index (publisher 0)

    def counted(self) -> list[VersionResult]:
        """The measured versions (the initial anchor left out)."""
        return [v for v in self.versions if v.counted]

    @property
    def all_digests_match(self) -> bool:
        """Whether every subscriber held the publisher's digest at every version; False without versions."""
        return bool(self.versions) and all(v.digests_match for v in self.versions)

    def summary(self) -> dict[str, Any]:
        """Means and extremes over the counted versions (the tables' and JSON's ``summary``); ``{}`` without any."""
        vs = self.counted()
        if not vs:
            return {}
        mean_obj = statistics.mean(v.object_bytes for v in vs)
        mean_up = statistics.mean(v.upload_bytes for v in vs)
        return {
            "versions": len(vs),
            "mean_object_bytes": mean_obj,
            "ratio_vs_full_bf16": mean_obj / self.full_bf16_bytes,
            "mean_upload_bytes": mean_up,
            "upload_x_object": mean_up / mean_obj,
            "max_upload_x_object": max(v.upload_bytes / v.object_bytes for v in vs),
            "mean_encode_s": statistics.mean(v.encode_s for v in vs),
            "mean_latency_s": statistics.mean(v.latency_s for v in vs),
            "median_latency_s": statistics.median(v.latency_s for v in vs),
            "max_latency_s": max(v.latency_s for v in vs),
            "all_digests_match": all(v.digests_match for v in vs),
            "digests_matched": sum(v.digests_match for v in vs),
            "mean_received_bytes": statistics.mean(h["bytes_received"] for v in vs for h in v.subscribers),
            # subscriber updates that did not take the mode's path (a patch, or a checkpoint in full mode)
            "off_path_updates": sum(
                h["path"] != ("anchor" if self.mode == "full" else "patch") for v in vs for h in v.subscribers
            ),
            **self.bound_summary(),
        }

    def bound_summary(self) -> dict[str, Any]:
        """Latency against the bound (minimal relay-tree depth x one transfer at the link rate)."""
        vs = [v for v in self.counted() if v.bound_s]
        if not vs:
            return {}
        ratios = [v.latency_s / v.bound_s for v in vs if v.bound_s]
        after = [(v.latency_s - v.encode_s) / v.bound_s for v in vs if v.bound_s]
        depths = [v.tree_depth for v in vs if v.tree_depth is not None]
        return {
            "min_depth": vs[0].min_depth,
            "formed_depth_max": max(depths) if depths else None,
            "mean_transfer_s": statistics.mean(v.transfer_s or 0.0 for v in vs),
            "mean_bound_s": statistics.mean(v.bound_s or 0.0 for v in vs),
            "mean_ratio": statistics.mean(ratios),
            "max_ratio": max(ratios),
            "mean_latency_after_encode_s": statistics.mean(v.latency_s - v.encode_s for v in vs),
            "mean_ratio_after_encode": statistics.mean(after),
        }


PUBLISHER_FANOUT = 2  # Publisher(max_uploads_per_version=2)
TARGET_RATIO = 1.5
"""The target: the last subscriber holds a version within 1.5 x the bound."""


def min_tree_depth(n_subs: int, fanout: int = PUBLISHER_FANOUT) -> int:
    """The smallest depth d of a relay tree in which the publisher serves ``fanout`` subscribers and every
    subscriber then serves ``fanout`` others: fanout + fanout^2 + ... + fanout^d >= n_subs."""
    depth, reached, level = 0, 0, 1
    while reached < n_subs:
        depth += 1
        level *= fanout
        reached += level
    return depth


def tree_depth(parents: dict[int, int | None]) -> int | None:
    """Depth of the tree formed by ``{subscriber: index of the peer that served it}`` (publisher 0); None when a
    provider is unknown or the parents do not form a tree rooted at the publisher."""
    depths: dict[int, int] = {0: 0}

    def depth(i: int, seen: frozenset[int]) -> int | None:
        if i in depths:
            return depths[i]
        parent = parents.get(i)
        if parent is None or parent in seen:
            return None
        d = depth(parent, seen | {i})
        if d is None:
            return None
        depths[i] = d + 1
        return d + 1

    found = [depth(i, frozenset()) for i in parents]
    return None if not found or any(d is None for d in found) else max(d for d in found if d is not None)


Measured = tuple[CaseResult, dict[str, Any]]
"""A case and its :meth:`CaseResult.summary`: a row of the tables."""
CASE_COLUMNS: list[Column[Measured]] = [
    ("subs", 4, lambda cs: str(cs[0].subscribers)),
    ("mode", 7, lambda cs: cs[0].mode),
]
"""The label columns of both tables: subscribers and mode."""


def measured(cases: list[CaseResult]) -> list[Measured]:
    """The cases that measured at least one counted version, with their summaries."""
    return [(c, s) for c, s in ((c, c.summary()) for c in cases) if s]


BOUND_COLUMNS: list[Column[Measured]] = [
    *CASE_COLUMNS,
    ("depth_min", 9, lambda cs: str(cs[1]["min_depth"])),
    ("depth_formed", 12, lambda cs: "?" if cs[1]["formed_depth_max"] is None else str(cs[1]["formed_depth_max"])),
    ("transfer_s", 10, lambda cs: f"{cs[1]['mean_transfer_s']:.2f}"),
    ("bound_s", 7, lambda cs: f"{cs[1]['mean_bound_s']:.2f}"),
    ("latency_mean_s", 14, lambda cs: f"{cs[1]['mean_latency_s']:.2f}"),
    ("ratio_mean", 10, lambda cs: f"{cs[1]['mean_ratio']:.2f}"),
    ("ratio_max", 9, lambda cs: f"{cs[1]['max_ratio']:.2f}"),
    ("after_encode_s", 14, lambda cs: f"{cs[1]['mean_latency_after_encode_s']:.2f}"),
    ("ratio_after_encode", 18, lambda cs: f"{cs[1]['mean_ratio_after_encode']:.2f}"),
    ("upload_x_obj", 12, lambda cs: f"{cs[1]['upload_x_object']:.2f}"),
    ("target(<=1.5)", 13, lambda cs: "met" if cs[1]["mean_ratio"] <= TARGET_RATIO else "MISSED"),
]


def format_bound_table(cases: list[CaseResult]) -> str:
    """A line per measured case with a bound (rate-limited conditions only)."""
    return fixed_table(BOUND_COLUMNS, [(c, s) for c, s in measured(cases) if "mean_ratio" in s])


COLUMNS: list[Column[Measured]] = [
    *CASE_COLUMNS,
    ("versions", 8, lambda cs: str(cs[1]["versions"])),
    ("MB/version", 10, lambda cs: f"{cs[1]['mean_object_bytes'] / 1e6:.3f}"),
    ("vs_full_bf16", 12, lambda cs: f"{cs[1]['ratio_vs_full_bf16']:.5f}"),
    ("upload_MB/v", 11, lambda cs: f"{cs[1]['mean_upload_bytes'] / 1e6:.3f}"),
    ("upload_x_obj", 12, lambda cs: f"{cs[1]['upload_x_object']:.2f}"),
    ("max_x_obj", 9, lambda cs: f"{cs[1]['max_upload_x_object']:.2f}"),
    ("encode_s", 8, lambda cs: f"{cs[1]['mean_encode_s']:.2f}"),
    ("latency_mean_s", 14, lambda cs: f"{cs[1]['mean_latency_s']:.2f}"),
    ("latency_max_s", 13, lambda cs: f"{cs[1]['max_latency_s']:.2f}"),
    ("recv_MB/sub", 11, lambda cs: f"{cs[1]['mean_received_bytes'] / 1e6:.3f}"),
    ("off_path", 8, lambda cs: str(cs[1]["off_path_updates"])),
    ("digests", 7, lambda cs: f"{cs[1]['digests_matched']}/{cs[1]['versions']}"),
]


def format_table(cases: list[CaseResult]) -> str:
    """A line per measured case, a blank line between subscriber counts."""
    return fixed_table(COLUMNS, measured(cases), group=lambda cs: cs[0].subscribers)


def summarize(cases: list[CaseResult]) -> list[dict[str, Any]]:
    """Patches vs full checkpoints for each (condition, subscriber count) measured in both modes."""
    out = []
    by = {(c.condition, c.subscribers, c.mode): c for c in cases}
    for (cond, n, mode), patches in by.items():
        full = by.get((cond, n, "full"))
        if mode != "patches" or full is None or not patches.counted() or not full.counted():
            continue
        p, f = patches.summary(), full.summary()
        out.append(
            {
                "condition": cond,
                "subscribers": n,
                "patches_mean_latency_s": p["mean_latency_s"],
                "full_mean_latency_s": f["mean_latency_s"],
                "latency_speedup": f["mean_latency_s"] / p["mean_latency_s"],
                "max_latency_speedup": f["max_latency_s"] / p["max_latency_s"],
                "bytes_ratio": p["mean_object_bytes"] / f["mean_object_bytes"],
                "upload_ratio": p["mean_upload_bytes"] / f["mean_upload_bytes"],
            }
        )
    return out
