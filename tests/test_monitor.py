"""``pulseloco monitor`` against a real swarm: three PULSELoCo peers in their own processes on 127.0.0.1 train six
rounds while the monitor runs as a subprocess (the way an operator runs it) and logs to TensorBoard; the event
files are read back with TensorBoard's own reader and compared with the peers' own metrics files.

The DHT also holds what strangers could write: a state record with a malformed field, one with a malformed
``rounds`` list, one alone far ahead claiming huge bytes; a PULSESync head (a real publisher), rollout worker
records (one malformed) and a refusal."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from loco_helpers import PeerConfig, make_model
from sync_helpers import LineReader, maddrs, popen, start_dht
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_loco_swarm import run_swarm

from pulseloco.cli import main
from pulseloco.jsonl import read_json_lines
from pulseloco.keys import loco_state_key, refused_key, workers_key
from pulseloco.rollouts.protocol import WorkerInfo
from pulseloco.sync.publisher import Publisher
from pulseloco.sync.signing import generate_key

CLI = [sys.executable, "-m", "pulseloco"]
RUN = "monitor-run"
ROUNDS = 5
LAGGING = "12D3KooWLaggingWorkerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
CURRENT = "12D3KooWCurrentWorkerBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
REFUSED = "12D3KooWRefusedWorkerCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"
TRAINER = "12D3KooWTrainerDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDD"
STRANGERS = {
    "12D3KooWBrokenStateEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEE": {"round": "three", "digest": "x", "client": True},
    # a valid record (a peer behind) whose rounds list is not: the record counts, the list is dropped
    "12D3KooWBrokenRoundsFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF": {
        "round": 0,
        "digest": "f" * 16,
        "client": True,
        "rounds": [[1, 2]],
    },
    # alone far ahead with huge bytes: shown as ahead, left out of the round totals
    "12D3KooWFarAheadGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGG": {
        "round": 1000,
        "digest": "a" * 16,
        "client": True,
        "rounds": [[r, 3, 3, 10**9, 10**9] for r in range(990, 1000)],
    },
}


@dataclass
class Observed:
    metrics: list[list[dict[str, Any]]]
    """Each peer's own metrics file (one record per round)."""
    live: dict[str, list[tuple[int, float]]]
    """Series -> [(step, value)] of the monitor that ran along the swarm (stopped by SIGINT)."""
    late: dict[str, list[tuple[int, float]]]
    """The same for a monitor started after the swarm ended (stopped by --duration)."""
    watch: list[str]
    """The live monitor's --watch output."""
    codes: tuple[int | None, int]
    stderr: str
    """Both monitors' stderr."""
    seconds: dict[str, float]


def _series(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    (run_dir,) = [p for p in logdir.iterdir() if p.is_dir()]
    assert run_dir.name == RUN
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _plant_records(dht: Any, tmp: Path) -> Publisher:
    """The strangers' state records, a PULSESync head at v2, two rollout workers (v1: lag 1, v2: lag 0), a malformed
    worker record and a trainer's refusal, all under the run's keys."""
    from hivemind.utils import get_dht_time

    expiration = get_dht_time() + 600
    for peer, record in STRANGERS.items():
        assert dht.store(loco_state_key(RUN), record, expiration_time=expiration, subkey=peer)
    publisher = Publisher(dht, f"{RUN}.policy", generate_key(), tmp / "store")
    state = {"w": torch.zeros(16, 4)}
    publisher.publish(state)
    state["w"][0, 0] = 1.0
    publisher.publish(state)
    assert publisher.flush(timeout=30) is not None
    sync = f"{RUN}.policy"
    for peer, version in ((LAGGING, 1), (CURRENT, 2)):
        info = WorkerInfo("transformers", version, 100.0, 2.0, 1, 5, 64)
        assert dht.store(workers_key(sync), info.to_record(), expiration_time=expiration, subkey=peer)
    assert dht.store(workers_key(sync), {"engine": 3}, expiration_time=expiration, subkey="12D3KooWMalformedWorker")
    assert dht.store(refused_key(sync), {REFUSED: "failed the check"}, expiration_time=expiration, subkey=TRAINER)
    return publisher


def _monitor(initial: str, logdir: Path, *extra: str) -> list[str]:
    """The monitor's command line, with the trackers' flags spelt as the recipes spell them."""
    base = [*CLI, "monitor", "--initial-peers", initial, "--run-id", RUN]
    return [*base, "--report_to", "tensorboard", "--logging_dir", str(logdir), *extra]


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("monitor")
    make_model(0)  # import the model code once here, not in every forked peer
    bootstrap = start_dht()
    publisher = None
    seconds: dict[str, float] = {}
    try:
        initial = maddrs(bootstrap)
        publisher = _plant_records(bootstrap, tmp)
        started = time.monotonic()
        live_cmd = _monitor(initial[0], tmp / "live", "--interval", "1", "--watch")
        with (tmp / "live.err").open("w") as err, popen(live_cmd, stderr=err) as proc:
            reader = LineReader(proc)
            reader.wait_for(r"^pulseloco monitor  run 'monitor-run'  poll 1 ", timeout=60)
            seconds["live monitor start"] = time.monotonic() - started
            configs = [
                PeerConfig(
                    index=i,
                    initial_peers=initial,
                    num_rounds=ROUNDS,
                    run_id=RUN,
                    extra={"metrics_path": str(tmp / f"peer{i}.jsonl")},
                )
                for i in range(3)
            ]
            run_swarm(configs)  # returns once the peers have exited
            seconds["swarm"] = time.monotonic() - started - seconds["live monitor start"]
            started = time.monotonic()
            # a monitor started after the swarm ended, stopped by --duration (it starts while the live one ends)
            late_cmd = _monitor(initial[0], tmp / "late", "--interval", "1", "--duration", "1")
            late = subprocess.Popen(late_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            polls = len([line for line in reader.lines if line.startswith("pulseloco monitor")])
            reader.wait_for(r"^pulseloco monitor", timeout=20, start=len(reader.lines))  # a poll after the end
            assert polls >= 2
            proc.send_signal(signal.SIGINT)
            live_code = proc.wait(30)
            reader.join()
        _, late_err = late.communicate(timeout=90)
        seconds["late monitor"] = time.monotonic() - started
        stderr = (tmp / "live.err").read_text() + late_err
        yield Observed(
            metrics=[read_json_lines(tmp / f"peer{i}.jsonl") for i in range(3)],
            live=_series(tmp / "live"),
            late=_series(tmp / "late"),
            watch=reader.lines,
            codes=(live_code, late.returncode),
            stderr=stderr,
            seconds=seconds,
        )
    finally:
        if publisher is not None:
            publisher.close()
        bootstrap.shutdown()


def test_monitor_logs_each_round_summed_over_the_swarm(observed: Observed) -> None:
    """Contributors equal the three live peers; bytes per round equal the sum of the peers' own metrics; the
    strangers' records (malformed, or alone far ahead with huge bytes) change no round total."""
    print("timings (s):", {k: round(v, 1) for k, v in observed.seconds.items()})
    assert observed.codes == (0, 0), observed.stderr
    assert "Traceback" not in observed.stderr
    for series in (observed.live, observed.late):
        assert [step for step, _ in series["round/index"]] == [r + 1 for r in range(ROUNDS)]
        assert [value for _, value in series["round/index"]] == list(range(ROUNDS))
        for name, key in (("round/bytes_sent", "bytes_sent"), ("round/bytes_received", "bytes_received")):
            expected = [sum(peer[r][key] for peer in observed.metrics) for r in range(ROUNDS)]
            assert [value for _, value in series[name]] == expected, name
            per_peer = [value for _, value in series[f"{name}_per_peer"]]  # float32 in the event files
            assert per_peer == pytest.approx([total / 3 for total in expected], rel=1e-6), name
        assert all(value == 3 for _, value in series["round/contributors"])
        assert all(value == 3 for _, value in series["round/group_size"])
        assert all(value == 3 for _, value in series["round/reports"])
        assert all(value == 0 for _, value in series["round/sat_out"])
    assert all(peer[r]["num_contributors"] == 3 for peer in observed.metrics for r in range(ROUNDS))


def test_monitor_logs_the_swarm_state_once_per_swarm_round(observed: Observed) -> None:
    """The live monitor saw the round increase; its last point (written when SIGINT stopped it) shows the swarm at
    round 6 with the three peers agreeing, the strangers' records counted where they belong, the PULSESync head
    and the workers' lag."""
    rounds = observed.live["swarm/round"]
    steps = [step for step, _ in rounds]
    # at least one point before the end (a poll can take longer than a round on a loaded machine, so not one each)
    assert len(steps) >= 2 and steps == sorted(set(steps)) and steps[-1] == ROUNDS
    assert all(step == value for step, value in rounds)
    last = {name: values[-1] for name, values in observed.live.items() if name.split("/")[0] != "round"}
    assert all(step == ROUNDS for step, _ in last.values())
    value = {name: v for name, (_, v) in last.items()}
    assert value["swarm/peers"] == 5  # three trainers, the stranger behind, the stranger ahead
    assert (value["swarm/agree"], value["swarm/behind"], value["swarm/ahead"], value["swarm/disagree"]) == (3, 1, 1, 0)
    assert value["swarm/newest_round"] == 1000 and value["swarm/malformed_records"] == 2
    assert value["sync/head_version"] == 2 and value["sync/providers"] == 1
    assert value["workers/count"] == 2 and value["workers/max_lag"] == 1 and value["workers/malformed"] == 1
    assert value[f"worker_lag/{LAGGING}"] == 1 and value[f"worker_lag/{CURRENT}"] == 0
    assert value["workers/refused"] == 1
    # the late monitor (--duration) logged the swarm as it found it, once
    assert observed.late["swarm/round"] == [(ROUNDS, ROUNDS)]
    # the live monitor's first poll found only the strangers: the one far ahead made the swarm round 1000 (a tie
    # goes to the newer round), but its rounds were never complete, so nothing was logged for it; when the
    # trainers published, the series restarted from the round they were at (0, or later on a loaded machine where
    # a poll takes longer than a round). If the first poll's DHT reads came back without the stranger ahead, the
    # swarm round never was 1000 and nothing restarts.
    first_poll = "\n".join(observed.watch).split("pulseloco monitor  run", 2)[1]
    saw_the_stranger_ahead_alone = "  round 1000  " in first_poll
    restarts = len(re.findall(r"the swarm round went back from 1000 to \d+", observed.stderr))
    assert restarts == (1 if saw_the_stranger_ahead_alone else 0), (first_poll, observed.stderr[-2000:])


def test_watch_view(observed: Observed) -> None:
    """--watch prints one compact block per poll (plain text when stdout is not a terminal)."""
    text = "\n".join(observed.watch)
    print(text[-1500:])
    assert "\x1b" not in text
    last = text.rsplit("pulseloco monitor  run", 1)[1].splitlines()
    assert last[1] == f"PULSELoCo: 5 peer(s)  round {ROUNDS}  agree 3  ahead 1  behind 1  disagree 0  disputed 0"
    assert last[2] == "  malformed: 1 record(s), 1 round list(s)"
    assert last[3].split() == ["ROUND", "GROUP", "REPORTS", "CONTRIBUTORS", "SENT", "RECEIVED"]
    assert last[4].split()[:4] == [str(ROUNDS - 1), "3", "3", "3"]
    assert "PULSESync: head v2  1 provider(s)  2 worker(s)" in last
    assert any("lag   1" in line for line in last) and any("refused:" in line for line in last)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["monitor"], "--initial-peers is required"),
        (["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--interval", "0"], "must be positive"),
        (["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--duration", "-5"], "must be positive"),
        (["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run-id", "a b"], "--run-id must be 1-100"),
        (
            ["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--report-to", "tensorbored"],
            "--report-to 'tensorbored' is not a tracker accelerate knows (choose from: none, aim,",
        ),
        (
            ["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--report-to", "aim"],
            "--report-to aim: its library is not installed (pip install aim)",
        ),
        (
            ["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--report-to", "none", "tensorboard"],
            "--report-to none means no tracker: give it alone",
        ),
        (["monitor", "--initial-peers", "not-a-multiaddr"], "initial_peers: 'not-a-multiaddr' is not a multiaddr"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("pulseloco: error: ") and message in line
    assert captured.out == ""


def test_bad_option_value_is_argparse_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--interval", "soon"]) == 2
    assert "argument --interval: invalid float value: 'soon'" in capsys.readouterr().err


def test_state_records_old_and_new_and_malformed() -> None:
    """Records without ``rounds`` (older peers) read as before; later elements of a round entry are ignored (room
    to grow); a malformed ``rounds`` list is dropped alone; a malformed record is skipped."""
    from pulseloco.loco.peers import RoundRecord, parse_state

    old = {"round": 3, "digest": "d" * 32, "client": False, "complete": True, "disputed": []}
    state, dropped = parse_state("peer", old) or (None, None)
    assert state is not None and state.rounds == () and not dropped
    newer = {**old, "rounds": [[1, 3, 3, 10, 20, 99], [2, 3, 2, 11, 21]]}
    state, dropped = parse_state("peer", newer) or (None, None)
    assert state is not None and state.rounds == (RoundRecord(1, 3, 3, 10, 20), RoundRecord(2, 3, 2, 11, 21))
    for rounds in ([[3, 3, 3, 1, 1]], [[2, 3, 3, 1, 1], [1, 3, 3, 1, 1]], [[1, 3, 3, -1, 1]], [[1, True, 3, 1, 1]]):
        state, dropped = parse_state("peer", {**old, "rounds": rounds}) or (None, None)
        assert state is not None and state.rounds == () and dropped, rounds
    assert parse_state("peer", {**old, "rounds": [[0, 1, 1, 1, 1]] * 17}) == (state, True)
    for peer, record in (
        ("pe\x1b[2Jer", old),
        ("peer", {**old, "round": True}),
        ("peer", {**old, "digest": "x" * 200}),
    ):
        assert parse_state(peer, record) is None


def _report(peers: list[tuple[str, int, list[tuple[int, int, int, int, int]]]]) -> Any:
    """A :class:`SwarmStatus` of peers ``(peer id, round, [round record])`` classified by the status rule."""
    from pulseloco.cli.status import SwarmStatus, classify_peers
    from pulseloco.loco.peers import PeerState, RoundRecord

    states = [PeerState(p, r, "d", False, True, (), tuple(RoundRecord(*e) for e in rs)) for p, r, rs in peers]
    reference, majority, reports = classify_peers(states)
    return SwarmStatus("r", loco_state_key("r"), reports, reference, majority)


class _Collect:
    """A tracker that keeps what it is given (the series' order and steps are what this test checks)."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log(self, values: dict[str, float], step: int) -> None:
        self.logged.append((step, values))

    def close(self) -> None:
        pass


def test_a_peer_one_round_ahead_at_every_poll_still_counts_for_the_rounds_the_swarm_completed() -> None:
    """Fast rounds: c finishes each round first, so every poll finds it one round ahead of the swarm (a and b).
    Its records of the rounds the swarm completed count: every round is logged with all three reports and bytes
    (it was once left out, and rounds settled without it: a flaky end-to-end test); its record of the round the
    swarm has not completed does not, until the swarm completes it."""
    from pulseloco.cli.monitor import SwarmMonitor

    monitor = SwarmMonitor(_Collect())
    e = lambda r: (r, 3, 3, 100 * (r + 1), 50)  # noqa: E731
    for reached in range(1, 6):
        mine = [e(r) for r in range(reached)]
        monitor.observe(_report([("a", reached, mine), ("b", reached, mine), ("c", reached + 1, [*mine, e(reached)])]))
        assert [t.round for t in monitor.recent] == list(range(reached))  # never the round only c completed
    monitor.close()
    assert [(t.round, t.reports, t.bytes_sent) for t in monitor.recent] == [(r, 3, 300 * (r + 1)) for r in range(5)]


def test_round_released_when_complete_or_settled_and_steps_never_go_back() -> None:
    """A round all members reported is logged at once; a round a dead member never reported is logged once the
    swarm completed two more; steps only increase; a swarm round that goes back restarts the series."""
    from pulseloco.cli.monitor import SwarmMonitor

    tracker = _Collect()
    monitor = SwarmMonitor(tracker)
    e = lambda r, n=3: (r, n, n, 100 * (r + 1), 50)  # noqa: E731
    monitor.observe(_report([("a", 1, [e(0)]), ("b", 1, [e(0)]), ("c", 1, [e(0)])]))
    assert [t.round for t in monitor.recent] == [0]
    # c dies in round 1: rounds 1 to 3 have a group of 3 (c was registered) and only a and b report them
    for reached in (2, 3, 4):
        rounds = [e(0), *(e(r) for r in range(1, reached))]
        monitor.observe(_report([("a", reached, rounds), ("b", reached, rounds), ("c", 1, [e(0)])]))
    assert [t.round for t in monitor.recent] == [0, 1]  # round 1 once the swarm completed rounds 2 and 3
    # round 4 (a group of two) is complete at once: rounds 2 and 3, still waiting for c, are logged with it
    rounds = [e(0), e(1), e(2), e(3), e(4, 2)]
    monitor.observe(_report([("a", 5, rounds), ("b", 5, rounds), ("c", 1, [e(0)])]))
    assert [(t.round, t.reports, t.group_size, t.bytes_sent) for t in monitor.recent] == [
        (0, 3, 3, 300),
        (1, 2, 3, 400),
        (2, 2, 3, 600),
        (3, 2, 3, 800),
        (4, 2, 2, 1000),
    ]
    monitor.close()
    steps = [step for step, _ in tracker.logged]
    assert steps == sorted(steps)
    assert [(s, v["round/index"]) for s, v in tracker.logged if "round/index" in v] == [(r + 1, r) for r in range(5)]
    assert [(s, v["swarm/round"]) for s, v in tracker.logged if "swarm/round" in v] == [(r, r) for r in range(1, 6)]
    # a new run under the same run id: the series starts again from its round
    monitor = SwarmMonitor(tracker := _Collect())
    monitor.observe(_report([("a", 9, [e(8)]), ("b", 9, [e(8)]), ("c", 9, [e(8)])]))
    monitor.observe(_report([("a", 1, [e(0)]), ("b", 1, [e(0)]), ("c", 1, [e(0)])]))
    monitor.close()
    assert [(s, "round/index" in v) for s, v in tracker.logged] == [(9, True), (1, True), (1, False)]


def test_round_values_have_the_bytes_per_peer_of_the_peers_that_averaged() -> None:
    """Per peer: the round's totals over the peers that averaged in it and reported it (a peer that sat it out
    counts in neither); a round every reporting peer sat out has no per-peer series."""
    from pulseloco.cli.monitor import RoundTotals, SwarmMonitor, round_values

    tracker = _Collect()
    monitor = SwarmMonitor(tracker)
    a, b, c = (0, 2, 2, 100, 40), (0, 2, 2, 300, 80), (0, 0, 0, 0, 0)  # c sat round 0 out
    monitor.observe(_report([("a", 1, [a]), ("b", 1, [b]), ("c", 1, [c])]))
    monitor.close()
    (values,) = [v for _, v in tracker.logged if "round/index" in v]
    assert (values["round/bytes_sent"], values["round/bytes_received"], values["round/reports"]) == (400, 120, 2)
    assert values["round/bytes_sent_per_peer"] == 200 and values["round/bytes_received_per_peer"] == 60
    assert values["round/sat_out"] == 1
    nobody = round_values(RoundTotals(3, 0, 0, 0, 0, 0, 2))
    assert "round/bytes_sent_per_peer" not in nobody and "round/bytes_received_per_peer" not in nobody
    assert nobody["round/sat_out"] == 2
