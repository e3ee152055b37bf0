"""Smoke tests of experiments/rollouts/bench_rollouts.py's pure parts: argument checks and tables from sample JSON
lines."""

from __future__ import annotations

import bench_rollouts as br
import pytest
import rollouts_report as rr


def _args(*argv: str):
    return br.build_parser().parse_args(list(argv))


def test_default_arguments_are_valid():
    names = br.validate(_args())
    assert names == list(br.ALL_CASES)


@pytest.mark.parametrize(
    "argv",
    [
        ("--cases", "local,bogus"),
        ("--cases", ""),
        ("--cases", "local,local"),
        ("--steps", "0"),
        ("--net-workers", "0"),
        ("--rate", "fast"),
        ("--case-timeout", "0"),
        ("--net-intermediate", "64"),
        ("--max-lag", "-1"),
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(ValueError):
        br.validate(_args(*argv))


def test_cases():
    assert br.make_case("swarm4", 2).workers == 4
    full = br.make_case("netns-full", 3)
    assert (full.workers, full.netns, full.full, full.model) == (3, True, True, "net")
    assert br.make_case("local", 2).label == "local"
    with pytest.raises(ValueError):
        br.make_case("nope", 2)


ROLLOUTS = [
    {"time": 1.0, "event": "rollouts", "mode": "train", "lags": [0, 0], "by_worker": {"a": 16},
     "seconds_waiting": 0.5, "local": False, "stale_dropped": 0, "refused": 0, "failed": 0},
    {"time": 2.0, "event": "rollouts", "mode": "train", "lags": [1, 2], "by_worker": {"a": 8, "b": 8},
     "seconds_waiting": 1.5, "local": False, "stale_dropped": 8, "refused": 1, "failed": 0},
    {"time": 2.5, "event": "rollouts", "mode": "eval", "lags": [0], "by_worker": {"a": 8}, "seconds_waiting": 9.0},
]  # fmt: skip
PUBLISHED = [
    {"event": "publish", "version": 1, "patch_bytes": 1_000_000},
    {"event": "publish", "version": 2, "patch_bytes": 10_000},
    {"event": "publish", "version": 3, "patch_bytes": 30_000},
]
WORKERS = [
    [{"version": 1, "seconds_to_serve": 0.2, "bytes_received": 1_000_000, "path": "anchor"},
     {"version": 3, "seconds_to_serve": 0.4, "bytes_received": 40_000, "path": "squash"}],
    [{"version": 2, "seconds_to_serve": None, "bytes_received": 10_000, "path": "patch"}],
]  # fmt: skip


def test_summarize_run():
    s = rr.summarize_run(steps=4, train_seconds=8.0, rollouts=ROLLOUTS, published=PUBLISHED, workers=WORKERS)
    assert s["samples"] == 4 * rr.BATCH
    assert s["samples_per_s"] == pytest.approx(64 / 8)
    assert s["steps_per_min"] == pytest.approx(30.0)
    assert s["seconds_waiting"] == pytest.approx(2.0)  # the eval round is not training time
    assert s["wait_fraction"] == pytest.approx(0.25)
    assert s["lag_histogram"] == {"0": 2, "1": 1, "2": 1}
    assert (s["stale_dropped"], s["refused"], s["local_rounds"]) == (8, 1, 0)
    assert s["completions_by_worker"] == {"a": 24, "b": 8}
    assert s["versions_published"] == 3
    assert s["patch_bytes_median"] in (10_000, 30_000)  # the anchor (version 1) is left out
    assert s["seconds_to_serve"] == [0.2, 0.4]
    assert s["worker_versions"] == [2, 1]
    assert s["worker_paths"] == {"anchor": 1, "patch": 1, "squash": 1}


def test_summarize_empty_run():
    s = rr.summarize_run(steps=0, train_seconds=0.0, rollouts=[], published=[], workers=[])
    assert s["samples_per_s"] is None and s["wait_fraction"] is None and s["seconds_to_serve_median"] is None


def _result(name: str, workers: int, model: str, sps: float, **kw):
    case = br.make_case(name, workers) if name != "local" else br.Case("local", 0, "tiny")
    summary = rr.summarize_run(
        steps=8, train_seconds=64 * 2 / sps, rollouts=ROLLOUTS, published=PUBLISHED, workers=WORKERS
    )
    summary["samples_per_s"] = sps
    return {**br.asdict(case), "label": case.label, "reward_before": 0.2, "reward_after": 0.3,
            "train_reward_last": 0.25, **summary, **kw}  # fmt: skip


def test_build_tables():
    results = [
        _result("local", 0, "tiny", 10.0),
        _result("swarm2", 2, "tiny", 5.0),
        _result("nolimit-patch", 2, "net", 4.0),
        _result("netns-patch", 2, "net", 2.0),
        _result("netns-full", 2, "net", 0.5),
        {**br.asdict(br.make_case("swarm4", 2)), "label": "x", "error": "skipped: no root"},
    ]
    text = rr.build_tables(results)
    assert "(a) Throughput" in text and "(b) Rate-limited" in text and "(c) Lag" in text
    assert "patches / full copies (same link): 4.000" in text
    assert "without a link limit: 0.500" in text
    assert "| swarm2 | 0 | 2 | 8 |" in text
    assert "0:2 1:1 2:1" in text
    assert "swarm4" in text.split("Failed cases")[1]


def test_ratio():
    assert rr.ratio(2.0, 4.0) == 0.5
    assert rr.ratio(None, 4.0) is None and rr.ratio(1.0, 0.0) is None
