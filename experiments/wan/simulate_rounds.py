#!/usr/bin/env python
"""An event-driven simulation of PULSELoCo's outer rounds, for 4 to 1,024 peers: round time, its split,
utilization and bytes per peer.

    .venv/bin/python experiments/wan/simulate_rounds.py --costs costs.json --check REPORT.json [REPORT.json ...]
    .venv/bin/python experiments/wan/simulate_rounds.py --costs costs.json --peers 16,64,256,1024 --mode deployment

A simulation, not a run. Each peer does what ``PulseLoCo.step`` does at a round boundary
(pulseloco/loco/optimizer.py, matchmaking.py, averaging.py), message by message:

1. **catch-up**: a DHT read of the state records;
2. **registration**: a DHT store of its registration, a read of the state records (the expected peers), then DHT
   reads of the registrations every ``poll_s`` (0.05 s) until every expected peer has registered
   (``close_when_expected``); **view check**: a store of its view of the group (every member's id and digest),
   a store of the view's digest, and reads of the digests until every member's is there (the views agree);
3. **exchange** (``sums``, the ``auto`` exchange of the pulse selector): the selection and encoding (CPU), a part
   pushed to every other shard owner (one stream each, the owner's reply after the part arrived); every owner sums
   once all parts have arrived and serves its shard's aggregate to every member that asks; each member asks every
   owner once its own pushes have been answered;
4. **digest**: the outer step (CPU), a DHT store of the state record, reads of the state records every ``poll_s``
   until every member's says the new round.

**The DHT** (hivemind's Kademlia): ``P`` trainers and the bootstrap node. An operation takes ``h(P)`` sequential
hops, ``h = 1`` up to ``bucket`` (20) nodes, one more per doubling past it; every hop but the last asks one node
(a reply of ``bucket`` contacts), the last asks the key's ``replicas`` (5) nearest nodes at once and waits for all
of them (a read with ``latest=True``, a store): a read's reply carries every record (subkey) of the key. So the
few nodes holding a round's registrations, views and state records answer every peer's polls.

**Costs** (``--costs``, experiments/wan/calibrate.py's measurements on this machine): CPU seconds per DHT read
and store at the caller (``get_op_s``, ``store_op_s``), per DHT request between two nodes (``rpc_s``, half at
each end) and per record in a reply (``record_s``, half at each end), per exchange stream (``message_s``) and per
byte on it (``byte_s``, half at each end), per parameter entry for a peer's local outer step
(``round_s_per_entry``: the pseudo-gradient and selection before the round, the outer step and digest after it,
half each) and for the exchange's own passes over the model (``exchange_s_per_entry``, from the harness's
trainers: a third for encoding the parts, a third for the owner's decoding and sum, a third for decoding the
aggregates), and per byte through a link emulator (``emulator_byte_s``, from a harness run's CPU accounting).
Every piece of CPU work runs on a processor-sharing pool: in ``--mode machine`` (this machine: the WAN harness's
16 trainers, their daemons and the 17 emulators share ``--cores`` cores, and each byte between two peers also
costs two emulator passes) one pool for everything; in ``--mode deployment`` (one machine per peer, no emulator)
one pool per peer of ``--cores`` cores.

**Links**: each node's uplink and downlink are processor-sharing servers at ``--rate`` (TCP's fair share between
streams), the one-way delay between two peers is ``--rtt-ms / 2``; a message is delivered when its last byte
has left the sender's uplink plus the delay, and has passed the receiver's downlink (cut through: the downlink
starts a delay after the uplink). Not modelled: TCP slow start and loss, connection set-up, the DHT's routing
maintenance and caches, hivemind's own per-request limits, jitter in compute times.

**Bytes**: a peer's part for one owner is ``--payload-bytes / P`` and an owner's aggregate ``--aggregate-bytes /
P`` (the pulse selector on the 2.1M-parameter MLP, sums exchange: a peer's whole selection and all aggregates
together; the harness's reports give them), plus a 300-byte stream header; DHT messages carry their records
(a registration 120 bytes, a state record 380, a view 70 + 90 per member: their MessagePack sizes).

Output: one row per peer count (and per harness report with ``--check``): the median peer's round time and its
split (matchmaking, exchange, digest), utilization at ``--compute-s`` of inner steps per round (blocking, and
overlapped: the round runs in the background and only its excess over the compute stops training), bytes sent and
received per peer, DHT requests per peer, CPU seconds by kind; ``--check`` sets each report's peer count, rate,
round trip and bytes from the report, and prints the measured round beside the prediction. JSON in ``--json``.
Failure behaviour: bad flags exit 2; a report without the needed fields raises ``ValueError`` with the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import heapq
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLL_S = 0.05
"""``Matchmaker.poll_interval``: the pause between two DHT reads of a poll."""
HEADER_BYTES = 300
"""A stream's JSON header and protobuf framing, per message (the exchange's headers are 65-300 bytes)."""
CONTACT_BYTES = 60
"""One node contact in a DHT hop's reply (peer id and address)."""
REQUEST_BYTES = 200
"""A DHT request, or a reply without records."""
RECORD_BYTES = {"peers": 120, "states": 380, "view": 110}
"""A registration (61 bytes of MessagePack), a state record (319, with its 16 latest round records) and a view's
digest (45), each with its subkey (the peer id) and expiration."""
VIEW_BYTES = (70, 90)
"""A view record: fixed bytes, and bytes per member listed (its id, client flag, digest: 90 bytes of MessagePack)."""


@dataclasses.dataclass(frozen=True)
class Costs:
    """CPU seconds per operation (module docstring); ``emulator_byte_s`` only counts in ``machine`` mode."""

    get_op_s: float
    store_op_s: float
    rpc_s: float
    record_s: float
    message_s: float
    byte_s: float
    round_s_per_entry: float
    exchange_s_per_entry: float = 0.0
    emulator_byte_s: float = 0.0

    @classmethod
    def load(cls, path: Path) -> Costs:
        """From calibrate.py's JSON (its ``costs``); raises ValueError naming a missing or negative cost."""
        data = json.loads(path.read_text())
        costs = data.get("costs", data)
        values = {}
        for field in dataclasses.fields(cls):
            value = costs.get(field.name, 0.0 if field.name in ("emulator_byte_s", "exchange_s_per_entry") else None)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{path}: cost {field.name!r} must be a number >= 0, got {value!r}")
            values[field.name] = float(value)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One swarm: ``peers`` trainers with the same link, the bytes of the exchange and the compute per round."""

    peers: int
    rate_bps: float  # bytes per second each way; 0: unlimited
    rtt_s: float
    payload_bytes: float
    aggregate_bytes: float
    numel: int
    compute_s: float
    mode: str = "deployment"
    cores: int = 2
    rounds: int = 3
    bucket: int = 20
    replicas: int = 5


class Sim:
    """The event loop: callbacks at times, in order of time and then of scheduling."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), callback))

    def run(self) -> None:
        while self._queue:
            self.now, _, callback = heapq.heappop(self._queue)
            callback()


class Pool:
    """A processor-sharing server of ``capacity`` units (cores, or bytes per second for a link): ``n`` jobs each
    progress at ``min(1, capacity / n)`` units a second each, tracked in virtual time (a heap of finish marks)."""

    def __init__(self, sim: Sim, capacity: float) -> None:
        self.sim, self.capacity = sim, capacity
        self.virtual, self.updated, self.version = 0.0, 0.0, 0
        self.wake: float | None = None  # when the pending wake-up is due
        self.jobs: list[tuple[float, int, Callable[[], None]]] = []
        self.busy = 0.0  # work done so far

    def _rate(self) -> float:
        return min(1.0, self.capacity / len(self.jobs)) if self.jobs else 0.0

    def _advance(self) -> None:
        elapsed = self.sim.now - self.updated
        rate = self._rate()
        self.virtual += elapsed * rate
        self.busy += elapsed * rate * len(self.jobs)
        self.updated = self.sim.now

    def submit(self, work: float, callback: Callable[[], None]) -> None:
        """Run ``work`` units, then ``callback``; no work calls it at once (in order)."""
        if work <= 0 or self.capacity <= 0:
            self.sim.at(self.sim.now, callback)
            return
        self._advance()
        heapq.heappush(self.jobs, (self.virtual + work, next(self.sim._seq), callback))
        self._schedule()

    def _schedule(self) -> None:
        """Make sure a wake-up is due no later than the first job's finish. A job added later only slows the
        others down, so an earlier wake-up that finds nothing finished just schedules the next one."""
        if not self.jobs:
            return
        due = self.updated + (self.jobs[0][0] - self.virtual) / self._rate()
        if self.wake is not None and self.wake <= due + 1e-12:
            return
        self.version += 1
        self.wake, version = due, self.version
        self.sim.at(due, lambda: self._finish(version))

    def _finish(self, version: int) -> None:
        if version != self.version:
            return
        self.wake = None
        self._advance()
        while self.jobs and self.jobs[0][0] <= self.virtual + 1e-12:
            self.sim.at(self.sim.now, heapq.heappop(self.jobs)[2])
        self._schedule()


def _after_all(count: int, callback: Callable[[], None]) -> Callable[[], None]:
    """A callback that calls ``callback`` on its ``count``-th call."""
    left = [count]

    def done() -> None:
        left[0] -= 1
        if left[0] == 0:
            callback()

    return done


class Swarm:
    """The simulated swarm: nodes 0..P-1 are the trainers, node P the bootstrap (a DHT node only)."""

    def __init__(self, scenario: Scenario, costs: Costs) -> None:
        self.s, self.c = scenario, costs
        self.sim = Sim()
        nodes = scenario.peers + 1
        link = 1.0 if scenario.rate_bps > 0 else 0.0  # one link's full rate; work in seconds at that rate
        self.up = [Pool(self.sim, link) for _ in range(nodes)]
        self.down = [Pool(self.sim, link) for _ in range(nodes)]
        if scenario.mode == "machine":
            shared = Pool(self.sim, scenario.cores)
            self.cpu = [shared] * nodes
        else:
            self.cpu = [Pool(self.sim, scenario.cores) for _ in range(nodes)]
        self.hops = 1 if nodes <= scenario.bucket else 1 + math.ceil(math.log2(nodes / scenario.bucket))
        self.sent = [0.0] * nodes
        self.received = [0.0] * nodes
        self.requests = [0] * nodes
        self.sent_by_kind: dict[str, float] = {"dht": 0.0, "exchange": 0.0}  # bytes, all nodes together
        self.cpu_by_kind: dict[str, float] = {"dht": 0.0, "exchange": 0.0, "compute": 0.0, "emulator": 0.0}
        self.records: dict[str, dict[int, int]] = {}  # DHT key -> node -> the value of its record
        self.peers: list[Peer] = []
        self._holders: dict[str, list[int]] = {}

    # -- primitives ------------------------------------------------------------------------------------
    def work(self, node: int, seconds: float, kind: str, callback: Callable[[], None]) -> None:
        self.cpu_by_kind[kind] += seconds
        self.cpu[node].submit(seconds, callback)

    def send(self, src: int, dst: int, size: float, kind: str, callback: Callable[[], None]) -> None:
        """``size`` bytes from ``src`` to ``dst``: the links, the delay, and in machine mode the two emulators'
        CPU; ``callback`` once delivered (the endpoints' CPU is the caller's)."""
        self.sent[src] += size
        self.received[dst] += size
        self.sent_by_kind[kind] += size
        delay = self.s.rtt_s / 2
        parts = 2 + (2 if self.s.mode == "machine" else 0)
        delivered = _after_all(parts, callback)

        def left_uplink() -> None:
            self.sim.at(self.sim.now + delay, delivered)

        self.up[src].submit(size / self.s.rate_bps if self.s.rate_bps > 0 else 0.0, left_uplink)
        self.sim.at(
            self.sim.now + delay,
            lambda: self.down[dst].submit(size / self.s.rate_bps if self.s.rate_bps > 0 else 0.0, delivered),
        )
        if self.s.mode == "machine":
            emulated = size * self.c.emulator_byte_s
            self.work(src, emulated, "emulator", delivered)
            self.sim.at(self.sim.now + delay, lambda: self.work(dst, emulated, "emulator", delivered))

    def rpc(
        self,
        src: int,
        dst: int,
        request: float,
        reply_records: int,
        reply_record_bytes: float,
        done: Callable[[], None],
        arrived: Callable[[], None] | None = None,
    ) -> None:
        """One DHT request and its reply (``reply_records`` records of ``reply_record_bytes``); ``arrived`` when
        the request reaches the server."""
        half = self.c.rpc_s / 2
        record_cost = self.c.record_s * reply_records / 2
        reply = REQUEST_BYTES + reply_records * reply_record_bytes
        self.requests[src] += 1

        def at_server() -> None:
            if arrived is not None:
                arrived()
            self.work(dst, half + record_cost, "dht", lambda: self.send(dst, src, reply, "dht", at_client))

        def at_client() -> None:
            self.work(src, half + record_cost, "dht", done)

        self.send(src, dst, request, "dht", at_server)

    def holders(self, key: str) -> list[int]:
        """The ``replicas`` nodes nearest to ``key`` (a fixed pseudo-random choice per key)."""
        if key not in self._holders:
            nodes = self.s.peers + 1
            rank = sorted(range(nodes), key=lambda n: hashlib.blake2b(f"{key}/{n}".encode(), digest_size=8).digest())
            self._holders[key] = rank[: min(self.s.replicas, nodes)]
        return self._holders[key]

    def dht(
        self, node: int, key: str, value: int | None, record_bytes: float, done: Callable[[dict[int, int]], None]
    ) -> None:
        """A store of ``node``'s record (``value`` not None) or a read of ``key``: ``hops - 1`` lookups, then the
        key's holders at once. A store's record is visible from when its request reaches the first holder; a read
        sees the records as they were when its request reached the first holder (the reply size counts the records
        at its start). ``done`` gets the records seen (node -> value), once every holder has answered."""
        holders = self.holders(key)
        op_s = self.c.store_op_s if value is not None else self.c.get_op_s

        def last_hop() -> None:
            records = self.records.setdefault(key, {})
            seen: dict[int, int] = {}

            def first_arrival() -> None:
                if value is not None:
                    records[node] = max(value, records.get(node, value))
                elif not seen:
                    seen.update(records)

            finish = _after_all(len(holders), lambda: done(seen))
            arrived = _after_all(1, first_arrival)
            for h in holders:
                if value is not None:
                    self.rpc(node, h, REQUEST_BYTES + record_bytes, 0, 0.0, finish, arrived)
                else:
                    self.rpc(node, h, REQUEST_BYTES, len(records), record_bytes, finish, arrived)

        def hop(left: int) -> None:
            if left == 0:
                last_hop()
                return
            other = (node + 1 + left * 7919) % (self.s.peers + 1)
            self.rpc(node, other, REQUEST_BYTES, self.s.bucket, CONTACT_BYTES, lambda: hop(left - 1))

        self.work(node, op_s, "dht", lambda: hop(self.hops - 1))

    def poll(
        self,
        node: int,
        key: str,
        record_bytes: float,
        ready: Callable[[dict[int, int]], bool],
        then: Callable[[], None],
    ) -> None:
        """Read ``key`` every :data:`POLL_S` until ``ready(records)``, then ``then``."""

        def check(records: dict[int, int]) -> None:
            if ready(records):
                then()
            else:
                self.sim.at(self.sim.now + POLL_S, lambda: self.dht(node, key, None, record_bytes, check))

        self.dht(node, key, None, record_bytes, check)


class Peer:
    """One trainer's rounds (module docstring): each phase's start time per round."""

    def __init__(self, swarm: Swarm, index: int) -> None:
        self.w, self.i = swarm, index
        self.times: list[dict[str, float]] = []
        self.parts_in: dict[int, int] = {}
        self.aggregated: set[int] = set()
        self.waiting: dict[int, list[Callable[[], None]]] = {}

    def start_round(self, r: int) -> None:
        """Round ``r`` from its boundary to its end; the next round starts ``compute_s`` later."""
        w, s, me = self.w, self.w.s, self.i
        t = {"start": w.sim.now}
        self.times.append(t)
        half_round = s.numel * w.c.round_s_per_entry / 2
        others = [j for j in range(s.peers) if j != me]
        everyone: Callable[[dict[int, int]], bool] = lambda records: len(records) >= s.peers  # noqa: E731
        view_bytes = VIEW_BYTES[0] + VIEW_BYTES[1] * s.peers

        def caught_up(_: dict[int, int]) -> None:  # the pseudo-gradient, the selection
            w.work(me, half_round, "compute", register)

        def register() -> None:
            t["matchmaking"] = w.sim.now
            w.dht(me, f"peers/{r}", 1, RECORD_BYTES["peers"], expected)

        def expected(_: dict[int, int]) -> None:
            w.dht(
                me,
                "states",
                None,
                RECORD_BYTES["states"],
                lambda _: w.poll(me, f"peers/{r}", RECORD_BYTES["peers"], everyone, view_check),
            )

        def view_check() -> None:  # the whole list, then its digest; the digests are read
            w.dht(
                me,
                f"viewfull/{r}",
                1,
                view_bytes,
                lambda _: w.dht(
                    me,
                    f"view/{r}",
                    1,
                    RECORD_BYTES["view"],
                    lambda _: w.poll(me, f"view/{r}", RECORD_BYTES["view"], everyone, push),
                ),
            )

        third = s.numel * w.c.exchange_s_per_entry / 3  # the exchange's own passes over the model (Costs)

        def push() -> None:
            t["exchange"] = w.sim.now
            w.work(me, third, "compute", send_parts)  # the parts' encoding

        def send_parts() -> None:
            answered = _after_all(len(others), fetch)
            part = s.payload_bytes / s.peers + HEADER_BYTES
            self.part_arrived(r)  # its own
            for j in others:
                self.stream(j, part, lambda j=j: w.peers[j].part_arrived(r, reply_to=me, then=answered))

        def fetch() -> None:
            fetched = _after_all(len(others) + 1, lambda: w.work(me, third, "compute", apply))  # decoding
            self.when_aggregated(r, fetched)
            aggregate = s.aggregate_bytes / s.peers + HEADER_BYTES
            for j in others:
                w.send(
                    me,
                    j,
                    REQUEST_BYTES,
                    "exchange",
                    lambda j=j: w.peers[j].when_aggregated(r, lambda j=j: w.peers[j].stream(me, aggregate, fetched)),
                )

        def apply() -> None:  # decoding the aggregates, the outer step, the digest
            t["applied"] = w.sim.now
            w.work(me, half_round, "compute", publish)

        def publish() -> None:
            t["digest"] = w.sim.now
            w.dht(
                me,
                "states",
                r + 1,
                RECORD_BYTES["states"],
                lambda _: w.poll(
                    me,
                    "states",
                    RECORD_BYTES["states"],
                    lambda rec: sum(v >= r + 1 for v in rec.values()) >= s.peers,
                    finished,
                ),
            )

        def finished() -> None:
            t["end"] = w.sim.now
            if r + 1 < s.rounds:
                w.sim.at(w.sim.now + s.compute_s, lambda: self.start_round(r + 1))

        w.dht(me, "states", None, RECORD_BYTES["states"], caught_up)

    def stream(self, dst: int, size: float, done: Callable[[], None]) -> None:
        """An exchange stream of ``size`` bytes to ``dst``: the sender's CPU, the links, the receiver's CPU."""
        w = self.w
        half = w.c.message_s / 2 + w.c.byte_s * size / 2
        w.work(
            self.i,
            half,
            "exchange",
            lambda: w.send(self.i, dst, size, "exchange", lambda: w.work(dst, half, "exchange", done)),
        )

    def part_arrived(self, r: int, reply_to: int | None = None, then: Callable[[], None] | None = None) -> None:
        """A part of this owner's shard arrived (decoded as it is read); with every part, the sum."""
        w, s = self.w, self.w.s
        if reply_to is not None and then is not None:
            w.send(self.i, reply_to, REQUEST_BYTES, "exchange", then)
        self.parts_in[r] = self.parts_in.get(r, 0) + 1
        if self.parts_in[r] == s.peers:  # decoding and summing its shard: a third of the exchange's passes
            w.work(self.i, s.numel * w.c.exchange_s_per_entry / 3, "compute", lambda: self._aggregated(r))

    def _aggregated(self, r: int) -> None:
        self.aggregated.add(r)
        for callback in self.waiting.pop(r, []):
            callback()

    def when_aggregated(self, r: int, callback: Callable[[], None]) -> None:
        if r in self.aggregated:
            self.w.sim.at(self.w.sim.now, callback)
        else:
            self.waiting.setdefault(r, []).append(callback)


def simulate(scenario: Scenario, costs: Costs) -> dict[str, Any]:
    """Run ``scenario.rounds`` rounds of every peer (all start their first boundary at time 0) and summarize the
    rounds after the first (the first starts from empty DHT records and no queues): the median peer's round and
    its split, utilization, bytes and DHT requests per peer and round, and the CPU seconds per round by kind."""
    swarm = Swarm(scenario, costs)
    swarm.peers = [Peer(swarm, i) for i in range(scenario.peers)]
    for peer in swarm.peers:
        peer.start_round(0)
    swarm.sim.run()
    measured = range(1, scenario.rounds) if scenario.rounds > 1 else range(1)
    rows = [peer.times[r] for peer in swarm.peers for r in measured if "end" in peer.times[r]]
    if len(rows) < scenario.peers * len(measured):
        raise RuntimeError("the simulated swarm stalled: a round did not end (a bug in the model)")

    def median(start: str, stop: str) -> float:
        return statistics.median(row[stop] - row[start] for row in rows)

    round_s = median("start", "end")
    rounds = scenario.rounds
    per_peer = lambda values: statistics.fmean(values[: scenario.peers]) / rounds  # noqa: E731
    compute = scenario.compute_s
    return {
        "peers": scenario.peers,
        "mode": scenario.mode,
        "dht_hops": swarm.hops,
        "round_s": round_s,
        "matchmaking_s": median("matchmaking", "exchange"),
        "exchange_s": median("exchange", "applied"),
        "digest_s": median("digest", "end"),
        "other_s": median("start", "matchmaking"),
        "utilization_blocking": compute / (compute + round_s) if compute > 0 else None,
        "utilization_overlap": compute / (compute + max(0.0, round_s - compute)) if compute > 0 else None,
        "bytes_sent": per_peer(swarm.sent),
        "bytes_received": per_peer(swarm.received),
        "dht_requests": per_peer(swarm.requests),
        "bytes_sent_by_kind": {kind: total / scenario.peers / rounds for kind, total in swarm.sent_by_kind.items()},
        "cpu_s_per_round": {kind: seconds / rounds for kind, seconds in swarm.cpu_by_kind.items()},
        "sim_seconds": swarm.sim.now,
    }


def scenario_from_report(report: dict[str, Any], args: argparse.Namespace) -> tuple[Scenario, dict[str, Any]]:
    """A harness report's swarm as a scenario (its peers, rate, round trip, bytes, compute) and what it measured:
    the median over the middle rounds (not the first, whose matchmaking waits out ``matchmaking_time``, nor the
    last) of the per-round medians; raises ValueError naming a missing field."""
    try:
        config, rounds = report["config"], report["per_round"]
        peers = int(config["peers"])
        rate = parse_rate(config["rate"])
        middle = sorted(rounds, key=lambda r: r["round"])[1:-1] or rounds
        measured = {
            name: statistics.median(r[f"seconds_{name}"] for r in middle)
            for name in ("sync", "matchmaking", "exchange", "digest")
        }
        payload, aggregate = report_bytes(report)
        compute = config["inner_steps"] * config["step_seconds"]
        numel = int(report["numel"])
    except KeyError as exc:
        raise ValueError(f"the harness report lacks {exc}: run experiments/wan/swarm.py with --json") from None
    scenario = Scenario(
        peers=peers,
        rate_bps=rate,
        rtt_s=config["rtt_ms"] / 1000,
        payload_bytes=payload,
        aggregate_bytes=aggregate,
        numel=numel,
        compute_s=compute,
        mode="machine",
        cores=args.cores if args.cores else int(report.get("cpu", {}).get("cores", 2)),
        rounds=args.rounds,
    )
    cpu = report.get("cpu")
    if cpu is not None and all(p.get("cpu_inner_s") is not None for p in report["per_peer"]):
        inner = sum(p["cpu_inner_s"] for p in report["per_peer"])
        total = sum(kind["seconds"] for kind in cpu["by_kind"].values())
        measured["cpu_s_per_round"] = (total - inner) / config["rounds"]
        measured["emulator_cpu_s_per_round"] = cpu["by_kind"].get("emulator", {}).get("seconds", 0.0) / config["rounds"]
    return scenario, measured


def report_bytes(report: dict[str, Any]) -> tuple[float, float]:
    """A peer's whole part bytes and all aggregates' bytes for the sums exchange, from the bytes a peer sent per
    round (``(P - 1) / P`` of both), split evenly (with the pulse selector a peer's selection and the aggregates
    are both about the model's size: 6.6 and 7.0 MB in the 4-peer run's metrics)."""
    peers = int(report["config"]["peers"])
    sent = statistics.fmean(p["bytes_sent_per_round"] for p in report["per_peer"])
    whole = sent * peers / (peers - 1)
    return whole / 2, whole / 2


def parse_rate(text: str | float) -> float:
    """``100mbit``, ``1gbit``, ``500kbit`` or bits per second, as bytes per second (0: unlimited); raises
    ValueError."""
    value = str(text).strip().lower()
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0), ("", 1.0)):
        if value.endswith(suffix):
            number = value[: len(value) - len(suffix)] if suffix else value
            try:
                return float(number) * scale / 8
            except ValueError:
                break
    raise ValueError(f"bad rate {text!r}: use e.g. 100mbit, 1gbit or bits per second")


def _row_text(row: dict[str, Any], measured: dict[str, Any] | None = None) -> str:
    text = (
        f"{row['peers']:5d} peers ({row['mode']}, {row['dht_hops']} hops): round {row['round_s']:7.2f} s "
        f"(matchmaking {row['matchmaking_s']:.2f}, exchange {row['exchange_s']:.2f}, digest {row['digest_s']:.2f}, "
        f"before {row['other_s']:.2f}); sent {row['bytes_sent'] / 1e6:.2f} MB, received "
        f"{row['bytes_received'] / 1e6:.2f} MB, {row['dht_requests']:.0f} DHT requests per peer"
    )
    if row["utilization_blocking"] is not None:
        text += f"; utilization blocking {row['utilization_blocking']:.3f}, overlapped {row['utilization_overlap']:.3f}"
    if measured is not None:
        error = row["round_s"] / measured["sync"] - 1
        text += (
            f"\n        measured: round {measured['sync']:.2f} s (matchmaking {measured['matchmaking']:.2f}, exchange "
            f"{measured['exchange']:.2f}, digest {measured['digest']:.2f}); predicted/measured - 1 = {error:+.1%}"
        )
        if measured.get("cpu_s_per_round") is not None:
            predicted = sum(row["cpu_s_per_round"].values())
            text += (
                f"\n        CPU per round, all processes out of the inner steps: predicted {predicted:.1f} s, measured "
                f"{measured['cpu_s_per_round']:.1f} s (emulators {row['cpu_s_per_round']['emulator']:.1f} vs "
                f"{measured['emulator_cpu_s_per_round']:.1f})"
            )
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", type=Path, required=True, help="calibrate.py's JSON")
    parser.add_argument("--check", type=Path, nargs="*", default=[], help="swarm.py reports to predict and compare")
    parser.add_argument("--peers", default="", help="comma-separated peer counts to predict, e.g. 16,64,256,1024")
    parser.add_argument("--mode", choices=("machine", "deployment"), default="deployment")
    parser.add_argument("--cores", type=int, default=0, help="cores per pool (0: the report's, or 2 per peer)")
    parser.add_argument("--rate", default="100mbit", help="each link, each way")
    parser.add_argument("--rtt-ms", type=float, default=100.0)
    parser.add_argument("--payload-bytes", type=float, default=6.6e6, help="a peer's whole selection, as parts")
    parser.add_argument("--aggregate-bytes", type=float, default=7.0e6, help="every shard's aggregate together")
    parser.add_argument("--numel", type=int, default=2_100_225, help="parameter entries (the outer step's CPU)")
    parser.add_argument("--compute-s", type=float, default=32.0, help="inner-step seconds per round")
    parser.add_argument("--rounds", type=int, default=3, help="simulated rounds (the first is not summarized)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first round is not summarized)")
    try:
        peers = [int(p) for p in args.peers.split(",") if p.strip()]
        rate = parse_rate(args.rate)
    except ValueError as exc:
        parser.error(str(exc))
    if any(p < 2 for p in peers) or args.rtt_ms < 0 or args.compute_s < 0:
        parser.error("--peers must be at least 2 each, --rtt-ms and --compute-s at least 0")
    costs = Costs.load(args.costs)
    rows: list[dict[str, Any]] = []
    for path in args.check:
        scenario, measured = scenario_from_report(json.loads(path.read_text()), args)
        row = simulate(scenario, costs)
        row.update(report=str(path), measured=measured, error=row["round_s"] / measured["sync"] - 1)
        rows.append(row)
        print(_row_text(row, measured), flush=True)
    for count in peers:
        scenario = Scenario(
            peers=count,
            rate_bps=rate,
            rtt_s=args.rtt_ms / 1000,
            payload_bytes=args.payload_bytes,
            aggregate_bytes=args.aggregate_bytes,
            numel=args.numel,
            compute_s=args.compute_s,
            mode=args.mode,
            cores=args.cores or 2,
            rounds=args.rounds,
        )
        row = simulate(scenario, costs)
        rows.append(row)
        print(_row_text(row), flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"argv": sys.argv[1:], "costs": dataclasses.asdict(costs), "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
