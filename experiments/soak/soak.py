#!/usr/bin/env python
"""Churn soak of PULSELoCo and PULSESync on loopback, checked against an exact outside ledger.

A supervisor starts a bootstrap hivemind DHT on 127.0.0.1 and ``--peers`` PULSELoCo peer processes (the last one
sends poisoned payloads, ``--client-peers`` before it run in client mode), plus a PULSESync publisher and two
``pulseloco sync follow`` subscribers. While the swarm trains ``--rounds`` outer rounds with the dense selector,
a schedule (fractions of the run, see :func:`schedule`) SIGKILLs peers (one right after it pushed its
contribution) and restarts them, lets one join late, stalls peers mid-fetch with SIGSTOP/SIGCONT (once shorter
and once longer than the averaging timeout), and kills and restarts a subscriber.

Every peer records what it produced, what it sent, what each round aggregated (the accepted contributor list of
every shard, with each contributor's clip scale) and its residual (files under ``--out``). At the end the
supervisor checks:

- **digests**: after every round, every peer that completed it in a group with others (every shard's sum applied,
  or repaired) and holds the same round holds the same digest. A peer that found no one in time averages alone (a
  group of one, by design) and keeps its own state until its next round repairs it, which the last round never
  has; that happens on a loaded machine, and such rounds are counted as "rounds averaged alone", not compared;
- **exactly once** (the ledger): walking the final theta's lineage back to the initial weights gives, for every
  contribution, the shards that counted it and at which clip scale. For each honest peer process, what it produced
  minus what the lineage counted of its contributions must equal its residual (for a killed process, its last
  contribution and the residual it left when it pushed it).
  A contribution counted twice or lost shows up as a difference;
- **no poison**: the final lineage counts no contribution of the poisoning peer, and every finished peer's
  parameters are finite (rounds in which no group counted anything, the sign of a swarm that stopped learning,
  are reported);
- **processes**: no peer, DHT or ``p2pd`` process is left once everything was asked to stop;
- **PULSESync**: every version a subscriber printed has the publisher's digest, and both end on the last one.
- **status**: ``pulseloco status`` (:func:`pulseloco.cli.status.collect_status`), read at the end, joins the swarm and
  finds the PULSESync head verified. Whether every lingering peer agrees is reported, not required: churn in the
  last rounds can leave a peer that has not repaired yet (it would at its next round, which never comes).

It prints a table (rounds, group splits, diverged rounds, peers left out, repairs, downloads, double counts, digest
disagreements, leaked processes, sync mismatches) and, with ``--json``, writes it. Exit code 0 when every check
passed, 1 otherwise.

    .venv/bin/python experiments/soak/soak.py                                  # 6 peers, 50 rounds (about 10 minutes)
    .venv/bin/python experiments/soak/soak.py --peers 4 --rounds 8 --json s.json   # the short version the tests run
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

import psutil
import torch
from harness import models, procs
from harness.audit import Audit, check_ledger
from harness.report import read_records
from soak_report import followed, print_table, summarize, sync_check
from soak_schedule import Event, Member, schedule

VOCAB, SEQ_LEN, BATCH = 64, 16, 4
PRELOAD = (
    "torch", "hivemind", "transformers.models.llama.modeling_llama", "pulseloco.loco", "pulseloco.sync.publisher",
    "pulseloco.sync.subscriber", "pulseloco.swarm", "pulseloco.cli", "harness.audit",
)  # fmt: skip
"""What the peers, the publisher and the subscribers import: their processes are forks of a fork server that
imported these once (:class:`harness.procs.Runner`), not interpreters that import them again (5 CPU-s each)."""


# ---- the peer process ------------------------------------------------------------------------------------------


def tiny_model() -> torch.nn.Module:
    """A one-layer Llama of about 5k parameters, identical in every process (seed 0)."""
    return models.llama(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=SEQ_LEN,
    )  # fmt: skip


def _poison() -> None:
    """Make this process's contributions poisoned (alternately NaN and 1e6 times too large); it stays an honest
    shard owner. The others must reject them (``num_rejected``) and never apply them."""
    import pulseloco.loco.validation as validation  # its encode_parts builds the parts a member pushes

    honest = validation.encode_sparse

    def poisoned(
        name: str, numel: int, indices_K: torch.Tensor, values_K: torch.Tensor, *, round_index: int, **kwargs: Any
    ) -> bytes:
        if name == validation.CONTRIBUTION_NAME:
            values_K = values_K * (float("nan") if round_index % 2 else 1e6)
        return honest(name, numel, indices_K, values_K, round_index=round_index, **kwargs)

    validation.encode_sparse = poisoned  # type: ignore[assignment]


def peer_main(args: argparse.Namespace) -> None:
    """One PULSELoCo peer: train until ``--rounds``, record every round, stay reachable until the stop file."""
    import hivemind

    from pulseloco import PulseLoCo
    from pulseloco.loco import AveragingConfig, RoundConfig

    logging.basicConfig(level=logging.WARNING, format=f"{args.name} %(name)s %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a run that times out asks for every thread's stack
    torch.set_num_threads(1)
    out = Path(args.out)
    dht = hivemind.DHT(
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        client_mode=args.client_mode,
        start=True,
    )
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    if args.malicious:
        _poison()
    opt = PulseLoCo(
        model,
        inner,
        dht=dht,
        run_id="soak",
        round_config=RoundConfig(inner_steps=args.inner_steps, selector="dense"),
        averaging_config=AveragingConfig(
            target_group_size=args.target_group_size,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            request_timeout=args.request_timeout,
        ),
    )
    audit = Audit(opt, out, args.name)
    _stall_when_asked(opt, out / "stall" / args.name.split(".")[0])
    seed = zlib.crc32(args.name.encode())
    generator = torch.Generator().manual_seed(seed)
    while opt.round < args.rounds:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator)
        model(input_ids=tokens, labels=tokens).loss.backward()
        round_before = opt.round
        opt.step()
        opt.zero_grad()
        if opt.round != round_before and opt.last_metrics is not None:
            audit.end_round(final=opt.round >= args.rounds)
    # Stay reachable (slower peers fetch shards and state from this one) until the supervisor says stop.
    deadline = time.monotonic() + args.linger
    while not (out / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    opt.shutdown()
    dht.shutdown()


def _stall_when_asked(opt: Any, request: Path) -> None:
    """Stall this peer's whole Python process (SIGSTOP; a shell child sends SIGCONT) at its next fetch of a shard sum
    once the supervisor has written ``request`` (the stall's seconds): its parts pushed, its fetches not yet made.
    The request is renamed to ``<request>.taken`` first, which tells the supervisor the stall happened. The peer
    does it itself because a supervisor watching files catches a fast round's fetch only by luck (a soak's stall
    was missed so once its rounds on loopback took under a second)."""
    fetch = opt.averager._fetch

    async def fetch_or_stall(owner: str, header: dict[str, Any], deadline: float) -> Any:
        if request.exists():
            seconds = float(request.read_text())
            request.rename(request.with_name(request.name + ".taken"))
            subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)  # the Python process only: its DHT and daemon run on
        return await fetch(owner, header, deadline)

    opt.averager._fetch = fetch_or_stall


# ---- the PULSESync publisher process -------------------------------------------------------------------------------


def publisher_main(args: argparse.Namespace) -> None:
    """Publish a new version of a tiny model every ``--interval`` seconds (about 1% of its weights move, as in RL
    post-training) until the stop file; log ``{"version", "digest"}`` lines."""
    import hivemind

    from pulseloco.sync.publisher import Publisher
    from pulseloco.sync.signing import load_private_key

    logging.basicConfig(level=logging.WARNING, format="publisher %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    out = Path(args.out)
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    model = tiny_model()
    publisher = Publisher(dht, "soak.policy", load_private_key(args.key), out / "store", anchor_every=5)
    generator = torch.Generator().manual_seed(1)
    with (out / "publisher.jsonl").open("a") as log:
        while not (out / "stop").exists():
            with torch.no_grad():
                for p in model.parameters():
                    mask = torch.rand(p.shape, generator=generator) < 0.01
                    p.add_(mask * torch.randn(p.shape, generator=generator) * 0.05)
            version = publisher.publish(model)
            publisher.flush(timeout=60)
            log.write(json.dumps({"version": version, "digest": publisher.digest}) + "\n")
            log.flush()
            time.sleep(args.interval)
        log.write(json.dumps({"stopped": True}) + "\n")
    deadline = time.monotonic() + args.linger  # serve the last version until the subscribers have it
    while not (out / "stop_publisher").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    publisher.close()
    dht.shutdown()


# ---- the supervisor ------------------------------------------------------------------------------------------------


@dataclass
class Soak:
    args: argparse.Namespace
    out: Path
    members: dict[str, Member] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    notes: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    """Events of the schedule that could not happen (every peer had finished first)."""
    groups: set[int] = field(default_factory=set)
    status: dict[str, Any] = field(default_factory=dict)
    runner: procs.Runner | None = None

    # -- processes --------------------------------------------------------------------------------------------
    def start(self, member: Member) -> None:
        """Start the next incarnation of ``member``, logging to ``logs/<name>.<incarnation>.log``."""
        if self.runner is None:
            self.runner = procs.Runner(self.out / "logs", preload=PRELOAD)
        member.incarnation += 1
        cmd = list(member.cmd)
        if member.name.startswith("peer"):
            cmd += ["--name", f"{member.name}.{member.incarnation}"]
        member.proc = self.runner.start(f"{member.name}.{member.incarnation}", cmd)
        self.groups.add(member.proc.pid)  # its DHT process and libp2p daemon inherit the process group
        self.notes.append(f"{time.time() - self.started:7.1f}s start {member.name}.{member.incarnation}")

    def kill(self, member: Member) -> None:
        """SIGKILL the whole process group: the Python process, its DHT process and its libp2p daemon."""
        if member.proc is None:
            return
        member.proc.kill()
        member.proc = None
        self.notes.append(f"{time.time() - self.started:7.1f}s kill {member.name}")

    def alive(self, member: Member) -> bool:
        return member.proc is not None and member.proc.running

    # -- the run ----------------------------------------------------------------------------------------------
    def peer_records(self) -> list[dict[str, Any]]:
        return [record for path in self.out.glob("peer*.jsonl") for record in read_records(path)]

    def swarm_round(self) -> int:
        return max((r["end_round"] for r in self.peer_records()), default=0)

    def mid_round(self, member: Member, since: int) -> bool:
        """Whether the current incarnation of ``member`` has written its contribution for a round at or after
        ``since`` that it has not finished (it pushes it right after; the caller then waits a moment so that the push
        is on its way). Any such round, not only the swarm's newest: a peer a round behind the others (after a stall
        or a split) pushes its round when the swarm has moved on, and fast rounds leave no moment when both agree."""
        name = f"{member.name}.{member.incarnation}"
        id_file = self.out / "ids" / name
        if not id_file.exists():
            return False
        finished = {record["round"] for record in read_records(self.out / f"{name}.jsonl")}
        for path in (self.out / "sent").glob(f"{id_file.read_text()}.*.npy"):
            round_index = int(path.name.split(".")[1])
            if round_index >= since and round_index not in finished:
                return True
        return False

    def apply(self, event: Event) -> bool:
        """Do ``event`` if its time has come; returns True once done."""
        member = self.members[event.target]
        if event.action == "start" or event.action == "restart":
            if self.alive(member):  # its kill has not happened yet
                return False
            self.start(member)
        elif event.action == "kill":
            self.kill(member)
        elif event.action == "kill_after_push":
            if not self.mid_round(member, event.round):
                return False
            time.sleep(0.3)
            self.kill(member)
        elif event.action.startswith("stall:"):
            # the peer stalls itself at its next fetch (_stall_when_asked) and marks the request taken
            request = self.out / "stall" / member.name
            taken = request.with_name(request.name + ".taken")
            if taken.exists():
                taken.unlink()
                self.notes.append(f"{time.time() - self.started:7.1f}s stall {member.name} {event.action[6:]}s")
                return True
            if member.proc is not None and not request.exists():
                request.write_text(event.action.split(":")[1])
            return False
        return True

    def run(self) -> dict[str, Any]:
        import hivemind

        args = self.args
        for sub in ("logs", "sent", "prod", "resid", "stall"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        try:
            maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
            self._make_members(maddrs)
            events = schedule(args.peers, args.rounds, args.averaging_timeout)
            late = {e.target for e in events if e.action == "start"}
            # Everything starts at once: the subscribers wait for the publisher's first version, the peers for
            # each other (startup is the slowest part of a short run on a loaded machine).
            for name, member in self.members.items():
                if name != "pub" and name not in late:
                    self.start(member)
            self._wait_for_first_version()
            self._drive(events)
            self.status = self._swarm_status(bootstrap)
        finally:
            (self.out / "stop").touch()
            hung = self._stop_all()
            bootstrap.shutdown()
        return self._summary(hung + self._leaked_processes())

    def _swarm_status(self, dht: Any) -> dict[str, Any]:
        """What ``pulseloco status`` reports at the end (peers lingering at the last round), as its JSON."""
        from pulseloco.cli.status import collect_status
        from pulseloco.sync.signing import load_public_key

        key = load_public_key(self.out / "keys" / "publisher.pub")
        try:
            report = collect_status(dht, "soak", sync_run_id="soak.policy", public_key=key, probe_timeout=3.0)
        except Exception as exc:  # the checks below still run; the table says status failed
            self.notes.append(f"pulseloco status failed: {exc!r}")
            return {"exit_code": None}
        return report.to_dict()

    def _make_members(self, maddrs: list[str]) -> None:
        args = self.args
        me = [sys.executable, str(Path(__file__).resolve())]
        common = ["--out", str(self.out), "--initial-peers", *maddrs]
        for i in range(args.peers):
            role: list[str] = []
            if i == args.peers - 1:
                role = ["--malicious"]
            elif i >= args.peers - 1 - args.client_peers:
                role = ["--client-mode"]
            cmd = [
                *me, "peer", *common, *role,
                "--rounds", str(args.rounds),
                "--inner-steps", str(args.inner_steps),
                "--target-group-size", str(args.peers),
                "--matchmaking-time", str(args.matchmaking_time),
                "--averaging-timeout", str(args.averaging_timeout),
                "--request-timeout", str(args.request_timeout),
            ]  # fmt: skip
            self.members[f"peer{i}"] = Member(f"peer{i}", cmd)
        key = self.out / "keys" / "publisher"
        subprocess.run(
            [sys.executable, "-m", "pulseloco", "keygen", "--out", str(key)], check=True, capture_output=True
        )
        interval = ["--interval", str(args.publish_interval)]
        self.members["pub"] = Member("pub", [*me, "publisher", *common, "--key", str(key), *interval])
        for i in range(2):
            follow = [sys.executable, "-m", "pulseloco", "sync", "follow", "--run-id", "soak.policy"]
            follow += ["--public-key", f"{key}.pub", "--out", str(self.out / f"sub{i}"), "--interval", "0.5"]
            self.members[f"sub{i}"] = Member(f"sub{i}", [*follow, "--initial-peers", *maddrs])
        self.start(self.members["pub"])

    def _wait_for_first_version(self) -> None:
        deadline = time.monotonic() + 120
        while not self._published() and time.monotonic() < deadline:
            time.sleep(0.2)

    def _published(self, raw: bool = False) -> list[dict[str, Any]]:
        lines = read_records(self.out / "publisher.jsonl")
        return lines if raw else [line for line in lines if "version" in line]

    def _drive(self, events: list[Event]) -> None:
        args = self.args
        deadline = time.monotonic() + args.timeout
        peers = [m for n, m in self.members.items() if n.startswith("peer")]
        while time.monotonic() < deadline:
            now_round = self.swarm_round()
            for event in events:
                if not event.done and event.round <= now_round:
                    event.done = self.apply(event)
            finished = {r["name"] for r in self.peer_records() if r["final"]}
            running = [p for p in peers if p.proc is not None]
            if all(f"{p.name}.{p.incarnation}" in finished for p in running):
                # An event still waiting cannot happen any more (a stall waits for its peer to push in a round)
                self.missed = [f"{e.action} {e.target} (round {e.round})" for e in events if not e.done]
                if self.missed:
                    self.notes.append(f"every peer finished before: {', '.join(self.missed)}")
                return
            for peer in running:
                if peer.proc is not None and peer.proc.poll() is not None:
                    self.notes.append(f"{peer.name} exited with {peer.proc.poll()} before finishing")
                    peer.proc = None
            time.sleep(0.2)
        self.notes.append(f"timeout: the run did not finish within {args.timeout:.0f}s")
        for peer in peers:  # where each one is stuck: its threads' stacks go to its log (faulthandler)
            if peer.proc is not None and peer.proc.poll() is None:
                peer.proc.send_signal(signal.SIGUSR1)
        time.sleep(2.0)

    def _stop_all(self) -> int:
        """Let every process end by itself: peers and the publisher see the stop file, the subscribers get SIGTERM
        once they hold the last version. Returns how many did not exit within a minute (killed; counted as
        leaked)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(p.get("stopped") for p in self._published(raw=True)):
            time.sleep(0.2)
        for name in ("sub0", "sub1"):
            member = self.members.get(name)
            if member is not None and self.alive(member):
                self._wait_for_subscriber(name)
                if member.proc is not None:
                    member.proc.send_signal(signal.SIGTERM)
        (self.out / "stop_publisher").touch()
        hung = 0
        deadline = time.monotonic() + 60
        for member in self.members.values():
            if member.proc is None:
                continue
            member.proc.send_signal(signal.SIGCONT)  # a peer stalled by itself may still be stopped
            try:
                member.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung += 1
                self.notes.append(f"{member.name} did not exit when asked: killed")
                member.proc.kill()
        return hung

    def _wait_for_subscriber(self, name: str, timeout: float = 60.0) -> None:
        published = self._published()
        if not published:
            return
        last = published[-1]["version"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(v >= last for v, _ in followed(self.out / "logs", name)):
                return
            time.sleep(0.3)

    # -- the checks ---------------------------------------------------------------------------------------------
    def _summary(self, leaked_processes: int) -> dict[str, Any]:
        """The checks over what the run left (:func:`soak_report.summarize`)."""
        records = self.peer_records()
        ledger = check_ledger(
            self.out, records, initial_digest=self._initial_digest, rounds=self.args.rounds,
            poisoner=f"peer{self.args.peers - 1}", notes=self.notes,
        )  # fmt: skip
        published = {p["version"]: p["digest"] for p in self._published()}
        sync = sync_check(published, self.out / "logs", self.notes)
        return summarize(
            records, ledger=ledger, sync=sync, status=self.status, leaked=leaked_processes, peers=self.args.peers,
            rounds=self.args.rounds, seconds=round(time.time() - self.started, 1), events=self.notes,
            missed=self.missed,
        )  # fmt: skip

    def _initial_digest(self) -> str:
        from pulseloco.loco.validation import theta_digest

        model = tiny_model()
        return theta_digest(torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]))

    def _leaked_processes(self) -> int:
        """Processes of the soak still running after everything exited or was killed: anything in the process
        groups of the peers, publisher and subscribers (their DHT processes and ``p2pd`` daemons inherit the
        group), and any child of this process but multiprocessing's helpers. Each is listed, then killed."""
        time.sleep(1.0)
        leaked = procs.survivors(self.groups)
        for proc in leaked:
            with contextlib.suppress(psutil.Error):
                self.notes.append(f"leaked: {proc.pid} {' '.join(proc.cmdline())[:120]}")
                proc.kill()
        return len(leaked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    for name in ("peer", "publisher"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--initial-peers", nargs="+", required=True)
        p.add_argument("--linger", type=float, default=120.0)
        if name == "peer":
            p.add_argument("--name", required=True)
            p.add_argument("--client-mode", action="store_true")
            p.add_argument("--malicious", action="store_true")
            p.add_argument("--rounds", type=int, required=True)
            p.add_argument("--inner-steps", type=int, default=2)
            p.add_argument("--target-group-size", type=int, default=None)
            p.add_argument("--matchmaking-time", type=float, default=4.0)
            p.add_argument("--averaging-timeout", type=float, default=8.0)
            p.add_argument("--request-timeout", type=float, default=3.0)
        else:
            p.add_argument("--key", required=True)
            p.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--peers", type=int, default=6, help="PULSELoCo peers (at least 4)")
    parser.add_argument("--client-peers", type=int, default=None, help="client-mode peers (default 2; 1 for 4 peers)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--matchmaking-time", type=float, default=4.0)
    parser.add_argument("--averaging-timeout", type=float, default=8.0)
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--publish-interval", type=float, default=1.0, help="seconds between PULSESync versions")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole run may take")
    parser.add_argument("--out", default=None, help="directory for the ledger and logs (default: a temporary one)")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)
    if args.command == "peer":
        peer_main(args)
        return 0
    if args.command == "publisher":
        publisher_main(args)
        return 0
    if args.peers < 4:
        parser.error("--peers must be at least 4 (two servers, a client, a poisoner)")
    if not args.publish_interval > 0:
        parser.error(f"--publish-interval must be positive, got {args.publish_interval}")
    if args.client_peers is None:
        args.client_peers = min(2, args.peers - 3)
    if not 1 <= args.client_peers <= args.peers - 3:
        parser.error(f"--client-peers must be between 1 and {args.peers - 3}")
    logging.basicConfig(level=logging.WARNING)
    with contextlib.ExitStack() as stack:
        out = Path(args.out) if args.out else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        out.mkdir(parents=True, exist_ok=True)
        summary = Soak(args, out).run()
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
