"""PULSELoCo swarms on 127.0.0.1: real hivemind DHTs, one process per peer (forked), a tiny Llama.

Each test starts its peers against a bootstrap DHT, collects their reports (per-round digests and metrics, final
theta) and checks one property of the protocol. Processes are reaped by tests/conftest.py.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import hivemind
import pytest
import torch
from harness import ledger
from loco_helpers import (
    PeerConfig,
    batch,
    flat_params,
    inner_step,
    load_flat,
    make_inner_optimizer,
    make_model,
    run_peer,
)

from pulseloco.loco.robust import part_norm
from pulseloco.loco.validation import theta_digest

REPORT_TIMEOUT_S = 150.0


@pytest.fixture(scope="module")
def initial_peers() -> Iterator[list[str]]:
    make_model(0)  # import the transformers model code once here, not in every forked peer
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        yield [str(addr) for addr in dht.get_visible_maddrs()]
    finally:
        dht.shutdown()


def run_swarm(configs: list[PeerConfig], num_reports: int | None = None) -> list[dict[str, Any]]:
    """Start one forked process per config and return the reports, ordered by peer index.

    Forking keeps the tests fast: torch, transformers and hivemind are already imported here.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    on_time = [config for config in configs if config.start_delay == 0 and not config.join_late]
    barrier = ctx.Barrier(len(on_time))
    end_barrier = ctx.Barrier(max(1, sum(config.end_together for config in configs)))
    late_event = ctx.Event()
    procs = [
        ctx.Process(
            target=run_peer,
            args=(
                config,
                results,
                barrier if config in on_time else None,
                late_event,
                end_barrier if config.end_together else None,
            ),
        )
        for config in configs
    ]
    for proc in procs:
        proc.start()
    expected = len(configs) if num_reports is None else num_reports
    may_die = {
        i
        for i, config in enumerate(configs)
        if config.die_in_round is not None or "die_fetching" in config.faults.values()
    }
    reports: list[dict[str, Any]] = []
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    try:
        while len(reports) < expected:
            try:
                reports.append(results.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            crashed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in may_die]
            if crashed and results.empty():
                pytest.fail(f"peer(s) {crashed} exited with {[procs[i].exitcode for i in crashed]} before reporting")
            if time.monotonic() > deadline:
                pytest.fail(f"only {len(reports)} of {expected} peer(s) reported within {REPORT_TIMEOUT_S}s")
    finally:
        for proc in procs:
            proc.join(timeout=15)
    return sorted(reports, key=lambda r: r["index"])


def _digests(report: dict[str, Any]) -> dict[int, str]:
    return {r["round"]: r["digest"] for r in report["rounds"]}


def _rounds_summary(reports: list[dict[str, Any]]) -> str:
    """Each peer's rounds, one line each (for an assertion's message: what a failed exactly-once check ran into)."""
    keys = ("num_peers", "complete", "repaired", "num_returned", "num_reconciled", "num_rejected")
    lines = []
    for report in sorted(reports, key=lambda r: r["index"]):
        for r in report["rounds"]:
            fields = " ".join(f"{key}={r.get(key)}" for key in keys)
            lines.append(f"peer{report['index']} round={r['round']} digest={r['digest'][:8]} {fields}")
    return "\n".join(lines)


def _one_theta(reports: list[dict[str, Any]]) -> bool:
    """Whether every peer ended on the same theta, bit for bit."""
    return len({report["theta"] for report in reports}) == 1


def _split_in_round_1(reports: list[dict[str, Any]]) -> bool:
    """Whether peers 1 and 2 (their DHT views failed) each averaged round 1 alone, and so did peer 0 unless it
    reached round 1 after they had finished it (a slow round 0 on a loaded machine): it then adopted their state
    at round 2 and has no round 1 of its own."""
    sizes = [[r["num_peers"] for r in report["rounds"] if r["round"] == 1] for report in reports]
    return sizes[1] == sizes[2] == [1] and sizes[0] in ([1], [])


def _peer_logs(logs: list[Any]) -> str:
    """The pulseloco lines of the peers' log files, in order of time (for an assertion's message)."""
    lines = [line for log in logs if log.exists() for line in log.read_text().splitlines() if " pulseloco." in line]
    return "\n".join(sorted(lines, key=lambda line: int(line.split(" ", 1)[0]) if line[:1].isdigit() else 0))


def test_three_peers_end_every_round_with_equal_digests(initial_peers: list[str], tmp_path: Any) -> None:
    configs = [
        PeerConfig(
            index=i,
            initial_peers=initial_peers,
            num_rounds=4,
            run_id="equal",
            extra={"metrics_path": str(tmp_path / f"peer{i}.jsonl")},
        )
        for i in range(3)
    ]
    reports = run_swarm(configs)
    for report in reports:
        assert [r["round"] for r in report["rounds"]] == [0, 1, 2, 3]
        assert all(r["num_peers"] == 3 and not r["repaired"] and r["num_returned"] == 0 for r in report["rounds"])
        assert all(r["num_sent"] > 0 for r in report["rounds"])
    assert _digests(reports[0]) == _digests(reports[1]) == _digests(reports[2])
    assert len(set(_digests(reports[0]).values())) == 4
    assert torch.equal(ledger.vector(reports[0], "theta"), ledger.vector(reports[1], "theta"))
    assert all(r["num_contributors"] == 3 and r["complete"] for report in reports for r in report["rounds"])
    assert ledger.conservation_error(reports) < 1e-5, _rounds_summary(reports)
    lines = [line for line in (tmp_path / "peer0.jsonl").read_text().splitlines() if line]
    assert len(lines) == 4
    import json

    record = json.loads(lines[-1])
    assert record["bytes_sent"] > 0 and record["bytes_received"] > 0 and record["num_peers"] == 3
    # the outer step's time, split: group formation, the all-reduce, the digest check; each measured, within it
    for line in lines:
        record = json.loads(line)
        parts = [record["seconds_matchmaking"], record["seconds_exchange"], record["seconds_digest"]]
        assert all(part > 0 for part in parts) and sum(parts) <= record["seconds_sync"], record


def _clipped(x: torch.Tensor, bar: float) -> torch.Tensor:
    """``x`` scaled down to the L2 norm ``bar`` when above it (an FP32 scale), rounded once so that ``x - kept`` is
    exact: the plain reference of the owners' clip-to-median rule (the norm: its definition, ``part_norm``)."""
    norm = part_norm(x)
    if norm <= bar:
        return x
    scale = torch.tensor(min(1.0, float(torch.tensor(bar / norm, dtype=torch.float32))), dtype=torch.float32)
    return x * scale if float(scale) >= 0.5 else x - x * (1.0 - scale)


def test_dense_swarm_equals_reference_diloco_with_median_clipping(initial_peers: list[str]) -> None:
    """Dense DiLoCo over the swarm, bit for bit against a plain reference: every shard owner clips each part to the
    median of the three parts' norms in its shard, and each peer keeps what was clipped off in its residual (sent
    again the next round)."""
    num_rounds, inner_steps, lr = 3, 4, 1e-3
    configs = [
        PeerConfig(
            index=i,
            initial_peers=initial_peers,
            num_rounds=num_rounds,
            selector="dense",
            inner_steps=inner_steps,
            inner_lr=lr,
            run_id="dense",
            averaging_timeout=30.0,  # bit-exactness needs every part counted: no owner may stop waiting under load
        )
        for i in range(3)
    ]
    reports = run_swarm(configs)
    order = [r["index"] for r in sorted(reports, key=lambda r: r["peer_id"])]  # the swarm sums by peer id

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the peers: same reduction order, bit-identical inner steps
    num_clipped = 0
    try:
        models = {i: make_model(0) for i in range(3)}
        inners = {i: make_inner_optimizer(models[i], lr) for i in range(3)}
        theta = flat_params(models[0]).clone()
        numel = theta.numel()
        base, extra = divmod(numel, 3)
        starts = [j * base + min(j, extra) for j in range(4)]
        bounds = [(starts[j], starts[j + 1]) for j in range(3)]
        residuals = {i: torch.zeros_like(theta) for i in range(3)}
        v = torch.zeros_like(theta)
        digests = []  # the reference's theta after each round: where a failed run first left it
        for r in range(num_rounds):
            signals = {}
            for i in order:
                load_flat(models[i], theta)
                for step in range(inner_steps):
                    inner_step(models[i], inners[i], batch(i, r * inner_steps + step))
                    inners[i].step()
                    inners[i].zero_grad()
                signals[i] = residuals[i] + (theta - flat_params(models[i]))
            total = torch.zeros_like(theta)
            for start, stop in bounds:
                parts = {i: signals[i][start:stop].clone() for i in order}
                bar = statistics.median(part_norm(x) for x in parts.values())
                for i in order:
                    kept = _clipped(parts[i], bar)
                    num_clipped += int(kept is not parts[i])
                    residuals[i][start:stop] = parts[i] - kept
                    total[start:stop] += kept
            g = total / 3
            v = 0.9 * v + g
            theta = theta - 0.7 * (g + 0.9 * v)
            digests.append(theta_digest(theta))
    finally:
        torch.set_num_threads(before)
    assert num_clipped > 0  # the rule did something
    context = f"reference digests {[d[:8] for d in digests]}\n{_rounds_summary(reports)}"
    for report in reports:
        assert all(r["num_peers"] == 3 and r["num_sent"] == theta.numel() for r in report["rounds"])
        # what bit-exactness with the reference assumes: every part counted, nothing returned or repaired
        full = all(
            r["num_contributors"] == 3 and r["complete"] and not r["repaired"] and r["num_returned"] == 0
            for r in report["rounds"]
        )
        assert full, context
        assert [r["digest"] for r in report["rounds"]] == digests, context
        assert torch.equal(ledger.vector(report, "theta").view(torch.int32), theta.view(torch.int32))
        index = report["index"]
        assert torch.equal(ledger.vector(report, "residual").view(torch.int32), residuals[index].view(torch.int32))


@pytest.mark.parametrize("when", ["before_pushing", "after_pushing", "client_after_pushing"])
def test_peer_killed_mid_round_does_not_stop_the_others(initial_peers: list[str], when: str) -> None:
    """Peer 2 dies (SIGKILL, with its DHT process and daemon) in round 1, once its group formed (before it pushes
    its parts) or once it pushed them (before it fetches): the owners waiting for its parts, or for its fetch of
    their sums, ping it, find it gone and stop waiting, and the members' fetches of its shard give up, so round 1
    takes a few seconds, not the 30 s averaging wait. A client-mode peer cannot be pinged: the owners it pushed to
    see its connection gone instead."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=3, run_id=f"kill-{when}", averaging_timeout=30.0)
    base = replace(base, matchmaking_time=2.0)
    dies: dict[str, Any] = {"die_in_round": 1} if when == "before_pushing" else {"faults": {1: "die_fetching"}}
    if when.startswith("client"):
        dies["client_mode"] = True
    configs = [replace(base, index=0), replace(base, index=1), replace(base, index=2, **dies)]
    start = time.monotonic()
    reports = run_swarm(configs, num_reports=2)
    elapsed = time.monotonic() - start
    assert [r["index"] for r in reports] == [0, 1]
    for report in reports:
        rounds = report["rounds"]
        assert [r["round"] for r in rounds] == [0, 1, 2]
        assert rounds[0]["num_peers"] == 3
        # Round 1: the dead peer was in the group. Killed before pushing, its shard never arrived, so this peer's
        # entries there went back into the residual. Killed after pushing, it may have served its shard's sum
        # before it died (the others' parts reached it while its own pushes were in flight): then the round is
        # complete; else the entries went back. A client owns no shard.
        assert rounds[1]["num_peers"] == 3
        if when == "before_pushing":
            assert not rounds[1]["complete"] and rounds[1]["num_returned"] > 0, rounds[1]
        else:
            assert rounds[1]["complete"] or rounds[1]["num_returned"] > 0, rounds[1]
        assert rounds[1]["seconds_sync"] < 10.0, rounds[1]
        assert rounds[2]["num_peers"] == 2
    assert _digests(reports[0]) == _digests(reports[1])
    assert torch.isfinite(ledger.vector(reports[0], "theta")).all()
    assert elapsed < 60


def test_a_member_whose_push_fails_retries_it_or_tells_the_owner_it_gave_up(
    initial_peers: list[str], tmp_path: Any
) -> None:
    """Peer 0, as a shard owner, ends the push stream of the first member that pushes to it without an answer: in
    round 1 once (as a push that fails with libp2p's "routing: not found" while the owner's pings get through:
    the member pings and pushes again, and the part counts), in round 2 on every attempt (the member gives up, its
    part goes back to its residual, and the owner, pinging it, learns so and sums without it instead of waiting
    out the 30 s averaging wait, as it did in a 16-peer WAN run). Dense selector: the outside ledger checks that
    every contribution counts exactly once."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=4, run_id="cut-push", selector="dense")
    base = replace(base, matchmaking_time=2.0, averaging_timeout=30.0, linger=4.0, end_together=True)
    logs = [tmp_path / f"peer{i}.log" for i in range(3)]
    faults = {1: "cut_push", 2: "cut_pushes"}
    configs = [replace(base, index=i, log_file=str(logs[i]), faults=faults if i == 0 else {}) for i in range(3)]
    reports = run_swarm(configs)
    context = _rounds_summary(reports) + "\n" + _peer_logs(logs)
    by_round = {r: [next(x for x in report["rounds"] if x["round"] == r) for report in reports] for r in (1, 2)}
    assert all(x["num_peers"] == 3 and x["complete"] for x in by_round[1]), context  # the retry counted
    assert all(x["num_peers"] == 3 and x["seconds_sync"] < 12.0 for x in by_round[2]), context
    assert sum(x["num_returned"] > 0 for x in by_round[2]) == 1, context  # the member that gave up, alone
    logged = "\n".join(log.read_text() for log in logs)
    assert "retrying push round=1" in logged and "gave up pushing round=2" in logged, context
    assert "averaging timeout" not in logged, context
    assert _one_theta(reports), context
    assert ledger.conservation_error(reports) < 1e-5, context


def test_late_joiner_catches_up_and_then_matches(initial_peers: list[str]) -> None:
    base = PeerConfig(
        index=0,
        initial_peers=initial_peers,
        num_rounds=9,
        run_id="late",
        target_group_size=None,
        matchmaking_time=3.0,
        linger=4.0,
    )
    configs = [
        replace(base, index=0, announce_round=1),
        replace(base, index=1),
        # 5 rounds: under a loaded CI machine all of 4 rounds once ran apart from the others (the check below failed)
        replace(base, index=2, num_rounds=5, join_late=True),
    ]
    reports = run_swarm(configs)
    early, late = reports[0], reports[2]
    # It takes the swarm's state at construction, or, when that lookup or download fails (the DHT lookup of a
    # freshly started node can time out on a loaded machine: a fresh-clone CI run joined at round 0 so), at the end
    # of its first round, before it averages.
    assert late["joined_at_round"] > 0 or late["rounds"][0]["repaired"], late["rounds"][:1]
    # A round the joiner disturbs may split the group under heavy load; the digest check then repairs the
    # minority, so the early peers must agree again by the end (equality in every round is the 3-peer test's).
    final = max(_digests(reports[0]))
    assert _digests(reports[0])[final] == _digests(reports[1])[final]
    shared = [r for r in late["rounds"] if r["num_peers"] == 3]
    assert shared, "the late peer never averaged with the others"
    for record in shared:
        assert _digests(early)[record["round"]] == record["digest"]


def test_malicious_payloads_are_rejected(initial_peers: list[str]) -> None:
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=3, run_id="evil")
    configs = [replace(base, index=0), replace(base, index=1), replace(base, index=2, malicious=True)]
    reports = run_swarm(configs)
    for round_index in range(3):  # NaN values, out-of-range indices, 1e4x norm
        per_peer = [report["rounds"][round_index] for report in reports]
        assert all(r["num_peers"] == 3 for r in per_peer)
        assert sum(r["num_rejected"] for r in per_peer) == 3  # every owner rejected exactly the bad part
        assert per_peer[2]["num_returned"] == per_peer[2]["num_sent"]  # all of it goes back to its residual
        assert per_peer[0]["num_returned"] == 0 and per_peer[1]["num_returned"] == 0
    assert all(r["num_contributors"] == 2 for report in reports for r in report["rounds"])
    assert _digests(reports[0]) == _digests(reports[1]) == _digests(reports[2])
    assert torch.isfinite(ledger.vector(reports[0], "theta")).all()


def test_a_byzantine_trainer_is_clipped_to_the_median_then_excluded(initial_peers: list[str]) -> None:
    """Four peers, one Byzantine: from round 0 it sends its selection sign-flipped at 9x its norm
    (experiments/byzantine/byzantine.py). Each owner clips it to the median norm of its shard's parts (the honest parts
    are never struck), the honest consensus still moves along the honest pseudo-gradients every round, every
    honest peer's exact ledger holds (produced = counted at the reported scales + residual), and after strikes in
    five rounds every owner excludes the attacker and names it disputed (and no one else)."""
    num_rounds = 7
    # generous waits: the per-round checks need every shard of every round fetched by every peer; the defaults (6 s,
    # 3 s) let a fetch time out under a loaded CI machine (seen once: one peer's accepted lists differed in a round)
    base = PeerConfig(
        index=0,
        initial_peers=initial_peers,
        num_rounds=num_rounds,
        run_id="byzantine",
        target_group_size=4,
        averaging_timeout=30.0,
        request_timeout=10.0,
    )
    configs = [replace(base, index=i, record_parts=True) for i in range(3)]
    configs.append(replace(base, index=3, record_parts=True, attack="flip"))
    reports = run_swarm(configs)
    honest, bad = reports[:3], reports[3]["peer_id"]
    assert _digests(reports[0]) == _digests(reports[1]) == _digests(reports[2]) == _digests(reports[3])
    from pulseloco.loco.robust import clip_scale, clip_split

    for r in range(num_rounds):
        records = {report["peer_id"]: report["parts"][r] for report in reports}
        assert all(record["round"] == r for record in records.values())
        accepted, bars = records[honest[0]["peer_id"]]["accepted"], records[honest[0]["peer_id"]]["bars"]
        assert all(records[h["peer_id"]]["accepted"] == accepted for h in honest)  # one verdict per shard
        sent = {peer: ledger.vector(record, "sent") for peer, record in records.items()}
        honest_N = sum(sent[h["peer_id"]] for h in honest)
        assert isinstance(honest_N, torch.Tensor)
        applied_N = torch.zeros_like(honest_N)
        numel = honest_N.numel()  # shard j of a group of four: the j-th quarter (shard_bounds)
        base_size, extra = divmod(numel, 4)
        starts = [j * base_size + min(j, extra) for j in range(5)]
        for j in range(4):
            names = accepted[j]
            norms = {peer: record["norms"][j] for peer, record in records.items()}
            bar = statistics.median(norms[peer] for peer in names)
            assert bars[j] == bar  # the owner's norms are the senders' own, bit for bit (part_norm)
            shard_scales = {peer: clip_scale(norms[peer], bar) for peer in names}
            for h in honest:  # honest parts: always counted, never near a strike
                assert h["peer_id"] in names and norms[h["peer_id"]] < 4.0 * bar
            if bad in names:  # the attacker counts with one honest-sized vector at most
                assert shard_scales[bad] * norms[bad] <= bar * (1 + 1e-6)
                assert norms[bad] > 4.0 * bar  # a strike
            else:
                assert r >= 5 or norms[bad] > 10.0 * bar  # excluded, or (before) refused by the outlier screen
            for peer in names:
                part = sent[peer][starts[j] : starts[j + 1]]
                applied_N[starts[j] : starts[j + 1]] += clip_split(part, shard_scales[peer])[0]
        assert any(bad in names for names in accepted) == (r < 5)  # excluded by every owner after five strikes
        assert float(applied_N @ honest_N) > 0.0  # the consensus moves the honest way
        # unclipped (the screen alone lets 9x through), the attack would outweigh the three honest parts together
        assert float(torch.linalg.vector_norm(sent[bad])) > float(torch.linalg.vector_norm(honest_N))
    for h in honest:
        assert h["distrusted"] == [bad]
        error = ledger.vector(h, "produced") - ledger.vector(h, "counted") - ledger.vector(h, "residual")
        produced = ledger.vector(h, "produced")
        assert float(torch.linalg.vector_norm(error)) < 1e-6 * float(torch.linalg.vector_norm(produced))
    moved_N = flat_params(make_model(0)) - ledger.vector(honest[0], "theta")
    honest_total = sum(ledger.vector(h, "produced") for h in honest)
    assert isinstance(honest_total, torch.Tensor)
    assert float(torch.nn.functional.cosine_similarity(moved_N, honest_total, dim=0)) > 0.5


def test_bf16_values_average_to_equal_digests_and_conserve(initial_peers: list[str]) -> None:
    """The pulse rule's BF16-value option over the wire: parts travel as BF16, the remainders stay in the
    residuals, and the swarm still ends every round on one theta with every contribution counted once."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=3, run_id="bf16")
    reports = run_swarm([replace(base, index=i, extra={"pulse_values": "bfloat16"}) for i in range(3)])
    for report in reports:
        assert all(r["num_contributors"] == 3 and r["complete"] and r["num_sent"] > 0 for r in report["rounds"])
    assert _digests(reports[0]) == _digests(reports[1]) == _digests(reports[2])
    assert ledger.conservation_error(reports) < 1e-5, _rounds_summary(reports)
    assert torch.any(ledger.vector(reports[0], "residual") != 0)


def test_sparseloco_pair_ends_every_round_identical(initial_peers: list[str]) -> None:
    """Two SparseLoCo peers (top-64 per tile, 2-bit values, decayed error feedback, SGD outer step, mean over
    senders): every shard is gathered (each owner relays the other's quantized part) and both end every round on
    one theta."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=3, run_id="sparseloco", selector="sparseloco")
    reports = run_swarm([replace(base, index=i, target_group_size=2) for i in range(2)])
    for report in reports:
        assert all(r["num_contributors"] == 2 and r["complete"] and r["num_sent"] > 0 for r in report["rounds"])
        assert all(not r["repaired"] and r["num_returned"] == 0 for r in report["rounds"])
    assert _digests(reports[0]) == _digests(reports[1])
    assert len(set(_digests(reports[0]).values())) == 3
    assert torch.equal(ledger.vector(reports[0], "theta"), ledger.vector(reports[1], "theta"))
    for first, second in zip(reports[0]["rounds"], reports[1]["rounds"]):  # the union of the two selections
        assert first["num_averaged"] == second["num_averaged"]
        assert (
            max(first["num_sent"], second["num_sent"])
            <= first["num_averaged"]
            <= first["num_sent"] + second["num_sent"]
        )


def test_gathered_parts_average_to_the_same_bits_as_summed_ones(initial_peers: list[str]) -> None:
    """The PULSE gate with a budget and 2-bit values, three peers: relaying the parts (gather) and serving their
    FP32 sums give the same thetas (to the rounding of the additions' order), and every contribution is counted
    once (the residuals hold the quantization error)."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=3, run_id="gather")
    extra = {"pulse_values": "quantized", "pulse_budget": 64}
    thetas = []
    for exchange in ("gather", "sums"):
        configs = [
            replace(base, index=i, run_id=f"x-{exchange}", extra={**extra, "exchange": exchange}) for i in range(3)
        ]
        reports = run_swarm(configs)
        for report in reports:
            assert all(r["num_contributors"] == 3 and r["complete"] and r["num_sent"] > 0 for r in report["rounds"])
        assert _digests(reports[0]) == _digests(reports[1]) == _digests(reports[2])
        assert ledger.conservation_error(reports) < 1e-5, _rounds_summary(reports)
        thetas.append(ledger.vector(reports[0], "theta"))
    # The two swarms' peers have fresh ids, so the sorted-id order of the additions can differ: equal up to the
    # rounding of three FP32 additions per entry, not bit for bit (within one swarm every peer has the same bits).
    assert torch.allclose(thetas[0], thetas[1], rtol=1e-6, atol=1e-9)


def test_sparseloco_trio_reduces_with_topk_where_it_sends_less(initial_peers: list[str]) -> None:
    """SparseLoCo in a group of three with an aggregate budget of one part (``exchange_budget=1``, where topk sends
    less than gather from three peers on): ``auto`` serves each shard with topk (the kept aggregate is at most the
    budget, fewer entries than the union of the three selections) and the three end every round identical."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=2, run_id="sl-topk", selector="sparseloco")
    base = replace(base, extra={"exchange_budget": 1.0})
    reports = run_swarm([replace(base, index=i) for i in range(3)])
    for report in reports:
        assert all(r["num_contributors"] == 3 and r["complete"] for r in report["rounds"])
    assert _digests(reports[0]) == _digests(reports[1]) == _digests(reports[2])
    for first in reports[0]["rounds"]:
        # one part's worth of entries, give or take the tiles cut by shard bounds
        assert first["num_averaged"] <= 1.2 * max(r["num_sent"] for rep in reports for r in rep["rounds"])
    assert sum(r["num_returned"] for report in reports for r in report["rounds"]) > 0


def test_a_poisoned_peer_in_a_pair_is_refused_as_contributor_and_as_owner(initial_peers: list[str]) -> None:
    """Two peers, no majority: the honest owner screens against its own part, and the honest member refuses the
    poisoned owner's average (round 2, 1e4x norms), names it disputed and never repairs from it."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=3, run_id="pair", target_group_size=2)
    reports = run_swarm([replace(base, index=0), replace(base, index=1, malicious=True)])
    honest = reports[0]["rounds"]
    assert [r["num_peers"] for r in honest] == [2, 2, 2]
    assert all(r["num_contributors"] == 1 for r in honest)  # only its own part ever counted
    assert all(r["num_rejected"] == 1 for r in honest)  # its shard refused the bad part every round
    assert [r["complete"] for r in honest] == [True, True, False]  # round 2: the poisoned average was refused
    assert not any(r["repaired"] for r in honest)  # and the poisoned state was never adopted
    assert torch.isfinite(ledger.vector(reports[0], "theta")).all()
    assert ledger.vector(reports[0], "theta").abs().max() < 10.0


def test_every_contribution_counts_exactly_once_under_faults(initial_peers: list[str], tmp_path: Any) -> None:
    """Four failure modes, one per round, on three peers with the dense selector (every entry sent),
    checked against an exact outside ledger (scripts/harness/ledger.py):

    round 1: the DHT views of peers 1 and 2 fail at the round's start: each averages alone, and so does peer 0
    (a three-way split: two of the three are then repaired to one lineage and keep their own contributions);
    round 3: peer 2 stalls for 4 s (SIGSTOP) while fetching the sums, its parts already pushed;
    round 5: peer 2 stalls for 14 s, past the whole averaging wait (averaging 6 s + 2 x 3 s requests);
    round 7: peer 0, as a shard owner, ends one member's fetch streams before their first message.

    A clean round after each fault lets the digest check bring the peers back together, well within the
    ledger's window (``pulseloco.loco.ledger.DEFAULT_KEEP_ROUNDS``), and three clean rounds close the run: a peer
    stalled past the averaging wait can need two rounds to rejoin (it sat out rounds 7 and 8 of a 9-round run once
    in CI, ending alone on an older theta when the others left).
    """
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=11, run_id="once", selector="dense")
    base = replace(base, matchmaking_time=4.0, linger=6.0, end_together=True)
    logs = [tmp_path / f"peer{i}.log" for i in range(3)]
    configs = [
        replace(base, index=0, faults={7: "cut_fetch"}, log_file=str(logs[0])),
        replace(base, index=1, faults={1: "alone"}, log_file=str(logs[1])),
        replace(base, index=2, faults={1: "alone", 3: "stall:4", 5: "stall:14"}, log_file=str(logs[2])),
    ]
    reports = run_swarm(configs)
    context = _rounds_summary(reports) + "\n" + _peer_logs(logs)
    # A peer that fell a round behind averages its last round alone after the others stopped (once in CI); at
    # the end all catch up to it (run_peer's end_barrier): one round, one theta, nothing lost.
    assert len({report["final_round"] for report in reports}) == 1, context
    assert reports[0]["final_round"] in (11, 12), context
    assert _split_in_round_1(reports), context
    # Every peer ends on the same theta, and that theta together with the residuals holds every contribution
    # exactly once (a double count is a whole shard part of a round: percents of the total, not 1e-5).
    assert _one_theta(reports), context
    assert ledger.conservation_error(reports) < 1e-5, context
    # The faults did what they should: incomplete rounds, and residuals reconciled with the adopted state.
    assert sum(r["num_reconciled"] for report in reports for r in report["rounds"]) > 0
    assert any(not r["complete"] for report in reports for r in report["rounds"])
    assert _digests(reports[0])[0] == _digests(reports[1])[0] == _digests(reports[2])[0]


def test_an_outvoted_peer_repairs_and_rejoins_and_a_peer_ahead_alone_steps_back_at_the_end(
    initial_peers: list[str], tmp_path: Any
) -> None:
    """Round 1: peer 2 registers with another start digest (as after a lost repair), so peers 0 and 1 average
    without it. It waits for their state records of the round and repairs at its end, then averages round 2 with
    them: a peer that read the records at once would see the round before, race into round 2 on its stale theta
    and be outvoted again (after a partition healed, a peer sat out four rounds in a row that way).

    Peer 0 then trains one round more than the others and averages it alone, as a peer that fell a round behind
    does after the others stopped (twice in CI). At the end barrier ``catch_up`` takes it back to the round the
    other two hold: one theta, and its lone round's contribution back in its residual."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=4, run_id="outvoted", end_together=True)
    base = replace(base, linger=6.0)  # the others serve their state while peer 0 steps back
    logs = [tmp_path / f"peer{i}.log" for i in range(3)]
    configs = [replace(base, index=0, num_rounds=5, log_file=str(logs[0]))]
    configs.append(replace(base, index=1, log_file=str(logs[1])))
    configs.append(replace(base, index=2, faults={1: "stale_digest"}, log_file=str(logs[2])))
    reports = run_swarm(configs)
    context = _rounds_summary(reports) + "\n" + _peer_logs(logs)
    sat_out = [r for r in reports[2]["rounds"] if r["round"] == 1]
    assert len(sat_out) == 1 and sat_out[0]["num_peers"] == 0 and sat_out[0]["repaired"], context
    assert [r["num_peers"] for r in reports[0]["rounds"]] == [3, 2, 3, 3, 1], context
    assert all([r["num_peers"] for r in report["rounds"] if 2 <= r["round"] < 4] == [3, 3] for report in reports)
    assert [report["final_round"] for report in reports] == [4, 4, 4], context
    assert _one_theta(reports), context
    assert ledger.conservation_error(reports) < 1e-5, context


def test_topk_counts_every_contribution_once_under_faults(initial_peers: list[str], tmp_path: Any) -> None:
    """The topk exchange over real DHTs under the faults of the test above, on the PULSE gate with 2-bit values and
    a top-64 budget (each owner keeps the top 64 of the aggregate per tile, ``exchange_budget=1``, and requantizes
    it): round 1, peer 1 averages alone; round 3, peer 2 stalls 4 s while fetching; round 4, peer 1's own wait for
    its shard's sum ends empty while the others apply it (its rounding error must still reach its residual, through
    the repair); round 5, peer 0 as an owner cuts one member's fetch streams. Dropped entries, the owners' absorbed
    rounding and the repaired peers' reconciled residuals together still hold every contribution once, and every
    peer ends on one theta."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=7, run_id="once-topk")
    extra = {"pulse_values": "quantized", "pulse_budget": 64, "exchange": "topk", "exchange_budget": 1.0}
    base = replace(base, matchmaking_time=4.0, linger=6.0, extra=extra, end_together=True)
    logs = [tmp_path / f"peer{i}.log" for i in range(3)]
    configs = [
        replace(base, index=0, faults={5: "cut_fetch"}, log_file=str(logs[0])),
        replace(base, index=1, faults={1: "alone", 4: "miss_own"}, log_file=str(logs[1])),
        replace(base, index=2, faults={3: "stall:4"}, log_file=str(logs[2])),
    ]
    reports = run_swarm(configs)
    context = _rounds_summary(reports) + "\n" + _peer_logs(logs)
    assert len({report["final_round"] for report in reports}) == 1, context
    assert reports[0]["final_round"] in (7, 8), context  # 8: one peer's last round alone, see the test above
    assert _one_theta(reports), context
    assert ledger.conservation_error(reports) < 1e-5, context
    assert sum(r["num_reconciled"] for report in reports for r in report["rounds"]) > 0
    # the owners dropped entries in rounds that completed: those went back to their senders
    assert sum(r["num_returned"] for report in reports for r in report["rounds"] if r["complete"]) > 0


def test_overlapped_rounds_count_every_contribution_once_under_faults(initial_peers: list[str], tmp_path: Any) -> None:
    """``RoundConfig.overlap``: each round's exchange runs in the background during the next round's inner steps.
    On three peers (pulse selector, FP32 values) with round 1 a three-way split (each peer alone) and peer 2
    stalled 4 s while fetching in round 3, every peer lands every round one boundary late, ends on one theta, and
    theta with the residuals holds every contribution once."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=6, run_id="once-overlap")
    base = replace(base, matchmaking_time=4.0, linger=6.0, extra={"overlap": True}, end_together=True)
    logs = [tmp_path / f"peer{i}.log" for i in range(3)]
    configs = [
        replace(base, index=0, log_file=str(logs[0])),
        replace(base, index=1, faults={1: "alone"}, log_file=str(logs[1])),
        replace(base, index=2, faults={1: "alone", 3: "stall:4"}, log_file=str(logs[2])),
    ]
    reports = run_swarm(configs)
    context = _rounds_summary(reports) + "\n" + _peer_logs(logs)
    assert all(report["final_round"] >= 6 for report in reports), context  # a repair may move a peer ahead
    assert all(report["rounds"][0]["round"] == 0 for report in reports), context
    assert _split_in_round_1(reports), context
    assert _one_theta(reports), context
    assert ledger.conservation_error(reports) < 1e-5, context
    assert sum(r["num_reconciled"] for report in reports for r in report["rounds"]) > 0


def test_an_overlapped_peer_that_falls_out_of_step_ends_a_phase_early_and_is_counted_again(
    initial_peers: list[str], tmp_path: Any
) -> None:
    """With overlap no boundary waits for the swarm, so a peer whose phases fall behind the others' (here peer 2
    pauses 1.4 s in its third phase: a slow step, a joiner's start) registers after the others' registration
    closed (0.8 s after the first) while they are still exchanging (1 s: a WAN link), and would do so every later
    round and sit out to the end, its entries piling up in its residual (a restarted peer in a 16-peer WAN run).
    It sits out one round, ends its current phase early (``PulseLoCo._realign``) and is in the group again from
    the round after: 3 peers, phases of 6 steps padded to 0.5 s."""
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=6, run_id="realign", target_group_size=None)
    base = replace(base, inner_steps=6, matchmaking_time=0.8, step_seconds=0.5, exchange_delay=1.0, linger=4.0)
    base = replace(base, extra={"overlap": True}, end_together=True)
    logs = [tmp_path / f"peer{i}.log" for i in range(3)]
    configs = [replace(base, index=i, log_file=str(logs[i])) for i in range(2)]
    configs.append(replace(base, index=2, pause=(12, 1.4), log_file=str(logs[2])))
    reports = run_swarm(configs)
    context = _rounds_summary(reports) + "\n" + _peer_logs(logs)
    late = [r["round"] for r in reports[2]["rounds"] if r["num_peers"] == 0]
    assert late == [2], context  # the round it fell out of step in, only
    assert "; this phase ends after" in logs[2].read_text(), context
    assert [r["num_peers"] for r in reports[2]["rounds"] if r["round"] > 2] == [3, 3, 3], context
    assert _one_theta(reports) and ledger.conservation_error(reports) < 1e-5, context


def test_client_mode_peer_averages_without_serving(initial_peers: list[str]) -> None:
    base = PeerConfig(index=0, initial_peers=initial_peers, num_rounds=3, run_id="client")
    configs = [replace(base, index=0), replace(base, index=1), replace(base, index=2, client_mode=True)]
    reports = run_swarm(configs)
    assert all(r["num_peers"] == 3 for report in reports for r in report["rounds"])
    assert _digests(reports[0]) == _digests(reports[1]) == _digests(reports[2])
    # The client pushes its parts and fetches the sums, and serves nothing: it sends less than it receives.
    assert all(r["bytes_sent"] > 0 for r in reports[2]["rounds"])


def test_resume_from_state_dict_continues_the_same_trajectory(initial_peers: list[str], tmp_path: Any) -> None:
    """Two peers: 4 rounds straight vs 2 rounds, state_dict, fresh models from another seed, 2 more rounds.

    Fixed identities keep the peer ids (hence the summation order) the same across the three runs, so the
    resumed trajectory must be bit-identical to the straight one.
    """
    base = PeerConfig(
        index=0,
        initial_peers=initial_peers,
        num_rounds=4,
        run_id="resume-a",
        target_group_size=2,
        inner_lr=1e-4,
        linger=0.5,
        # generous: the check is bit-identity, which needs every round complete with both peers; the defaults
        # (6 s, 3 s) can end a round early on 2 loaded cores (seen once in a full suite run: every digest differed)
        averaging_timeout=30.0,
        request_timeout=10.0,
    )
    peers = [replace(base, index=i, identity_path=str(tmp_path / f"id{i}.key")) for i in range(2)]
    straight = run_swarm(peers)
    first = run_swarm(
        [replace(p, run_id="resume-b", num_rounds=2, state_out=str(tmp_path / f"s{p.index}.pt")) for p in peers]
    )
    second = run_swarm(
        [
            replace(p, run_id="resume-c", num_rounds=2, state_in=str(tmp_path / f"s{p.index}.pt"), model_seed=7)
            for p in peers
        ]
    )
    for i in range(2):
        assert [r["round"] for r in second[i]["rounds"]] == [2, 3]
        rounds = straight[i]["rounds"] + first[i]["rounds"] + second[i]["rounds"]
        shown = [{k: r[k] for k in ("round", "num_peers", "num_contributors", "complete", "repaired")} for r in rounds]
        resumed = {**_digests(first[i]), **_digests(second[i])}
        if resumed != _digests(straight[i]):  # in full, on stdout (an assertion's message is cut short): a flake
            for name, run in (("straight", straight), ("first", first), ("second", second)):
                print(f"{name}:\n{_rounds_summary(run)}\ndigests: {[_digests(report) for report in run]}")
        assert resumed == _digests(straight[i]), shown
        assert torch.equal(ledger.vector(second[i], "theta"), ledger.vector(straight[i], "theta"))
    assert _digests(straight[0]) == _digests(straight[1])
