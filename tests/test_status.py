"""``pulseloco status`` against a real swarm: hivemind DHTs on 127.0.0.1 holding real PULSELoCo state records
(written by :class:`Matchmaker` from three peers, one in client mode), a real PULSESync publisher's head and
providers records, and rollout worker records stored the way :class:`RolloutServer` announces them (good ones and
malformed ones); the command runs as a subprocess, the way an operator runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from sync_helpers import maddrs, start_dht, wait_for

from pulseloco.cli import main
from pulseloco.cli.status import (
    RefusalReport,
    SwarmStatus,
    WorkerReport,
    classify_peers,
    collect_status,
    render_text,
    to_json,
)
from pulseloco.keys import refused_key, workers_key
from pulseloco.loco.matchmaking import Matchmaker
from pulseloco.loco.peers import PeerState
from pulseloco.rollouts.protocol import WorkerInfo
from pulseloco.sync.publisher import Publisher
from pulseloco.sync.signing import generate_key, load_public_key, save_keypair
from pulseloco.sync.transport import SwarmEndpoint

CLI = [sys.executable, "-m", "pulseloco"]
AGREE_RUN = "status-agree"
SPLIT_RUN = "status-split"
WORKERS_ONLY_RUN = "status-workers-only"
"""A run with rollout worker records but no PULSELoCo, head or provider record."""
GOOD_WORKER = "12D3KooWGoodWorkerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
FRESH_WORKER = "12D3KooWFreshWorkerBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
BAD_WORKER = "12D3KooWBadWorkerCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"
ESCAPE_WORKER = "12D3KooWEscapeWorkerDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDD"
TRAINER = "12D3KooWTrainerFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF"
REFUSED_WORKER = "12D3KooWRefusedWorkerGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGG"
GOOD_INFO = WorkerInfo("transformers", 1, 123.4, 5.5, 2, 17, 64)
"""Serves v1 while the head is v2: lag 1."""
FRESH_INFO = WorkerInfo("vllm", -1, 0.0, 0.0, 0, 0, 128)
"""Holds no version yet: no lag."""


@dataclass
class Swarm:
    bootstrap: Any
    peers: dict[str, str]
    """name -> peer id of the DHTs that wrote state records."""
    publisher_id: str
    ghost_id: str
    """A provider record of a peer that does not exist (must be reported unreachable)."""
    public_key: Path
    other_key: Path
    initial_peer: str


def _write_states(dht: Any, client_mode: bool, records: dict[str, tuple[int, str]]) -> str:
    """Publish ``run -> (round, digest)`` records from ``dht``'s peer id; returns that id."""
    peer_id = str(dht.peer_id)
    for run, (round_index, digest) in records.items():
        mm = Matchmaker(
            dht,
            run_id=run,
            peer_id=peer_id,
            client_mode=client_mode,
            matchmaking_time=0.0,
            target_group_size=None,
            request_timeout=10.0,
        )
        mm.publish_state(round_index, digest)
    return peer_id


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """Three trainers' state records (AGREE_RUN: A and B at round 5 with one digest, C behind at round 3;
    SPLIT_RUN: all at round 7, C with another digest) and a publisher of ``AGREE_RUN.policy`` on A's DHT."""
    tmp = tmp_path_factory.mktemp("status")
    bootstrap = start_dht()
    initial = maddrs(bootstrap)
    dht_a = start_dht(initial)
    dht_b = hivemind.DHT(start=True, initial_peers=initial, client_mode=True, startup_timeout=30)
    dht_c = start_dht(initial)
    publisher = None
    try:
        peers = {
            "A": _write_states(dht_a, False, {AGREE_RUN: (5, "d" * 16), SPLIT_RUN: (7, "a" * 16)}),
            "B": _write_states(dht_b, True, {AGREE_RUN: (5, "d" * 16), SPLIT_RUN: (7, "a" * 16)}),
            "C": _write_states(dht_c, False, {AGREE_RUN: (3, "c" * 16), SPLIT_RUN: (7, "b" * 16)}),
        }
        key = generate_key()
        _, public_key = save_keypair(key, tmp / "keys" / "publisher")
        _, other_key = save_keypair(generate_key(), tmp / "keys" / "other")
        publisher = Publisher(dht_a, f"{AGREE_RUN}.policy", key, tmp / "store")
        torch.manual_seed(0)
        state = {"w": torch.randn(32, 8), "b": torch.randn(8)}
        publisher.publish(state)
        state["w"][0, 0] += 1.0
        publisher.publish(state)
        assert publisher.flush(timeout=30) is not None
        # a provider record for a peer id nobody runs: the probe must call it unreachable, not hang
        P2P.generate_identity(str(tmp / "ghost.id"))
        ghost_id = PeerID.from_identity((tmp / "ghost.id").read_bytes()).to_base58()
        dht_c.store(
            f"pulseloco:{AGREE_RUN}.policy:providers",
            {"versions": [1], "publisher": False},
            expiration_time=get_dht_time() + 600,
            subkey=ghost_id,
        )
        reader = SwarmEndpoint(bootstrap, f"{AGREE_RUN}.policy")
        try:
            wait_for(lambda: len(reader.get_providers(timeout=5.0)) == 2, 20, "two provider records")
        finally:
            reader.close()
        # rollout workers as RolloutServer.announce stores them, plus what a stranger could store there
        worker_records = {
            GOOD_WORKER: GOOD_INFO.to_record(),
            FRESH_WORKER: FRESH_INFO.to_record(),
            BAD_WORKER: {"engine": "vllm", "version": "2", "queue": 0},  # malformed: skipped
            ESCAPE_WORKER: {**GOOD_INFO.to_record(), "engine": "vllm\x1b[2J"},  # terminal escapes: skipped
        }
        for subkey, record in worker_records.items():
            assert dht_c.store(
                workers_key(f"{AGREE_RUN}.policy"), record, expiration_time=get_dht_time() + 600, subkey=subkey
            )
        assert dht_c.store(
            workers_key(f"{WORKERS_ONLY_RUN}.policy"),
            GOOD_INFO.to_record(),
            expiration_time=get_dht_time() + 600,
            subkey=GOOD_WORKER,
        )

        def _workers_stored() -> bool:
            found = bootstrap.get(workers_key(f"{AGREE_RUN}.policy"), latest=True)
            return found is not None and isinstance(found.value, dict) and len(found.value) == len(worker_records)

        wait_for(_workers_stored, 20, "four worker records")
        # refusals as RolloutClient.refuse stores them (one record per trainer), and a stranger's malformed one
        refusals = {
            TRAINER: {REFUSED_WORKER: "tokens are not the replayable sampler's choice\x1b[2J"},
            "12D3KooWStrangerTrainerEEEEEEEEEEEEEEEEEEEEEEEEEEEE": {"x" * 200: 7},  # malformed: skipped
        }
        for subkey, record in refusals.items():
            assert dht_c.store(
                refused_key(f"{AGREE_RUN}.policy"), record, expiration_time=get_dht_time() + 600, subkey=subkey
            )
        wait_for(
            lambda: len(getattr(bootstrap.get(refused_key(f"{AGREE_RUN}.policy"), latest=True), "value", {})) == 2,
            20,
            "two refusal records",
        )
        yield Swarm(
            bootstrap, peers, publisher.endpoint.peer_id.to_base58(), ghost_id, public_key, other_key, initial[0]
        )
    finally:
        if publisher is not None:
            publisher.close()
        for dht in (dht_a, dht_b, dht_c, bootstrap):
            dht.shutdown()


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "status", *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False
    )


def test_agreeing_run_prints_peers_head_and_providers(swarm: Swarm) -> None:
    result = _status(
        "--initial-peers", swarm.initial_peer, "--run-id", AGREE_RUN, "--public-key", str(swarm.public_key)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"PULSELoCo run '{AGREE_RUN}': 3 peer(s); reference round 5" in out
    lines = {name: next(line for line in out.splitlines() if pid in line) for name, pid in swarm.peers.items()}
    assert "server" in lines["A"] and "agree" in lines["A"] and "d" * 16 in lines["A"]
    assert "client" in lines["B"] and "agree" in lines["B"]
    assert "behind (2 rounds)" in lines["C"]
    assert f"PULSESync run '{AGREE_RUN}.policy': head v2" in out and "(signature verified)" in out
    assert "providers: 2, 1 reachable" in out
    providers = out.split("providers: ", 1)[1].splitlines()
    publisher_line = next(line for line in providers if swarm.publisher_id in line)
    assert "publisher" in publisher_line and "reachable" in publisher_line and "UNREACHABLE" not in publisher_line
    ghost_line = next(line for line in providers if swarm.ghost_id in line)
    assert "relay" in ghost_line and "UNREACHABLE" in ghost_line
    workers_key_text = repr(workers_key(f"{AGREE_RUN}.policy"))
    assert f"rollout workers: 2 under DHT key {workers_key_text}, 2 malformed record(s) skipped" in out
    good_line = next(line for line in out.splitlines() if GOOD_WORKER in line)
    assert good_line.split() == [GOOD_WORKER, "transformers", "v1", "1", "123.4", "5.50", "2", "17"]
    fresh_line = next(line for line in out.splitlines() if FRESH_WORKER in line)
    assert fresh_line.split() == [FRESH_WORKER, "vllm", "none", "-", "0.0", "0.00", "0", "0"]
    assert BAD_WORKER not in out and ESCAPE_WORKER not in out and "\x1b" not in out
    assert out.strip().splitlines()[-1] == "verdict: digests agree at round 5"
    assert "Traceback" not in result.stderr


def test_disagreeing_run_exits_1_and_json_names_the_peer(swarm: Swarm) -> None:
    result = _status(
        "--initial-peers",
        swarm.initial_peer,
        "--run-id",
        SPLIT_RUN,
        "--sync-run-id",
        f"{AGREE_RUN}.policy",
        "--public-key",
        str(swarm.other_key),
        "--probe-timeout",
        "0",
        "--json",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["exit_code"] == 1 and report["agree"] is False
    assert report["run_id"] == SPLIT_RUN and report["state_key"] == f"pulseloco:{SPLIT_RUN}:loco:state"
    assert (report["reference_round"], report["majority_digest"]) == (7, "a" * 16)
    by_id = {p["peer_id"]: p for p in report["peers"]}
    assert by_id[swarm.peers["C"]]["status"] == "disagree"
    assert by_id[swarm.peers["A"]]["status"] == by_id[swarm.peers["B"]]["status"] == "agree"
    assert by_id[swarm.peers["B"]]["client_mode"] is True
    # the head signed by another key: shown, flagged as failing verification
    head = report["head"]
    assert head["verified"] is False and "not signed by the trusted publisher key" in head["error"]
    assert head["version"] == 2
    assert report["probe_timeout"] is None
    assert all(p["reachable"] is None for p in report["providers"])
    # the rollout workers of that run: the lag is against the head shown (v2), malformed records left out
    assert report["workers_key"] == workers_key(f"{AGREE_RUN}.policy") and report["malformed_workers"] == 2
    assert report["workers"] == [
        {"peer_id": GOOD_WORKER, "lag": 1, **GOOD_INFO.to_record()},
        {"peer_id": FRESH_WORKER, "lag": None, **FRESH_INFO.to_record()},
    ]


def test_bad_multiaddr_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    result = _status("--initial-peers", "not-a-multiaddr")
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("pulseloco: error: initial_peers: 'not-a-multiaddr' is not a multiaddr")

    # the same checks in-process (no interpreter start): no peers, a bad timeout, a missing key file
    assert main(["status"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pulseloco: error: --initial-peers is required: the multiaddr of any peer of the swarm"
    )
    assert main(["status", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--timeout", "0"]) == 2
    assert "--timeout must be positive" in capsys.readouterr().err
    assert main(["status", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--public-key", "/nonexistent.pub"]) == 2
    assert capsys.readouterr().err.strip().startswith("pulseloco: error: cannot read public key /nonexistent.pub")
    # a well-formed multiaddr where nobody listens: cannot join
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQExPF3kRExde9XtuPjVdFsB1Qhkiy47K2pxaGQ9JWwVW"
    assert main(["status", "--initial-peers", nobody]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pulseloco: error: could not join the swarm")


def test_collect_status_in_process_for_scripts(swarm: Swarm) -> None:
    """The soak calls :func:`collect_status` with a DHT of its own; the DHT stays up."""
    report = collect_status(swarm.bootstrap, SPLIT_RUN, sync_run_id="none.policy", probe_timeout=None)
    assert [p.peer_id for p in report.disagreeing] == [swarm.peers["C"]]
    assert report.exit_code == 1 and report.sync_run_id is None and report.head is None
    assert "DIGESTS DISAGREE: 1 of 3 peer(s)" in render_text(report)
    assert swarm.bootstrap.is_alive()

    # no records: the text names the keys it looked up
    report = collect_status(swarm.bootstrap, "nobody-runs-this", probe_timeout=None)
    assert (
        report.exit_code == 0
        and report.peers == []
        and report.sync_run_ids
        == [
            "nobody-runs-this.policy",
            "nobody-runs-this",
        ]
    )
    text = render_text(report)
    assert "no state records under DHT key 'pulseloco:nobody-runs-this:loco:state'" in text
    assert "no head or provider records for run id(s) 'nobody-runs-this.policy', 'nobody-runs-this'" in text
    assert report.workers == [] and report.workers_key is None and report.malformed_workers == 0
    assert (
        "rollout workers: none announced under DHT key(s) 'pulseloco:nobody-runs-this.policy:rollout_workers', "
        "'pulseloco:nobody-runs-this:rollout_workers'"
    ) in text
    assert "verdict: nothing to compare" in text


def test_collect_status_lists_rollout_workers_with_their_lag(swarm: Swarm) -> None:
    """Worker records are read from the PULSESync run found, lagged against its head, malformed ones skipped; the
    workers never change the exit code."""
    report = collect_status(swarm.bootstrap, AGREE_RUN, public_key=load_public_key(swarm.public_key))
    assert report.sync_run_id == f"{AGREE_RUN}.policy" and report.head is not None and report.head.version == 2
    assert report.workers == [
        WorkerReport(GOOD_WORKER, "transformers", 1, 1, 123.4, 5.5, 2, 17, 64),
        WorkerReport(FRESH_WORKER, "vllm", -1, None, 0.0, 0.0, 0, 0, 128),
    ]
    assert report.workers_key == workers_key(f"{AGREE_RUN}.policy") and report.malformed_workers == 2
    assert report.exit_code == 0
    text = render_text(report)
    assert "2 malformed record(s) skipped" in text and BAD_WORKER not in text and ESCAPE_WORKER not in text
    header = next(line for line in text.splitlines() if "TOKENS/S" in line)
    assert header.split() == ["PEER", "ENGINE", "VERSION", "LAG", "TOKENS/S", "SAMPLES/S", "QUEUE", "SERVED"]
    as_json = json.loads(to_json(report))
    assert [(w["peer_id"], w["version"], w["lag"]) for w in as_json["workers"]] == [
        (GOOD_WORKER, 1, 1),
        (FRESH_WORKER, -1, None),
    ]
    assert as_json["malformed_workers"] == 2
    # the workers a trainer refused, with its reason (terminal escapes replaced), a malformed record skipped
    reason = "tokens are not the replayable sampler's choice?[2J"
    assert report.refused == [RefusalReport(REFUSED_WORKER, TRAINER, reason)]
    assert "refused rollout workers: 1 (their completions failed a trainer's checks)" in text
    assert f"  {REFUSED_WORKER} by trainer {TRAINER}: {reason}" in text.splitlines()
    assert as_json["refused"] == [{"worker": REFUSED_WORKER, "trainer": TRAINER, "reason": reason}]

    # workers but no head (publisher gone, or not started): listed from the run ids looked up, no lag
    report = collect_status(swarm.bootstrap, WORKERS_ONLY_RUN, probe_timeout=None)
    assert report.sync_run_id is None and report.head is None
    assert report.workers == [WorkerReport(GOOD_WORKER, "transformers", 1, None, 123.4, 5.5, 2, 17, 64)]
    assert report.workers_key == workers_key(f"{WORKERS_ONLY_RUN}.policy") and report.malformed_workers == 0
    text = render_text(report)
    assert "no head or provider records" in text and "malformed" not in text
    assert next(line for line in text.splitlines() if GOOD_WORKER in line).split()[2:4] == ["v1", "-"]


def test_render_text_of_workers_without_a_dht() -> None:
    """The table's columns and the lag rule on a hand-made report (no network)."""
    report = SwarmStatus(
        run_id="r",
        state_key="pulseloco:r:loco:state",
        sync_run_ids=["r.policy", "r"],
        workers=[WorkerReport("peer-a", "vllm", 7, 3, 2048.0, 12.25, 4, 99, 256)],
        workers_key="pulseloco:r.policy:rollout_workers",
        malformed_workers=1,
    )
    text = render_text(report)
    assert (
        "rollout workers: 1 under DHT key 'pulseloco:r.policy:rollout_workers', 1 malformed record(s) skipped" in text
    )
    line = next(line for line in text.splitlines() if "peer-a" in line)
    assert line.split() == ["peer-a", "vllm", "v7", "3", "2048.0", "12.25", "4", "99"]
    assert report.to_dict()["workers"][0]["max_new_tokens"] == 256


def test_agreement_rule() -> None:
    """The reference round is the most common; peers ahead are compared within their round, peers behind never."""

    def st(peer: str, round_index: int, digest: str, complete: bool = True) -> PeerState:
        return PeerState(peer, round_index, digest, False, complete)

    # one fast peer ahead, a crashed peer's old split record behind: nothing disagrees
    ref, majority, reports = classify_peers(
        [st("a", 10, "x"), st("b", 10, "x"), st("c", 11, "y"), st("d", 4, "p"), st("e", 4, "q")]
    )
    assert (ref, majority) == (10, "x")
    assert {r.peer_id: r.status for r in reports} == {
        "c": "ahead",
        "a": "agree",
        "b": "agree",
        "d": "behind",
        "e": "behind",
    }
    assert [r.peer_id for r in reports] == ["c", "a", "b", "d", "e"]
    # a tie between rounds goes to the newer round; two peers ahead that differ disagree
    ref, _, reports = classify_peers([st("a", 3, "x"), st("b", 4, "y"), st("c", 5, "z"), st("d", 5, "w")])
    assert ref == 5
    assert {r.peer_id: r.status for r in reports} == {"c": "disagree", "d": "agree", "a": "behind", "b": "behind"}
    # a partial round does not outvote complete ones
    _, majority, reports = classify_peers([st("a", 2, "x", complete=False), st("b", 2, "y")])
    assert majority == "y" and {r.peer_id: r.status for r in reports} == {"a": "disagree", "b": "agree"}
    assert classify_peers([]) == (None, None, [])
    # a disputed peer neither votes nor counts against the exit code; a tie goes to a digest a server holds
    poisoned = PeerState("m", 6, "a", False, True)
    accuser = PeerState("h", 6, "z", False, False, ("m",))
    _, majority, reports = classify_peers([poisoned, accuser, st("b", 6, "z", complete=False)])
    assert majority == "z" and {r.peer_id: r.status for r in reports} == {"m": "disputed", "h": "agree", "b": "agree"}
    client_only = PeerState("c", 8, "a", True, False)
    _, majority, _ = classify_peers([client_only, PeerState("s", 8, "b", False, False)])
    assert majority == "b"
