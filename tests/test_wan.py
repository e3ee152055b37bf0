"""experiments/wan: the userspace link emulator over TUN devices between network namespaces, measured from inside
the namespaces with real UDP and TCP (experiments/wan/probe.py): round-trip time from the peers' delays, a TCP
upload held to the sender's uplink, random loss at its rate, jitter without reordering, and bad flags refused.
Needs root and /dev/net/tun (the skip says so otherwise)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import linkem
import pytest
import wan_net

WAN = Path(__file__).resolve().parents[1] / "experiments" / "wan"
PORT = 9000
LINKS = [
    wan_net.Link(up="20mbit", down="20mbit", delay_ms=10),
    wan_net.Link(up="50mbit", down="50mbit", delay_ms=15),
    wan_net.Link(delay_ms=5, loss=0.1),
    wan_net.Link(delay_ms=10, jitter_ms=4),
]


@pytest.fixture(scope="module")
def net() -> Iterator[Any]:
    reason = wan_net.WanNet.unavailable_reason()
    if reason is not None:
        pytest.skip(f"emulated WAN unavailable: {reason}")
    network = wan_net.WanNet(LINKS)
    try:
        try:
            network.setup()
        except RuntimeError as exc:  # a container without CAP_NET_ADMIN or TUN support, as test_nat.py's setup
            pytest.skip(f"emulated WAN setup failed here: {exc}")
        server = subprocess.Popen(
            network.exec_argv(1, [sys.executable, str(WAN / "probe.py"), "serve", str(PORT)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None and "serving" in server.stdout.readline()
        yield network
        server.kill()
        server.wait(timeout=10)
    finally:
        network.teardown()


def _probe(net: Any, peer: int, *args: str) -> dict[str, Any]:
    argv = [sys.executable, str(WAN / "probe.py"), *args]
    out = subprocess.run(net.exec_argv(peer, argv), capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_round_trips_take_both_peers_delays_and_a_transfer_runs_at_the_senders_uplink(net: Any) -> None:
    """Peer 0 (10 ms, 20 Mbit/s) to peer 1 (15 ms, 50 Mbit/s): 2 (10 + 15) = 50 ms a round trip, never less, and
    the fastest of 20 within a few ms of it (what comes on top is the emulators' and the probes' wake-ups, which a
    loaded machine stretches: experiments/wan/bench_link.py measures them); a 3 s TCP upload at most 20 Mbit/s, and
    most of it after the slow start (IP and TCP headers take 3.5% of 1500-byte packets)."""
    rtts = _probe(net, 0, "rtt", net.host(1), str(PORT), "--count", "20")["rtt_ms"]
    assert len(rtts) == 20 and 50.0 <= min(rtts) < 58.0, rtts
    assert statistics.median(rtts) < 100.0, rtts  # not twice the delay
    upload = _probe(net, 0, "send", net.host(1), str(PORT), "--seconds", "3")
    assert 0.5 * 20 < upload["mbit_s"] <= 20.0, upload


def test_loss_drops_packets_at_its_rate_and_jitter_never_reorders(net: Any) -> None:
    """Peer 2 loses 10% of its packets each way: of 300 datagrams to peer 1, 270 arrive, give or take 4 standard
    deviations. Peer 3's 4 ms of jitter spreads its round trips (2 (10 + 15) = 50 ms, +-8) without reordering:
    every echo comes back as sent, so no round trip is lost."""
    counted = _probe(net, 2, "burst", net.host(1), str(PORT), "--count", "300")
    assert 250 <= counted["received"] <= 290, counted
    rtts = _probe(net, 3, "rtt", net.host(1), str(PORT), "--count", "30")
    assert len(rtts["rtt_ms"]) == 30 and rtts["lost"] == 0
    assert min(rtts["rtt_ms"]) >= 42.0 and max(rtts["rtt_ms"]) - min(rtts["rtt_ms"]) > 1.0, rtts


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--up", "fast"], "bad rate 'fast'"),
        (["--loss", "1.5"], "--loss must be in [0, 1)"),
        (["--delay-ms", "5", "--jitter-ms", "9"], "jitter <= delay"),
    ],
)
def test_bad_link_flags_exit_2_with_the_fix(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        linkem.main(["--peer-ns", "x", "--hub-dev", "t0", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_pulseloco_swarm_over_the_emulated_links_reports_utilization_and_the_round_split(net: Any) -> None:
    """experiments/wan/swarm.py end to end: a bootstrap and three trainers in namespaces behind the mixed profile's
    links (two home connections, 50/10 Mbit/s, and a cloud machine), the third losing 0.5% of its packets, with
    overlapped rounds, real hivemind over the emulated links; every round one group of three on one theta, the
    outer step split into matchmaking, exchange and digest check, and from round 1 on the group goes once the
    expected peers registered (``--close-when-expected``: well under the 20 s matchmaking_time). Its own
    namespaces; ``net`` only skips it where a WAN cannot be built."""
    import swarm

    argv = ["--peers", "3", "--profile", "mixed", "--lossy", "1", "--overlap", "--rounds", "3", "--inner-steps", "3"]
    argv += ["--step-seconds", "0.2", "--width", "128", "--matchmaking-time", "20", "--close-when-expected"]
    argv += ["--timeout", "280"]
    args = swarm.build_parser().parse_args(argv)
    result = swarm.run(args)
    rounds = result["per_round"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["group_sizes"] == [3] and r["digests"] == 1 for r in rounds), rounds
    assert all(r["seconds_matchmaking"] < 10.0 for r in rounds[1:]), rounds
    assert all(r["seconds_exchange"] > 0.0 and r["seconds_digest"] > 0.0 for r in rounds), rounds
    assert all(p["finished"] and 0.0 < p["utilization"] < 1.0 for p in result["per_peer"]), result["per_peer"]
    assert all(p["bytes_sent_per_round"] > 0 and p["bytes_received_per_round"] > 0 for p in result["per_peer"])
    assert [p["link"]["kind"] for p in result["per_peer"]] == ["home", "cloud", "home"]
    assert [p["link"]["loss"] for p in result["per_peer"]] == [0.0, 0.0, 0.005]
    assert all(r["seconds_blocked"] >= 0.0 for r in rounds), rounds
    assert result["final"]["thetas"] == 1 and result["final"]["conservation_error"] < 1e-5, result["final"]
    # the CPU accounting the round simulation is calibrated with (experiments/wan/calibrate.py)
    kinds = result["cpu"]["by_kind"]
    assert kinds["trainer"]["seconds"] > 0 and kinds["p2pd"]["seconds"] > 0 and kinds["emulator"]["seconds"] > 0
    assert kinds["emulator"]["processes"] == 4 and 0 < result["cpu"]["machine_busy_share"] <= 1.0, result["cpu"]
    assert all(0 < p["cpu_inner_s"] < p["cpu_s"] for p in result["per_peer"]), result["per_peer"]


def test_a_route_change_and_a_bootstrap_restart_keep_one_group_and_lose_nothing(net: Any) -> None:
    """experiments/wan/swarm.py with ``--fault``: four trainers (blocking rounds) on 40 ms links; 6 s into training
    trainer 3's round trips jump to 300 ms and the bootstrap node is killed and restarted at its address 1 s later.
    Every round is one group of four on one theta, and the final theta with the residuals holds every contribution
    exactly once (the outside ledger, scripts/harness/ledger.py). Partitions: the next test."""
    import swarm

    argv = ["--peers", "4", "--rtt-ms", "40", "--rate", "0", "--rounds", "8", "--inner-steps", "3"]
    argv += ["--step-seconds", "0.2", "--width", "128", "--matchmaking-time", "3", "--timeout", "280"]
    argv += ["--fault", "rtt@6:3:300", "--fault", "bootstrap@6:1"]
    result = swarm.run(swarm.build_parser().parse_args(argv))
    context = json.dumps({k: result[k] for k in ("per_round", "final", "faults", "log_lines")}, indent=1)
    assert [f["kind"] for f in result["faults"]] == ["rtt", "bootstrap"], context
    assert all("error" not in f and "ended" in f for f in result["faults"]), context
    assert all(r["group_sizes"] == [4] and r["digests"] == 1 for r in result["per_round"][1:]), context
    assert result["final"]["thetas"] == 1 and result["final"]["conservation_error"] < 1e-5, context


def test_churn_a_volunteer_behind_nat_and_followers_lose_nothing_and_leave_no_process(net: Any) -> None:
    """experiments/wan/swarm.py with churn and overlapped rounds (``--overlap``, each exchange during the next inner
    steps; blocking rounds under churn are the soak's, tests/test_soak.py): five trainers on 40 ms links, trainer 0
    a volunteer behind NAT (a private address, SNAT in the hub, nothing new let in) in client mode, reachable
    through a relay slot on the bootstrap node; 4 s into training trainer 2 is SIGKILLed with its DHT and daemon
    (mid-round), trainer 3 joins at 5 s, trainer 2 comes back as a new process at 8 s, and trainer 1 leaves
    (SIGTERM) at 12 s; two PULSESync followers (`pulseloco sync follow`) in namespaces of their own follow trainer
    4's versions. Every joiner's contribution is counted within 2 rounds of joining, the trainers that trained to
    the end hold one theta, the outside ledger (scripts/harness/audit.py, in files a kill does not lose) balances
    for every process, the killed one included, both followers hold every version they printed with the publisher's
    digest and reach the last, and no process is left in the trainers' or the followers' namespaces."""
    import nat_lab  # installs iptables where it is missing, as the NAT tests do
    import swarm

    reason = nat_lab.unavailable_reason()
    if reason is not None:
        pytest.skip(f"NAT needs iptables: {reason}")
    # rounds of about 2.5 s for 40 s: on loaded cores a joiner's process takes some 23 s to join, and with 8 rounds
    # of 0.2 s steps the run had ended by then (CI, once)
    argv = ["--peers", "5", "--rtt-ms", "40", "--rate", "0", "--rounds", "16", "--inner-steps", "3", "--nat", "1"]
    argv += ["--step-seconds", "0.4", "--width", "128", "--matchmaking-time", "3", "--timeout", "280"]
    # short waits: a member killed mid-round costs its group the averaging wait (60 s by default; in one CI run the
    # kill came in round 0's exchange and that round took 64 s)
    argv += ["--averaging-timeout", "8", "--request-timeout", "3"]
    argv += ["--fault", "kill@4:2", "--fault", "join@5:3", "--fault", "restart@8:2", "--fault", "leave@12:1"]
    argv += ["--followers", "2", "--overlap"]
    result = swarm.run(swarm.build_parser().parse_args(argv))
    context = json.dumps({k: result[k] for k in ("per_round", "final", "faults", "joins", "log_lines")}, indent=1)
    assert [f["kind"] for f in result["faults"]] == ["kill", "join", "restart", "leave"], context
    assert all("error" not in f for f in result["faults"]), context
    assert result["final"]["processes"] == ["peer0.0", "peer1.0", "peer2.0", "peer2.1", "peer3.0", "peer4.0"], context
    # the killed process is checked when it had pushed a contribution before the kill (timing: in CI once not)
    assert re.search(r"checked over [56] processes \(0 over 1e-5\)", result["final"]["conservation"]), context
    assert result["final"]["thetas"] == 1 and result["final"]["conservation_error"] < 1e-5, context
    assert sorted(j["name"] for j in result["joins"]) == ["peer2.1", "peer3.0"], context
    assert all(j["rounds_to_contribute"] is not None and j["rounds_to_contribute"] <= 2 for j in result["joins"]), (
        context
    )
    assert result["leaked_processes"] == [], result["leaked_processes"]
    # no round waits out averaging_timeout (60 s): a joiner's owner takes the parts of the round it registered for
    assert all(r["seconds_sync"] < 30.0 for r in result["per_round"]), context
    behind_nat = result["per_peer"][0]
    assert behind_nat["finished"] and behind_nat["bytes_sent_per_round"] > 0, behind_nat
    assert result["per_round"][-1]["group_sizes"] == [4], context  # 0, 2, 3 and 4 after 1 left
    sync = result["sync"]
    assert sync["published"] >= 8 and sync["patch_bytes_mean"] > 0, sync  # one a round, and the final state
    assert all(f["reached_last"] and f["mismatches"] == 0 and f["versions"] >= 2 for f in sync["followers"]), sync


def test_a_partition_that_heals_merges_the_halves_and_loses_nothing(net: Any) -> None:
    """experiments/wan/swarm.py with ``--fault partition``: four trainers on 40 ms links, cut 2 against 2 (the
    bootstrap node with the first half) 10 s into training for 14 s, with short waits (4 s averaging, 2 s requests)
    so that the round the cut catches fails within it and the next ones form during it. The halves average apart
    (groups of 2 on two thetas), and once it heals they meet again (every trainer pings the bootstrap node every 3 s,
    ``SwarmConfig.rejoin_interval``): the half that is behind adopts the other's state, and the last rounds are
    groups of four on one theta with every contribution counted exactly once (the outside ledger; the halves stay
    apart for fewer rounds than the ledger's window, 8: with rounds of 0.2 s steps a 14 s cut kept them apart for 9
    rounds and lost 8% of the contributions, the limit docs/design.md 4.6 names). This checks the merge and the
    ledger, not the pings: with this cut the halves also merged without them (``--rejoin-interval 0``, one run);
    only one 18 s run stayed split to the end without them."""
    import swarm

    argv = ["--peers", "4", "--rtt-ms", "40", "--rate", "0", "--rounds", "16", "--inner-steps", "3"]
    argv += ["--step-seconds", "0.5", "--width", "128", "--matchmaking-time", "3", "--averaging-timeout", "4"]
    argv += ["--request-timeout", "2", "--fault", "partition@10:14", "--rejoin-interval", "3", "--timeout", "280"]
    result = swarm.run(swarm.build_parser().parse_args(argv))
    context = json.dumps({k: result[k] for k in ("per_round", "final", "faults", "log_lines")}, indent=1)
    assert [f["kind"] for f in result["faults"]] == ["partition"] and "error" not in result["faults"][0], context
    # apart: two thetas in some round (groups of 2; or, when the cut lands in a round's exchange and that round
    # outlasts most of it, as in one CI run at 99c41e7, a split round with some peers sitting out)
    assert any(r["digests"] >= 2 for r in result["per_round"]), context
    assert all(r["group_sizes"] == [4] and r["digests"] == 1 for r in result["per_round"][-3:]), context  # merged
    assert result["final"]["thetas"] == 1 and result["final"]["conservation_error"] < 1e-5, context
