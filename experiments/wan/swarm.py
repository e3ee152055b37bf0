#!/usr/bin/env python
"""A PULSELoCo swarm over emulated internet links: a bootstrap node and ``--peers`` trainers, each in its own
network namespace behind its own link (experiments/wan/wan_net.py: rate, delay, jitter, loss), real hivemind over
real TCP. Reports per peer the compute utilization (inner-step seconds over the run's wall time) and the bytes
sent and received, and per round the group sizes and how the outer step's time splits (matchmaking, exchange,
digest check), with whether every peer ended each round on one theta.

    python experiments/wan/swarm.py --peers 16 --rate 100mbit --rtt-ms 100 [--json out.json]   # as root

By default every peer has the same link: ``--rate`` each way and a one-way delay of ``--rtt-ms / 4`` per direction,
so two peers are ``--rtt-ms`` apart; ``--profile mixed`` makes half of them home connections and half cloud machines
(:func:`peer_links`); ``--lossy N`` gives the last N peers ``--loss``. ``--overlap`` runs each round's exchange
during the next round's inner steps (``RoundConfig.overlap``). ``--fault`` injects failures at set times (a
partition that heals, a peer whose round trips jump, the bootstrap node restarted: :class:`Fault`) and churn
(trainers killed with their DHT and daemon, leaving, joining late, coming back as new processes: :data:`CHURN`,
:class:`Trainers`). ``--nat N`` puts the first N trainers behind NAT in client mode (``wan_net``: a private
address, SNAT, nothing new let in; the WAN's addresses are then public-looking, so the bootstrap relays for
them). Every trainer keeps an outside ledger (scripts/harness/ledger.py; with churn scripts/harness/audit.py,
whose files a killed process keeps; ``--no-ledger``: none) and, once all have trained, catches up with the swarm's
state (``PulseLoCo.catch_up``); the report's ``final`` gives the number of distinct final thetas and the
conservation error (everything produced = what the final theta's lineage counted + the residuals; with churn per
process, a killed one included), ``joins`` how many rounds each joiner took from joining to its first counted
contribution, ``leaked_processes`` what was left in the trainers' namespaces, ``log_lines`` what the peers logged
about the faults. The trainers are experiments/wan/
wan_peer.py: a small MLP whose inner steps are padded to ``--step-seconds`` (the scaling: the exchange's bytes
follow the model's size, the compute time the padding). Failure behaviour: exits 1 with the reason when the
WAN cannot be built or a peer fails or runs past ``--timeout``; the namespaces and processes are removed either
way.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness
from harness import ledger
from harness.audit import check_ledger
from harness.netns import SUBNET
from wan_net import PUBLIC_SUBNET, Link, WanNet, machine_busy_seconds, process_cpu

PEER = Path(__file__).resolve().parent / "wan_peer.py"


BOOTSTRAP_PORT = 31337
"""The bootstrap node's TCP port in its namespace: fixed, so that a restarted node (``--fault bootstrap@...``) has
the address the trainers were given."""


def start_bootstrap(net: WanNet, identity: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """The bootstrap DHT node in namespace 0 (the key in ``identity``, created on the first start) and its
    multiaddrs; raises RuntimeError if it prints none in 120 s."""
    argv = [sys.executable, str(PEER), "bootstrap", "--host", net.host(0), "--port", str(BOOTSTRAP_PORT)]
    proc = subprocess.Popen(
        net.exec_argv(0, [*argv, "--identity", str(identity)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(120.0, proc.kill)
    timer.start()
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
    finally:
        timer.cancel()
    try:
        return proc, list(json.loads(line)["maddrs"])
    except (ValueError, KeyError, TypeError):
        proc.kill()
        raise RuntimeError(f"the bootstrap node printed no address: {line!r}") from None


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """A peer's RoundMetrics lines and its summary line (None if it did not finish)."""
    rounds, summary = [], None
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "summary" in record:
                summary = record["summary"]
            else:
                rounds.append(record)
    return rounds, summary


def _steady_utilization(rounds: list[dict[str, Any]]) -> float | None:
    """Inner-step seconds over inner plus blocked seconds of rounds 1 to the second last (``seconds_blocked``: how
    long the inner steps stopped at a boundary): the share a long run approaches, without the first round's
    start and the last round's landing after training (``None`` with fewer than 3 rounds)."""
    middle = sorted(rounds, key=lambda r: r["round"])[1:-1]
    if not middle:
        return None
    inner = sum(r["seconds_inner"] for r in middle)
    return inner / (inner + sum(r.get("seconds_blocked", r["seconds_sync"]) for r in middle))


def report(peers: list[tuple[list[dict[str, Any]], dict[str, Any] | None]], args: argparse.Namespace) -> dict:
    """Per peer utilization and bytes, per round group sizes, digests and the time split (medians over peers)."""
    per_peer = []
    for i, (rounds, summary) in enumerate(peers):
        inner = sum(r["seconds_inner"] for r in rounds)
        blocked = sum(r.get("seconds_blocked", r["seconds_sync"]) for r in rounds)
        wall = summary["wall_s"] if summary else float("nan")
        per_peer.append(
            {
                "peer": i,
                "finished": summary is not None,
                "utilization": inner / wall if summary else None,
                # every round boundary but the first (overlap: nothing lands there) and the last landing: what a
                # long run approaches
                "utilization_rounds": _steady_utilization(rounds),
                "seconds_blocked": blocked,
                "bytes_sent_per_round": statistics.mean(r["bytes_sent"] for r in rounds) if rounds else 0,
                "bytes_received_per_round": statistics.mean(r["bytes_received"] for r in rounds) if rounds else 0,
                # the trainer process's CPU seconds while training, and in its inner steps' forward and backward
                "cpu_s": summary.get("cpu_s") if summary else None,
                "cpu_inner_s": summary.get("cpu_inner_s") if summary else None,
            }
        )
    per_round = []
    for k in range(args.rounds):
        records = [r for rounds, _ in peers for r in rounds if r["round"] == k]
        if not records:
            continue
        per_round.append(
            {
                "round": k,
                "group_sizes": sorted({r["num_peers"] for r in records}),
                "digests": len({r["theta_digest"] for r in records}),
                **{
                    name: statistics.median(r.get(name, 0.0) for r in records)
                    for name in (
                        "seconds_sync",
                        "seconds_blocked",
                        "seconds_matchmaking",
                        "seconds_exchange",
                        "seconds_digest",
                    )
                },
            }
        )
    utilizations = [p["utilization"] for p in per_peer if p["utilization"] is not None]
    steady = [p["utilization_rounds"] for p in per_peer if p["utilization_rounds"] is not None]
    return {
        "utilization_median": statistics.median(utilizations) if utilizations else None,
        "utilization_min": min(utilizations) if utilizations else None,
        "utilization_rounds_median": statistics.median(steady) if steady else None,
        "utilization_rounds_min": min(steady) if steady else None,
        "per_peer": per_peer,
        "per_round": per_round,
    }


@dataclasses.dataclass(frozen=True)
class Fault:
    """A failure injected ``at`` seconds after every trainer has started training: ``partition`` (the first half
    of the trainers and the bootstrap node cut off from the rest for ``seconds``), ``rtt`` (trainer ``peer``'s
    round trip to the others becomes ``rtt_ms``, for the rest of the run) or ``bootstrap`` (the bootstrap node
    killed, restarted at the same address ``seconds`` later); or churn (:data:`CHURN`) of trainer ``peer``:
    ``kill`` (SIGKILL to its processes, as a machine that died), ``leave`` (SIGTERM: it stops training and exits),
    ``join`` (started then, not with the others) and ``restart`` (a new process, with a new identity, after a kill
    or a leave)."""

    kind: str
    at: float
    seconds: float = 0.0
    peer: int = 0
    rtt_ms: float = 0.0


CHURN = ("kill", "leave", "join", "restart")
"""The churn faults, each of one trainer: ``KIND@AT:PEER``."""


def parse_fault(text: str) -> Fault:
    """``partition@AT:SECONDS``, ``rtt@AT:PEER:RTT_MS``, ``bootstrap@AT:SECONDS`` or a churn fault
    ``KIND@AT:PEER`` (:data:`CHURN`); raises ValueError."""
    kind, _, rest = text.partition("@")
    fields = rest.split(":")
    try:
        if kind in ("partition", "bootstrap") and len(fields) == 2:
            return Fault(kind, float(fields[0]), seconds=float(fields[1]))
        if kind == "rtt" and len(fields) == 3:
            return Fault(kind, float(fields[0]), peer=int(fields[1]), rtt_ms=float(fields[2]))
        if kind in CHURN and len(fields) == 2:
            return Fault(kind, float(fields[0]), peer=int(fields[1]))
    except ValueError:
        pass
    raise ValueError(
        f"bad --fault {text!r}: use partition@AT:SECONDS, rtt@AT:PEER:RTT_MS, bootstrap@AT:SECONDS or "
        f"{'|'.join(CHURN)}@AT:PEER (AT: seconds after every trainer has started training)"
    )


def check_churn(faults: list[Fault], peers: int) -> str | None:
    """Why a churn plan cannot run (None when it can): each fault's trainer in range; per trainer, in time order,
    a ``join`` first if at all, ``kill`` or ``leave`` only of a running process and ``restart`` only of one that
    was killed or left."""
    for peer in range(peers):
        own = sorted((f for f in faults if f.kind in CHURN and f.peer == peer), key=lambda f: f.at)
        running = not (own and own[0].kind == "join")
        for i, fault in enumerate(own):
            if fault.kind == "join" and i > 0:
                return f"join@{fault.at:g}:{peer}: a join must be the trainer's first churn fault"
            if fault.kind in ("kill", "leave") and not running:
                return f"{fault.kind}@{fault.at:g}:{peer}: trainer {peer} is not running then"
            if fault.kind == "restart" and running:
                return f"restart@{fault.at:g}:{peer}: trainer {peer} is still running then (kill or leave it first)"
            running = fault.kind in ("join", "restart")
    bad = [f for f in faults if f.kind in CHURN and not 0 <= f.peer < peers]
    return f"{bad[0].kind}@{bad[0].at:g}:{bad[0].peer}: PEER must be in [0, {peers})" if bad else None


class FaultPlan(threading.Thread):
    """Applies the faults at their times in the background and records what it did and when (``done``: kind,
    planned and actual seconds after the start, and the end of a timed fault). ``stop()`` ends the plan early; a
    fault that fails is recorded with its error (the run goes on and the report shows it)."""

    def __init__(
        self, faults: list[Fault], net: WanNet, restart: Any, num_trainers: int, started_dir: Path, churn: Any = None
    ) -> None:
        super().__init__(daemon=True)
        self.faults, self.net, self.restart = sorted(faults, key=lambda f: f.at), net, restart
        self.churn = churn  # called with a churn Fault
        self.num_trainers, self.started_dir = num_trainers, started_dir
        self.start_time, self.start_time_wall = time.monotonic(), time.time()
        self.done: list[dict[str, Any]] = []
        self._stop_event = threading.Event()

    def _wait_for_trainers(self) -> bool:
        """Until every trainer has started training (its ``started-*`` file; at most 300 s): the faults' clock
        starts then, not while the processes start. False if stopped first."""
        deadline = time.monotonic() + 300.0
        while len(list(self.started_dir.glob("started-*"))) < self.num_trainers and time.monotonic() < deadline:
            if self._stop_event.wait(0.2):
                return False
        self.start_time, self.start_time_wall = time.monotonic(), time.time()
        return True

    def finished(self) -> bool:
        """Whether the plan is over: every fault applied, or it stopped."""
        return not self.is_alive()

    def _sleep_until(self, t: float) -> bool:
        return not self._stop_event.wait(max(0.0, self.start_time + t - time.monotonic()))

    def _now(self) -> float:
        return round(time.monotonic() - self.start_time, 1)

    def run(self) -> None:
        if not self._wait_for_trainers():
            return
        for fault in self.faults:
            if not self._sleep_until(fault.at):
                return
            entry: dict[str, Any] = {**dataclasses.asdict(fault), "started": self._now()}
            self.done.append(entry)
            try:
                if fault.kind == "rtt":
                    self.net.switch_delay(1 + fault.peer)
                elif fault.kind == "partition":
                    self.net.partition(list(range(1 + self.num_trainers // 2)))  # the bootstrap and half
                    self._stop_event.wait(fault.seconds)
                    self.net.heal()
                elif fault.kind == "bootstrap":
                    self.restart(fault.seconds)
                elif fault.kind in CHURN:
                    entry.update(self.churn(fault))
                entry["ended"] = self._now()
            except Exception as exc:  # recorded in the report: the run's outcome still says what the swarm did
                entry["error"] = str(exc)

    def stop(self) -> None:
        self._stop_event.set()


class CpuMeter(threading.Thread):
    """The swarm's CPU use while it trains: from when every trainer has started training (its ``started-*`` file
    in ``end_dir``) to when every trainer has finished (``done-*``), the CPU seconds of each kind of process
    (:func:`process_cpu` of the pids ``roots()`` returns: the swarm's own processes and emulators, not others this
    process started) and of the whole machine. ``result`` stays ``None`` if either moment does not come
    (a peer died) or the meter is stopped; the run's report then has no ``cpu``."""

    def __init__(self, end_dir: Path, num_trainers: int, roots: Callable[[], list[int]]) -> None:
        super().__init__(daemon=True)
        self.end_dir, self.num_trainers, self.roots = end_dir, num_trainers, roots
        self.result: dict[str, Any] | None = None
        self._stop_event = threading.Event()

    def _wait_for(self, pattern: str) -> bool:
        while len(list(self.end_dir.glob(pattern))) < self.num_trainers:
            if self._stop_event.wait(0.2):
                return False
        return True

    def run(self) -> None:
        if not self._wait_for("started-*"):
            return
        start, (busy0, cores), kinds0 = time.monotonic(), machine_busy_seconds(), process_cpu(self.roots())
        if not self._wait_for("done-*"):
            return
        wall, (busy1, _), kinds1 = time.monotonic() - start, machine_busy_seconds(), process_cpu(self.roots())
        self.result = {
            "wall_s": wall,
            "cores": cores,
            "machine_busy_s": busy1 - busy0,
            "machine_busy_share": (busy1 - busy0) / (wall * cores),
            "by_kind": {
                kind: {
                    "seconds": slot["seconds"] - kinds0.get(kind, {}).get("seconds", 0.0),
                    "processes": slot["processes"],
                }
                for kind, slot in kinds1.items()
            },
        }

    def stop(self) -> None:
        self._stop_event.set()


PROFILES: dict[str, tuple[str, str, float, float]] = {
    "home": ("10mbit", "50mbit", 30.0, 80.0),
    "cloud": ("1gbit", "1gbit", 10.0, 150.0),
}
"""``--profile mixed``: kind -> (up, down, round trip between two peers of the kind at the low and the high end of
its range, ms): a home connection of 50/10 Mbit/s 30-80 ms apart, a cloud machine of 1 Gbit/s 10-150 ms apart."""


def peer_links(args: argparse.Namespace) -> list[tuple[str, Link]]:
    """Each trainer's (kind, link). ``uniform``: ``--rate`` each way, ``--rtt-ms`` between any two. ``mixed``: even
    peers home, odd peers cloud (:data:`PROFILES`), each kind's one-way delays spread evenly over its range (a
    quarter of the round trips: two peers ``d`` and ``e`` ms away from the hub are ``2 (d + e)`` apart). ``--lossy
    N``: the last N peers also lose ``--loss`` of their packets each way."""
    links = []
    for i in range(args.peers):
        if args.profile == "uniform":
            kind, up, down, delay = "uniform", args.rate, args.rate, args.rtt_ms / 4
        else:
            kind = "home" if i % 2 == 0 else "cloud"
            up, down, low, high = PROFILES[kind]
            of_kind = len(range(i % 2, args.peers, 2))
            delay = (low + (high - low) * (i // 2) / max(1, of_kind - 1)) / 4
        loss = args.loss if i >= args.peers - args.lossy else 0.0
        jitter = min(args.jitter_ms, delay)
        alt = [f.rtt_ms / 2 - args.rtt_ms / 4 for f in args.fault if f.kind == "rtt" and f.peer == i]
        link = Link(
            up=up,
            down=down,
            delay_ms=delay,
            jitter_ms=jitter,
            loss=loss,
            alt_delay_ms=max([jitter, *alt]) if alt else None,
        )
        links.append((kind, link))
    return links


class Trainers:
    """The trainer processes of a run, one slot per trainer and a new incarnation (``peer<i>.<k>``, a new process and
    peer id) for each start: each in a session of its own inside its namespace, so that a kill takes its DHT
    process and libp2p daemon with it, as a machine that dies. ``argv(i, name)`` gives the command line of trainer
    ``i``'s process ``name``; ``workdir`` holds their logs (``peer<i>.log``, every incarnation appended)."""

    def __init__(self, net: WanNet, argv: Callable[[int, str], list[str]], workdir: Path) -> None:
        self.net, self.argv, self.workdir = net, argv, workdir
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.incarnations: dict[int, int] = collections.defaultdict(int)
        self.killed: set[int] = set()  # slots whose current process the plan killed on purpose
        self.starts: list[dict[str, Any]] = []  # every process: trainer, name, wall-clock start

    def start(self, i: int) -> dict[str, Any]:
        """Start trainer ``i``'s next incarnation; returns its entry in :attr:`starts`."""
        name = f"peer{i}.{self.incarnations[i]}"
        self.incarnations[i] += 1
        with (self.workdir / f"peer{i}.log").open("a") as log:
            self.procs[i] = subprocess.Popen(
                self.net.exec_argv(1 + i, self.argv(i, name)),
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        self.killed.discard(i)
        entry = {"trainer": i, "name": name, "t": time.time()}
        self.starts.append(entry)
        return entry

    def signal(self, i: int, sig: int) -> None:
        """Send ``sig`` to trainer ``i``'s current process (SIGKILL: to its whole session, then reaped)."""
        proc = self.procs[i]
        if sig == signal.SIGKILL:
            self.killed.add(i)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            proc.wait(timeout=30)
        else:
            proc.send_signal(sig)

    def churn(self, fault: Fault) -> dict[str, Any]:
        """Apply a churn fault (:data:`CHURN`); returns what the report records of it."""
        if fault.kind in ("join", "restart"):
            return {"name": self.start(fault.peer)["name"]}
        self.signal(fault.peer, signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)
        return {"name": f"peer{fault.peer}.{self.incarnations[fault.peer] - 1}"}

    def running(self) -> list[int]:
        """The slots whose current process still runs."""
        return [i for i, proc in self.procs.items() if proc.poll() is None]

    def failed(self) -> tuple[int, int] | None:
        """A slot whose current process exited non-zero without being killed on purpose, and its code; or None."""
        for i, proc in self.procs.items():
            code = proc.poll()
            if code not in (None, 0) and i not in self.killed:
                return i, code
        return None

    def all(self) -> list[subprocess.Popen[str]]:
        return list(self.procs.values())


class Followers:
    """``pulseloco sync follow`` processes in their own namespaces (net indices ``first``, ``first + 1``, ...),
    following the run's PULSESync versions; each line they print is kept with the wall time it came
    (:attr:`lines`: follower -> [(t, line)])."""

    def __init__(self, net: WanNet, first: int, count: int, workdir: Path, key: Path, maddrs: list[str]) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.lines: dict[int, list[tuple[float, str]]] = {j: [] for j in range(count)}
        for j in range(count):
            argv = [sys.executable, "-m", "pulseloco", "sync", "follow", "--run-id", "wan"]  # wan.policy, as README
            argv += ["--public-key", f"{key}.pub", "--out", str(workdir / f"follower{j}"), "--interval", "0.5"]
            argv += ["--initial-peers", *maddrs, "--host-maddrs", f"/ip4/{net.host(first + j)}/tcp/0"]
            with (workdir / f"follower{j}.log").open("a") as err:
                argv = net.exec_argv(first + j, argv)
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(j, proc), daemon=True).start()

    def _read(self, j: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None  # noqa: S101 (a pipe)
        for line in proc.stdout:
            self.lines[j].append((time.time(), line.strip()))

    def versions(self, j: int) -> list[dict[str, Any]]:
        """The versions follower ``j`` printed: version, digest, bytes received, when."""
        out = []
        for t, line in list(self.lines[j]):
            parts = line.split()
            if len(parts) == 7 and parts[0].isdigit():
                out.append({"version": int(parts[0]), "digest": parts[4], "bytes": int(parts[2]), "t": t})
        return out

    def hold(self, version: int) -> bool:
        """Whether every follower has printed ``version`` (or a later one)."""
        return all(any(v["version"] >= version for v in self.versions(j)) for j in self.lines)

    def report(self, published: list[dict[str, Any]]) -> dict[str, Any]:
        """Per follower: versions seen, digest mismatches against the publisher's, whether it reached the last
        version, seconds from a version's publication to its line (median and max) and bytes per version."""
        digests = {p["version"]: p["digest"] for p in published}
        times = {p["version"]: p["t"] for p in published}
        last = max(digests, default=None)
        followers = []
        for j in self.lines:
            seen = self.versions(j)
            delays = [v["t"] - times[v["version"]] for v in seen if v["version"] in times]
            followers.append(
                {
                    "versions": len(seen),
                    "mismatches": sum(1 for v in seen if digests.get(v["version"]) != v["digest"]),
                    "reached_last": last is not None and any(v["version"] == last for v in seen),
                    "delay_s_median": statistics.median(delays) if delays else None,
                    "delay_s_max": max(delays) if delays else None,
                    "bytes_per_version": statistics.mean(v["bytes"] for v in seen) if seen else None,
                }
            )
        patches = [p["patch_bytes"] for p in published if p["patch_bytes"]]
        return {
            "published": len(published),
            "patch_bytes_mean": statistics.mean(patches) if patches else None,
            "followers": followers,
        }


def leftover_processes(net: WanNet, namespaces: list[int], timeout: float = 10.0) -> list[str]:
    """The command lines of processes still running in the namespaces of ``namespaces`` (net indices) once every
    trainer there has exited (a peer that exits cleanly leaves no DHT process or libp2p daemon behind), after up
    to ``timeout`` s for them to go; the link emulators, which work in the peers' namespaces, are not counted."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for index in namespaces:
            listed = subprocess.run(
                ["ip", "netns", "pids", net.peer_ns(index)], capture_output=True, text=True, timeout=10, check=False
            ).stdout.split()
            for pid in listed:
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    if "linkem.py" not in cmdline:
                        found.append(cmdline[:160])
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def publisher_index(args: argparse.Namespace) -> int | None:
    """The trainer that publishes PULSESync versions to the followers: the first one neither behind NAT nor in a
    churn fault (None if there is none)."""
    churned = {f.peer for f in args.fault if f.kind in CHURN}
    return next((i for i in range(args.nat, args.peers) if i not in churned), None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    delay = args.rtt_ms / 4
    trainers = peer_links(args)
    bootstrap_link = Link(up=args.rate, down=args.rate, delay_ms=delay, jitter_ms=min(args.jitter_ms, delay))
    nat = frozenset(range(1, 1 + args.nat))  # net indices: the bootstrap is 0, trainer i is 1 + i, then followers
    net = WanNet(
        [bootstrap_link] + [link for _, link in trainers] + [bootstrap_link] * args.followers,
        mtu=args.mtu,
        prefix="plsw",
        subnet=PUBLIC_SUBNET if args.nat else SUBNET,
        nat=nat,
    )
    workdir = Path(tempfile.mkdtemp(prefix="pulseloco-wan-"))
    procs: list[subprocess.Popen[str]] = []
    identity = workdir / "bootstrap.key"
    (workdir / "end").mkdir()
    plan: FaultPlan | None = None
    churn = [f for f in args.fault if f.kind in CHURN]
    joiners = {f.peer for f in churn if f.kind == "join"}
    audit = workdir / "audit" if churn and args.ledger else None
    if audit is not None:
        audit.mkdir()
    pool: Trainers | None = None
    followers: Followers | None = None
    publisher = publisher_index(args)

    def restart_bootstrap(seconds: float) -> None:
        procs[0].terminate()
        procs[0].wait(timeout=15)
        time.sleep(seconds)
        started = time.monotonic()
        procs[0], again = start_bootstrap(net, identity)
        print(f"swarm.py: the bootstrap node restarted in {time.monotonic() - started:.1f} s", file=sys.stderr)
        if again != maddrs:
            raise RuntimeError(f"the restarted bootstrap node has other addresses: {again} (was {maddrs})")

    try:
        net.setup()
        bootstrap, maddrs = start_bootstrap(net, identity)
        procs.append(bootstrap)
        flags = ["--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps)]
        flags += ["--step-seconds", str(args.step_seconds), "--width", str(args.width), "--depth", str(args.depth)]
        flags += ["--selector", args.selector, "--exchange", args.exchange, "--run-id", "wan"]
        flags += ["--matchmaking-time", str(args.matchmaking_time)]
        flags += ["--target-group-size", str(args.target_group_size)]
        flags += ["--close-when-expected" if args.close_when_expected else "--no-close-when-expected"]
        flags += ["--overlap"] if args.overlap else []
        flags += ["--averaging-timeout", str(args.averaging_timeout), "--request-timeout", str(args.request_timeout)]
        flags += ["--rejoin-interval", str(args.rejoin_interval), "--ledger-rounds", str(args.ledger_rounds)]

        def trainer_argv(i: int, name: str) -> list[str]:
            argv = [sys.executable, str(PEER), "train", "--host", net.host(1 + i), "--initial-peers", *maddrs]
            argv += ["--metrics", str(workdir / f"peer{i}.jsonl"), "--seed", str(i), *flags]
            if audit is not None:  # churn: the ledger in files, which a killed process keeps
                argv += ["--audit", str(audit), "--name", name]
            elif args.ledger:
                argv += ["--ledger", str(workdir / f"peer{i}.ledger.pt")]
            argv += ["--client-mode"] if 1 + i in nat else []
            if args.followers and i == publisher:  # its model after every round, to the followers
                argv += ["--publish", str(workdir / "sync.key"), "--store", str(workdir / "store")]
                argv += ["--publish-log", str(workdir / "published.jsonl")]
            return [*argv, "--end-dir", str(workdir / "end"), "--num-peers", str(args.peers)]

        if args.followers:
            keygen = [sys.executable, "-m", "pulseloco", "keygen", "--out", str(workdir / "sync.key")]
            subprocess.run(keygen, check=True, capture_output=True, timeout=120)
            followers = Followers(net, 1 + args.peers, args.followers, workdir, workdir / "sync.key", maddrs)
        pool = Trainers(net, trainer_argv, workdir)
        for i in range(args.peers):
            if i not in joiners:
                pool.start(i)
        plan = FaultPlan(
            args.fault, net, restart_bootstrap, args.peers - len(joiners), workdir / "end", churn=pool.churn
        )
        plan.start()
        meter = CpuMeter(
            workdir / "end", args.peers - len(joiners), lambda: [p.pid for p in [*procs, *pool.all(), *net.emulators]]
        )
        meter.start()
        deadline = time.monotonic() + args.timeout
        while True:
            failed = pool.failed()
            if failed is not None:
                log = (workdir / f"peer{failed[0]}.log").read_text()[-2000:]
                raise RuntimeError(f"peer {failed[0]} exited {failed[1]}: {log}")
            if not pool.running() and plan.finished():
                break
            if time.monotonic() > deadline:
                running = pool.running()
                raise RuntimeError(f"peers {running} ran past --timeout {args.timeout:.0f} s (logs in {workdir})")
            if plan.finished():  # a trainer killed for good counts as done: the others' end waits for no one
                for i in pool.killed:
                    (workdir / "end" / f"done-{net.host(1 + i)}").touch()
            last = workdir / "published-last"  # the publisher's last version is out: it serves until they hold it
            if followers is not None and last.exists() and followers.hold(int(last.read_text() or 0)):
                (workdir / "end" / "followers-done").touch()
            time.sleep(0.5)
        plan.stop()
        plan.join(timeout=60)
        meter.stop()
        meter.join(timeout=60)
        result = report([read_metrics(workdir / f"peer{i}.jsonl") for i in range(args.peers)], args)
        if audit is not None:
            left = {entry["name"] for entry in plan.done if entry["kind"] == "leave"}
            records = audit_records(audit)
            result["final"] = audit_state(audit, records, args, left)
            result["joins"] = join_rounds(audit, records, pool.starts, after=plan.start_time_wall)
            result["starts"] = pool.starts
            shutil.rmtree(audit, ignore_errors=True)  # dense copies of every contribution: gigabytes at 16 peers
        elif args.ledger:
            result["final"] = final_state([workdir / f"peer{i}.ledger.pt" for i in range(args.peers)])
        if followers is not None:
            published = [json.loads(line) for line in (workdir / "published.jsonl").read_text().splitlines()]
            result["sync"] = followers.report(published)
            for proc in followers.procs:
                proc.terminate()
            for proc in followers.procs:
                proc.wait(timeout=30)
        namespaces = list(range(1, 1 + args.peers + args.followers))
        result["leaked_processes"] = leftover_processes(net, namespaces)
        result["faults"] = plan.done
        if meter.result is not None:
            result["cpu"] = meter.result
        result["log_lines"] = log_lines([workdir / f"peer{i}.log" for i in range(args.peers)])
        result["config"] = {k: v for k, v in vars(args).items() if k != "json"}
        result["config"]["fault"] = [dataclasses.asdict(f) for f in args.fault]
        for peer, (kind, link) in zip(result["per_peer"], trainers):
            peer["link"] = {"kind": kind, **dataclasses.asdict(link)}
        result["numel"] = args.depth * args.width * (args.width + 1) + args.width + 1
        return result
    finally:
        if plan is not None:
            plan.stop()
        everything = procs + (pool.all() if pool is not None else []) + (followers.procs if followers else [])
        for proc in everything:
            proc.terminate()
        for proc in everything:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        net.teardown()


def final_state(paths: list[Path]) -> dict[str, Any]:
    """The swarm's end from the peers' outside ledgers (scripts/harness/ledger.py): their final rounds, how many
    distinct thetas they hold, and the conservation error over the lineage of the most common theta (everything
    produced = what that lineage counted + the residuals; 0 up to FP32 rounding when nothing was lost or counted
    twice)."""
    import torch

    reports = [torch.load(path, weights_only=False) for path in paths]
    thetas = collections.Counter(r["theta"] for r in reports)
    majority = thetas.most_common(1)[0][0]
    # Decayed error feedback (SparseLoCo's 0.95) forgets part of every residual by design: no identity to check.
    exact = all(r.get("error_decay", 1.0) == 1.0 for r in reports)
    return {
        "thetas": len(thetas),
        "conservation_error": ledger.conservation_error(reports, theta=majority) if exact else None,
        "conservation": "checked" if exact else "not defined: error_decay < 1 forgets part of the residuals",
        "num_transitions": sum(len(r["transitions"]) for r in reports),
    }


def audit_records(audit: Path) -> list[dict[str, Any]]:
    """Every record the trainer processes wrote under ``audit`` (scripts/harness/audit.py), in file order."""
    return [json.loads(line) for path in sorted(audit.glob("*.jsonl")) for line in path.read_text().splitlines()]


def audit_state(audit: Path, records: list[dict[str, Any]], args: argparse.Namespace, left: set[str]) -> dict[str, Any]:
    """The swarm's end from the processes' audit files (churn runs): how many distinct thetas the processes that
    trained to the end hold (``left``: the names of those that left, whose older theta is not compared), and the
    exactly-once check of :func:`harness.audit.check_ledger`: for every process, what it produced = what the
    lineage of its final theta counted of it + its residual (a killed one: + its last contribution), the largest
    error relative to everything produced."""
    import torch
    from wan_peer import make_model

    from pulseloco.loco.validation import theta_digest

    def initial_digest() -> str:
        model = make_model(args.width, args.depth, seed=0)
        return theta_digest(torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]))

    notes: list[str] = []
    # decayed error feedback (SparseLoCo's 0.95) forgets part of every residual by design: no identity to check
    exact = all(r.get("error_decay", 1.0) == 1.0 for r in records if r["final"])
    checked = check_ledger(
        audit, records, initial_digest=initial_digest, rounds=args.rounds, poisoner=None, notes=notes
    )
    finals = {r["name"]: r["digest"] for r in records if r["final"] and r["name"] not in left}
    return {
        "thetas": len(set(finals.values())),
        "conservation_error": checked["max_error"] if exact and checked["checked"] else None,
        "conservation": ("checked" if exact else "not defined: error_decay < 1") + f" over {checked['checked']} "
        f"processes ({checked['violations']} over 1e-5){'; ' + checked['note'] if checked['note'] else ''}",
        "notes": notes,
        "processes": sorted(p.name for p in (audit / "ids").iterdir()),  # killed before a record too
    }


def join_rounds(
    audit: Path, records: list[dict[str, Any]], starts: list[dict[str, Any]], after: float
) -> list[dict[str, Any]]:
    """For each trainer process started ``after`` (a wall-clock time: the joiners and restarts): how long it took to
    join (``startup_s``: from its start to its DHT and optimizer being up, when it wrote its ``ids/`` file; the
    imports and the DHT's bootstrap), the round the swarm was in then (one past the last round any other process
    had finished), the first round whose averaging counted its contribution (its peer id in a shard's accepted
    list), and the rounds between (``records``: :func:`audit_records`)."""
    out = []
    for start in starts:
        if start["t"] <= after:
            continue
        ids = audit / "ids" / start["name"]
        if not ids.exists():  # it never joined
            out.append({"name": start["name"], "startup_s": None, "rounds_to_contribute": None})
            continue
        peer_id, joined_at = ids.read_text(), ids.stat().st_mtime
        # when each round applied its step (with overlap its record is written a round later, as it lands)
        finished = [
            r["round"]
            for r in records
            if "round" in r and r["name"] != start["name"] and r.get("t_applied", r["t"]) <= joined_at
        ]
        joined = max(finished) + 1 if finished else 0
        counted = [
            r["round"]
            for r in records
            if "round" in r and any(peer_id in (names or []) for names in r.get("accepted", []))
        ]
        first = min(counted) if counted else None
        out.append(
            {
                "name": start["name"],
                "startup_s": round(joined_at - start["t"], 1),
                "joined_round": joined,
                "first_counted_round": first,
                "rounds_to_contribute": None if first is None else first - joined,
            }
        )
    return out


def log_lines(paths: list[Path]) -> dict[str, int]:
    """What the peers said about faults: their warnings, errors, repairs and state downloads, with peer ids,
    digests and numbers blanked, and how many times each was logged (most frequent first)."""
    counts: collections.Counter[str] = collections.Counter()
    pattern = re.compile(r" (WARN|WARNING|ERROR|INFO) (.*)$")
    for path in paths:
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            found = pattern.search(line)
            if found is None or (found[1] == "INFO" and not re.search("repairing|state downloaded|incomplete", line)):
                continue
            message = re.sub(r"\b(Qm|12D3)\w+", "<peer>", found[2])
            message = re.sub(r"\b[0-9a-f]{16,}\b", "<digest>", message)
            counts[re.sub(r"\d+(\.\d+)?", "#", message)[:300]] += 1
    return dict(counts.most_common(40))


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument(
        "--profile",
        choices=("uniform", "mixed"),
        default="uniform",
        help="uniform: every trainer's link from --rate and --rtt-ms; mixed: half home (50/10 Mbit/s, 30-80 ms), "
        "half cloud (1 Gbit/s, 10-150 ms); the bootstrap node keeps --rate and --rtt-ms",
    )
    parser.add_argument("--rate", default="100mbit", help="each peer's link, each way (0: unlimited)")
    parser.add_argument("--rtt-ms", type=float, default=100.0, help="round-trip time between two peers")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--lossy", type=int, default=0, help="the last N peers lose --loss of their packets")
    parser.add_argument("--loss", type=float, default=0.005)
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--selector", default="pulse")
    parser.add_argument("--exchange", default="auto")
    parser.add_argument("--matchmaking-time", type=float, default=15.0)
    parser.add_argument("--target-group-size", type=int, default=0, help="0: none (the default matchmaking)")
    parser.add_argument(
        "--close-when-expected",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a round goes once every expected peer has registered",
    )
    parser.add_argument(
        "--overlap", action="store_true", help="RoundConfig.overlap: each exchange runs during the next inner steps"
    )
    parser.add_argument("--averaging-timeout", type=float, default=60.0, help="AveragingConfig.averaging_timeout")
    parser.add_argument("--request-timeout", type=float, default=10.0, help="AveragingConfig.request_timeout")
    parser.add_argument(
        "--ledger-rounds", type=int, default=8, help="AveragingConfig.ledger_rounds: the splits reconciled exactly"
    )
    parser.add_argument(
        "--fault",
        type=parse_fault,
        action="append",
        default=[],
        help="partition@AT:SECONDS (the bootstrap and the first half of the trainers cut off from the rest), "
        "rtt@AT:PEER:RTT_MS (trainer PEER's round trips become RTT_MS), bootstrap@AT:SECONDS (killed, restarted "
        "at its address SECONDS later), and churn: kill@AT:PEER (SIGKILL), leave@AT:PEER (SIGTERM: stops and "
        "exits), join@AT:PEER (started late), restart@AT:PEER (after a kill or leave, a new process); AT: seconds "
        "after every trainer has started training; repeatable",
    )
    parser.add_argument(
        "--ledger",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each trainer keeps the outside ledger for the report's final conservation check (with the pulse "
        "selector a dense copy of every round's sum: --no-ledger for 16 trainers in 24 GiB, and for CPU figures "
        "without its digests and copies)",
    )
    parser.add_argument(
        "--nat",
        type=int,
        default=0,
        help="the first N trainers are volunteers behind NAT (private address, SNAT, nothing new in) in client "
        "mode; the WAN's addresses are then ones libp2p counts as public, so the bootstrap can relay for them",
    )
    parser.add_argument(
        "--rejoin-interval",
        type=float,
        default=30.0,
        help="SwarmConfig.rejoin_interval: seconds between the trainers' pings of the bootstrap node (0: never)",
    )
    parser.add_argument(
        "--followers",
        type=int,
        default=0,
        help="PULSESync followers (`pulseloco sync follow`), each in its own namespace behind the bootstrap's link; "
        "the first trainer neither behind NAT nor churned publishes its model after every round",
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", metavar="PATH")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.peers < 2 or not 0 <= args.lossy <= args.peers:
        parser.error("--peers must be at least 2 and --lossy between 0 and --peers")
    for fault in args.fault:
        if fault.kind == "rtt" and not (0 <= fault.peer < args.peers and fault.rtt_ms >= args.rtt_ms / 2):
            parser.error(f"--fault rtt: PEER must be in [0, {args.peers}) and RTT_MS at least --rtt-ms / 2")
    churn_problem = check_churn(args.fault, args.peers)
    if churn_problem is not None:
        parser.error(f"--fault {churn_problem}")
    if not 1 <= args.ledger_rounds <= 64:
        parser.error("--ledger-rounds must be from 1 to 64 (AveragingConfig.ledger_rounds)")
    if not 0 <= args.nat <= min(args.peers, 190):
        parser.error(f"--nat must be in [0, {min(args.peers, 190)}]")
    if args.followers < 0 or (args.followers and publisher_index(args) is None):
        parser.error("--followers must be at least 0 and needs a trainer to publish, neither behind NAT nor churned")
    # SIGTERM (a killed run) ends through the cleanup below, not with the namespaces and processes left behind
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"swarm.py: stopped by signal {signum}"))
    reason = WanNet.unavailable_reason()
    if reason is not None:
        print(f"swarm.py: error: {reason}", file=sys.stderr)
        return 1
    try:
        result = run(args)
    except RuntimeError as exc:
        print(f"swarm.py: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in result.items() if k != "per_peer"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
