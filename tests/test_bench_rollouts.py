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
        ("--rtt-ms", "-1"),
        ("--rtt-ms", "40", "--jitter-ms", "11"),
        ("--mtu", "100"),
        ("--net-batch", "12"),
        ("--slow-link", "10mbit/200"),
        ("--slow-link", "fast/200/0.01"),
        ("--slow-link", "10mbit/20/0.01"),  # under rtt/2: the trainer's own link has rtt/4 of it
        ("--slow-link", "10mbit/200/0.9"),
        ("--trainer-core", "-1"),  # not one of this process's cores
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(ValueError):
        br.validate(_args(*argv))


def test_links_give_the_round_trip_asked_for():
    args = _args("--rtt-ms", "100", "--jitter-ms", "5", "--slow-link", "10mbit/300/0.02")
    links = br.case_links(br.make_case("netns-slow", 3), args)
    assert len(links) == 4 and links[0] == links[1] == links[2]
    assert (links[0].up, links[0].delay_ms, links[0].jitter_ms, links[0].loss) == ("100mbit", 25.0, 5.0, 0.0)
    slow = links[3]
    assert 2 * (links[0].delay_ms + slow.delay_ms) == 300.0  # the slow worker's RTT to the trainer
    assert (slow.up, slow.down, slow.loss) == ("10mbit", "10mbit", 0.02)
    assert br.case_links(br.make_case("netns-patch", 3), args)[3] == links[0]
    open_links = br.case_links(br.make_case("netns-open", 3), args)  # the emulators' own cost: no limits at all
    assert len(open_links) == 4 and {(x.up, x.down, x.delay_ms, x.jitter_ms, x.loss) for x in open_links} == {
        ("0", "0", 0.0, 0.0, 0.0)
    }
    assert "100 ms RTT +-5 ms jitter" in br.link_label(args)


def test_cases():
    assert br.make_case("swarm4", 2).workers == 4
    full = br.make_case("netns-full", 3)
    assert (full.workers, full.netns, full.full, full.model) == (3, True, True, "net")
    slow = br.make_case("netns-slow", 8)
    assert (slow.workers, slow.netns, slow.full, slow.slow) == (8, True, False, True)
    assert br.make_case("local", 2).label == "local"
    with pytest.raises(ValueError):
        br.make_case("nope", 2)


ROLLOUTS = [
    {"time": 1.0, "event": "rollouts", "mode": "train", "lags": [0, 0], "by_worker": {"a": 16},
     "seconds_waiting": 0.5, "local": False, "stale_dropped": 0, "refused": 0, "failed": 0},
    {"time": 2.0, "event": "rollouts", "mode": "train", "lags": [1, 2], "by_worker": {"a": 8, "b": 8},
     "seconds_waiting": 1.5, "local": False, "stale_dropped": 8, "refused": 1, "failed": 0,
     "verify": {"seconds": 0.3}},
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


def test_where_a_version_spent_its_way():
    records = [
        {"version": 1, "path": "anchor", "seconds_to_serve": 9.0, "seconds_update": 8.0, "seconds_load": 0.5},
        {"version": 2, "path": "patch", "seconds_to_serve": 1.0, "seconds_update": 0.5, "seconds_load": 0.1},
        {"version": 3, "path": "patch", "seconds_to_serve": 2.0, "seconds_update": 0.7, "seconds_load": 0.1},
        {"version": 4, "path": "patch", "seconds_to_serve": None, "seconds_update": 0.7, "seconds_load": 0.1},
        {"version": 5, "path": "patch", "seconds_to_serve": 3.0, "seconds_update": 0.9, "seconds_load": 0.3},
    ]
    way = rr.summarize_run(steps=1, train_seconds=1.0, rollouts=[], published=[], workers=[records])
    # the first anchor is the start-up, the record without a publish time cannot be split
    assert way["version_fetch_median"] == pytest.approx(0.7)
    assert way["version_load_median"] == pytest.approx(0.1)
    assert way["version_found_median"] == pytest.approx(1.2)  # 0.4, 1.2, 1.8


def test_summarize_run():
    rounds = [{"round": 0, "seconds_blocked": 1.25}, {"round": 1, "seconds_blocked": 0.5}]
    leases = [
        [{"began": 10.0, "started": 10.5, "seconds": 0.25}, {"began": 11.0, "started": 11.0, "seconds": 0.5}],
        [{"began": 10.0, "started": 10.25, "seconds": 1.0}, {"lease_id": "an older record"}],
    ]
    s = rr.summarize_run(
        steps=4,
        train_seconds=8.0,
        rollouts=ROLLOUTS,
        published=PUBLISHED,
        workers=WORKERS,
        outer_rounds=rounds,
        leases=leases,
    )
    assert s["leases"] == 3
    assert s["lease_version_wait_seconds"] == pytest.approx(0.75)  # began -> started, over both workers
    assert s["lease_generate_seconds"] == pytest.approx(1.75)
    assert rr.summarize_run(steps=1, train_seconds=1.0, rollouts=[], published=[], workers=[])["leases"] == 0
    assert s["samples"] == 4 * rr.BATCH
    assert s["outer_round_seconds"] == pytest.approx(1.75)  # the trainer's outer rounds, inner optimizer stopped
    assert s["samples_per_s"] == pytest.approx(64 / 8)
    assert s["steps_per_min"] == pytest.approx(30.0)
    assert s["seconds_waiting"] == pytest.approx(2.0)  # the eval round is not training time
    assert s["wait_fraction"] == pytest.approx(0.25)
    # steady state: one batch of 16 between the first train round (1.0 s) and the last (2.0 s); the eval round is not
    assert s["steady_seconds"] == pytest.approx(1.0) and s["steady_samples_per_s"] == pytest.approx(16.0)
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
    # where the time went: 2.0 s waiting of which 0.3 s checking; the rest of the train seconds is the trainer's
    assert "(d) Where the time went" in text
    assert "| netns-patch | 64.00 | 1.70 | 0.30 | 62.00 |" in text
    assert "swarm4" in text.split("Failed cases")[1]


def test_throughput_ratios_pair_each_seed_with_itself():
    """Two seeds: each seed's run over the link against the same seed's run without limits, then their mean (the
    report once compared every seed with the last seed's baseline and printed that one ratio only)."""
    results = [
        _result("nolimit-patch", 2, "net", 4.0, seed=0),
        _result("netns-patch", 2, "net", 3.0, seed=0),
        _result("nolimit-patch", 2, "net", 8.0, seed=1),
        _result("netns-patch", 2, "net", 4.0, seed=1),
        _result("local", 0, "tiny", 10.0, seed=0),
        _result("swarm2", 2, "tiny", 5.0, seed=0),
        _result("local", 0, "tiny", 20.0, seed=1),
        _result("swarm2", 2, "tiny", 5.0, seed=1),
    ]
    text = rr.build_tables(results)
    assert "without a link limit: 0.750 / 0.500 (seeds 0 / 1), mean 0.625;" in text
    assert "patches / full copies (same link): -" in text
    assert "| swarm2 | 0 | 2 | 8 | 25.60 | 5.00 | 18.75 | 0.50 |" in text
    assert "| swarm2 | 1 | 2 | 8 | 25.60 | 5.00 | 18.75 | 0.25 |" in text
    one_side = [r for r in results if not (r["name"] == "nolimit-patch" and r["seed"] == 1)]
    assert "without a link limit: 0.750;" in rr.build_tables(one_side)
    # runs recorded before the steady-state figure: their seeds are left out of that ratio only
    older = [{k: v for k, v in r.items() if k != "steady_samples_per_s"} if r["seed"] == 0 else r for r in results]
    assert (
        "mean 0.625; from the first batch to the last (steady state: without the start and the run's end, its "
        "outer round and last flush): 1.000\n" in rr.build_tables(older)
    )


def test_ratio():
    assert rr.ratio(2.0, 4.0) == 0.5
    assert rr.ratio(None, 4.0) is None and rr.ratio(1.0, 0.0) is None
