"""experiments/wan/simulate_rounds.py: the event-driven round simulation, checked on cases with a known answer.

With no CPU cost and no rate limit a round is its sequential round trips; with a rate limit the exchange adds each
peer's bytes at the link's rate; processor sharing splits a pool evenly; the byte accounting matches the sums
exchange's formula; bad costs and reports are refused with the field named.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import simulate_rounds as sim

FREE = sim.Costs(
    get_op_s=0.0, store_op_s=0.0, rpc_s=0.0, record_s=0.0, message_s=0.0, byte_s=0.0, round_s_per_entry=0.0
)


def scenario(**overrides: Any) -> sim.Scenario:
    base = {
        "peers": 4,
        "rate_bps": 0.0,
        "rtt_s": 0.1,
        "payload_bytes": 4e6,
        "aggregate_bytes": 4e6,
        "numel": 1_000_000,
        "compute_s": 10.0,
        "rounds": 3,
    }
    return sim.Scenario(**{**base, **overrides})


def test_processor_sharing_splits_a_pool_evenly_and_gives_a_late_job_its_share() -> None:
    clock = sim.Sim()
    pool = sim.Pool(clock, 1.0)
    done: dict[str, float] = {}
    pool.submit(1.0, lambda: done.setdefault("a", clock.now))
    pool.submit(1.0, lambda: done.setdefault("b", clock.now))
    clock.at(1.0, lambda: pool.submit(0.25, lambda: done.setdefault("c", clock.now)))
    clock.run()
    # a and b at half speed until 1.0 (0.5 done each), then thirds: c's 0.25 ends at 1.75, a and b at 2.25
    assert done == pytest.approx({"a": 2.25, "b": 2.25, "c": 1.75})
    assert pool.busy == pytest.approx(2.25)


def test_without_costs_or_rate_limits_a_round_is_its_sequential_round_trips() -> None:
    row = sim.simulate(scenario(), FREE)
    # catch-up read, registration store, expected read, registrations read, view store, its digest's store,
    # digests read, push and its reply, fetch and its aggregate, state store, states read: 11 round trips of 0.1 s
    # (one DHT hop at 5 nodes)
    assert row["dht_hops"] == 1
    assert row["round_s"] == pytest.approx(1.1)
    assert row["matchmaking_s"] == pytest.approx(0.6)
    assert row["exchange_s"] == pytest.approx(0.2)
    assert row["digest_s"] == pytest.approx(0.2)
    assert row["utilization_blocking"] == pytest.approx(10.0 / 11.1)
    assert row["utilization_overlap"] == 1.0


def test_bytes_per_peer_follow_the_sums_exchange_and_a_rate_limit_adds_their_transfer() -> None:
    fast, slow = sim.simulate(scenario(), FREE), sim.simulate(scenario(rate_bps=1e6), FREE)
    exchange = 3 / 4 * (4e6 + 4e6) + 3 * 2 * (sim.HEADER_BYTES + sim.REQUEST_BYTES)  # parts, aggregates, replies
    assert exchange < fast["bytes_sent"] < exchange + 60_000  # + the DHT's requests and records
    assert fast["bytes_sent_by_kind"]["exchange"] == pytest.approx(exchange)
    assert fast["bytes_received"] == pytest.approx(fast["bytes_sent"], rel=0.05)
    # 3 MB of parts, then 3 MB of aggregates, each way through 1 MB/s links: about 6 s more than unlimited
    assert slow["exchange_s"] - fast["exchange_s"] == pytest.approx(6.0, rel=0.02)


def test_more_peers_mean_more_dht_hops_and_longer_matchmaking() -> None:
    small, large = sim.simulate(scenario(peers=8), FREE), sim.simulate(scenario(peers=64, rounds=2), FREE)
    assert (small["dht_hops"], large["dht_hops"]) == (1, 3)
    assert large["matchmaking_s"] > small["matchmaking_s"]


def test_a_shared_pool_makes_cpu_work_queue_behind_the_other_peers() -> None:
    costs = dataclasses.replace(FREE, round_s_per_entry=1e-6, exchange_s_per_entry=1.5e-6)
    own = sim.simulate(scenario(mode="deployment", cores=1), costs)
    shared = sim.simulate(scenario(mode="machine", cores=1), costs)
    # 2.5 s of CPU per peer and round (the selection and the outer step 0.5 s each, encoding, summing and
    # decoding 0.5 s each): each peer on its own core, or four peers' work queued on one
    assert shared["round_s"] > own["round_s"] + 6.0
    assert shared["cpu_s_per_round"]["compute"] == pytest.approx(4 * 2.5)


def test_costs_and_reports_with_missing_fields_are_refused_with_the_field_named(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"costs": {"get_op_s": 0.001, "store_op_s": 0.001, "rpc_s": 0.001, "record_s": -1}}))
    with pytest.raises(ValueError, match="record_s"):
        sim.Costs.load(path)
    args = sim.build_parser().parse_args(["--costs", str(path)])
    with pytest.raises(ValueError, match="per_round"):
        sim.scenario_from_report({"config": {"peers": 4, "rate": "100mbit"}}, args)
    with pytest.raises(ValueError, match="bad rate"):
        sim.parse_rate("fast")
    assert sim.parse_rate("100mbit") == 12.5e6 and sim.parse_rate("0") == 0.0
