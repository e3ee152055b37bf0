#!/usr/bin/env python
"""Benchmark PULSESync end to end: patches against full BF16 checkpoints over the same swarm, in the same run.

Setup (every peer is a process of its own, with its own hivemind DHT and libp2p daemon):
  * trainer + publisher: a Qwen2 (Llama-style) model built from a config with random init (~122M parameters,
    FP32 master weights), AdamW (lr 3e-6, no weight decay) on a synthetic LM loss over seeded random token ids.
    Version 1 is the initial model (an anchor: a warm-up, not counted); each measured version is one optimizer
    step followed by ``Publisher.publish(model)``.
  * subscribers (rollout workers): ``Subscriber.follow`` on a BF16 state dict; each reports to the coordinator
    the time at which it holds a version and the digest of the tensors it holds.
  * modes: ``patches`` (the library defaults: an anchor every 10 versions, patches otherwise, subscribers relay
    to each other) and ``full`` (the baseline: ``Publisher(anchor_every=1)`` and
    ``Subscriber(full_checkpoints=True)``, a full BF16 checkpoint per version over the same transport and relays).
  * conditions: ``loopback`` (127.0.0.1) and, when running as root with ``ip netns`` and ``tc``, a private
    network: one namespace per peer (the publisher's too), veth pairs to a bridge in a hub namespace on
    10.77.0.0/24, and a token bucket (``tc tbf``) at --rate on both ends of every veth, so each peer's uplink
    and downlink are limited. Nothing is configured outside the namespaces this script creates, and they are
    removed on exit (also on errors and Ctrl-C).

Per version the coordinator measures: the patch (or checkpoint) size in the version store against a full BF16
copy (2 bytes per element), the publisher's upload (the growth of ``Publisher.bytes_uploaded`` until every
subscriber holds the version), the seconds from the ``publish`` call to the publisher having encoded, stored and
announced the version ("encode"), and to the last subscriber holding it ("latency"), and whether every
subscriber's digest equals the publisher's.

Prints a table per condition and a summary (patches vs full checkpoints); ``--json PATH`` writes everything.
Progress goes to stderr; worker logs go to files under a temporary directory (printed on failure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import REPO, channel, memory, procs
from harness.logs import progress
from harness.machine import library_revision
from harness.models import MODEL_CONFIGS, SyntheticLM, state_shapes
from harness.netns import NetNS, open_netns, parse_rate, rate_label
from harness.report import Column, comma_list, fixed_table, parse_ints

LR = 3e-6
BATCH_SIZE = 2
SEQ_LEN = 64
MODES = ("patches", "full")
STARTUP_TIMEOUT = 300.0  # importing torch/transformers/hivemind in 9 processes on 2 shared cores is slow
STOP_TIMEOUT = 30.0
GB = memory.GB
MEMORY_MARGIN = 2 * GB
"""Memory left for everything else on the machine when deciding whether a case fits."""

log = progress("bench_sync")


# --------------------------------------------------------------------------------------------------
# Workers (one process per peer; started by the coordinator, possibly inside a network namespace)
# --------------------------------------------------------------------------------------------------


@dataclass
class WorkerSpec:
    """Everything a worker process needs, written as JSON by the coordinator."""

    role: str  # "publisher" or "subscriber"
    index: int  # 0 for the publisher, 1..N for subscribers
    socket: str  # the coordinator's AF_UNIX socket (works across network namespaces)
    run_id: str
    config: str
    host: str  # the address the peer's libp2p daemon listens on
    full: bool  # full-checkpoint baseline
    key_path: str  # private key (publisher) or public key (subscribers)
    shapes_path: str = ""  # subscribers: JSON of state_shapes (so they need not import transformers)
    store_dir: str = ""
    seed: int = 0
    lr: float = LR
    poll: float = 0.2
    fetch_timeout: float = 600.0
    relay_wait: float | None = None  # None: the library's SwarmSource default
    relay_max_bytes: int | None = None  # None: the library's Subscriber default
    threads: int | None = None


def _worker_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    logging.getLogger("pulseloco.sync.store").setLevel(logging.WARNING)


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def publisher_worker(spec: WorkerSpec) -> None:
    """The trainer: build the model, then answer the coordinator's publish/stats/stop requests."""
    _worker_logging()
    conn, send = channel.connect(spec.socket, spec.role, spec.index)
    import torch

    from pulseloco.swarm import SwarmConfig, make_dht
    from pulseloco.sync.publisher import Publisher
    from pulseloco.sync.signing import load_private_key

    if spec.threads:
        torch.set_num_threads(spec.threads)
    training = SyntheticLM(spec.config, spec.seed, spec.lr, batch_size=BATCH_SIZE, seq_len=SEQ_LEN)
    model = training.model
    num_elements = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
    dht = make_dht(SwarmConfig(host_maddrs=[f"/ip4/{spec.host}/tcp/0"]))
    publisher = Publisher(
        dht, spec.run_id, load_private_key(spec.key_path), spec.store_dir, anchor_every=1 if spec.full else 10
    )
    store = Path(spec.store_dir)
    send(
        (
            "ready",
            {
                "maddrs": [str(m) for m in dht.get_visible_maddrs()],
                "num_params": sum(p.numel() for p in model.parameters()),
                "num_elements": num_elements,
                "threads": torch.get_num_threads(),
                "peer_id": publisher.endpoint.peer_id.to_base58() if publisher.endpoint else "",
            },
        )
    )
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "stats":
                servicer = publisher.endpoint.servicer if publisher.endpoint else None
                send(("stats", {"bytes_uploaded": publisher.bytes_uploaded, "uploads": servicer.num_uploads}))
            elif msg[0] == "publish":
                step_s = loss = None
                if msg[1]:  # one optimizer step first (its gradients freed while the version is published)
                    loss, step_s = training.step()
                t_call = time.time()
                version = publisher.publish(model)
                t_returned = time.time()
                publisher.flush(timeout=900)
                t_ready = time.time()
                if publisher.version != version:
                    raise RuntimeError(f"version {version} was not published: {publisher.last_error!r}")
                send(
                    (
                        "published",
                        {
                            "version": version,
                            "digest": publisher.digest,
                            "t_call": t_call,
                            "publish_call_s": t_returned - t_call,
                            "encode_s": t_ready - t_call,
                            "patch_bytes": _file_size(store / f"v{version:08d}.patch"),
                            "anchor_bytes": _file_size(store / f"v{version:08d}.anchor"),
                            "step_s": step_s,
                            "loss": loss,
                        },
                    )
                )
    except EOFError:
        logging.getLogger(__name__).warning("coordinator went away; stopping")
    finally:
        publisher.close(timeout=10)
        dht.shutdown()


def subscriber_worker(spec: WorkerSpec) -> None:
    """A rollout worker: join the publisher's swarm, follow the run, report every version it holds."""
    _worker_logging()
    conn, send = channel.connect(spec.socket, spec.role, spec.index)
    import torch

    from pulseloco.swarm import SwarmConfig, make_dht
    from pulseloco.sync import state_digest
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber

    torch.set_num_threads(spec.threads or 1)
    # Workaround: Subscriber.update on an empty dict adopts the anchor into a copy of the dict, so the caller's
    # dict stays empty and every later update downloads the anchor again. Like a rollout worker holding a
    # model, the subscriber gets zeroed BF16 tensors of the right names and shapes, which the anchor overwrites.
    shapes = json.loads(Path(spec.shapes_path).read_text())
    state = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    msg = conn.recv()
    if msg[0] != "join":
        return
    dht = make_dht(SwarmConfig(initial_peers=msg[1], host_maddrs=[f"/ip4/{spec.host}/tcp/0"]))
    options = {} if spec.relay_max_bytes is None else {"relay_max_bytes": spec.relay_max_bytes}
    sub = Subscriber(
        dht,
        spec.run_id,
        load_public_key(spec.key_path),
        full_checkpoints=spec.full,
        timeout=spec.fetch_timeout,
        **options,
    )
    if spec.relay_wait is not None:
        sub.source.relay_wait = spec.relay_wait
    swarm_source = sub.source
    if spec.full:
        # Workaround: the relay keeps its last 16 objects in memory whatever their size; in this mode they are
        # full checkpoints (16 x 2 bytes per parameter). Only the newest is ever requested here.
        sub.relay.capacity = 1

    def on_update(report: Any) -> None:
        t_hold = report.held_at or time.time()  # when the model held it (before the report's second head read)
        with sub.lock:
            digest = state_digest(state)  # the tensors this worker holds, not the subscriber's bookkeeping
        # who served the object of this version (the last fetch of it: the patch, squash or anchor)
        served = [peer for _, version, peer in list(swarm_source.served_by) if version == report.version]
        send(
            (
                "holds",
                {
                    "version": report.version,
                    "t": t_hold,
                    "digest": digest,
                    "reported_digest": report.digest,
                    "bytes_received": report.bytes_received,
                    "path": report.path,
                    "update_s": report.seconds,
                    "served_by": served[-1] if served else None,
                },
            )
        )

    send(("joined", {"peer_id": sub.endpoint.peer_id.to_base58() if sub.endpoint else ""}))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "follow":
                sub.follow(state, on_update, interval=spec.poll)
    except EOFError:
        logging.getLogger(__name__).warning("coordinator went away; stopping")
    finally:
        sub.close()
        dht.shutdown()


# --------------------------------------------------------------------------------------------------
# Memory (the machine is shared: a case that would not fit is skipped, never left to the OOM killer)
# --------------------------------------------------------------------------------------------------


def estimate_memory(
    num_elements: int, n_subs: int, mode: str, *, warmup_batch: int = 1, relay_max_bytes: float | None = None
) -> float:
    """Peak bytes of one case, from measurements of this script (USS of each process and its helpers).

    With F = one BF16 copy: the trainer and publisher about 1.2 GB + 10 F (FP32 weights and AdamW moments,
    BF16 snapshots, the anchor being encoded) plus one F per payload it serves at once (the store reads the
    whole object per request). A subscriber about 0.7 GB (torch, its DHT process, libp2p daemon) + its state
    and its relay's copy of the anchor (F, or nothing when ``relay_max_bytes`` is below F, then only patches);
    receiving a checkpoint adds about 2.5 F at once (the chunks and their join, the decoded anchor, the backup
    kept until the update verifies). In full mode every subscriber receives a checkpoint per version at about
    the same time; with patches only during the warm-up, ``warmup_batch`` subscribers at a time.
    Measured (122M model, F = 245 MB, 100 Mbit/s): 16 subscribers with relays keeping the anchor peaked at
    about 20 GB at the end of the warm-up.
    """
    f = 2 * num_elements
    relay = f if relay_max_bytes is None or relay_max_bytes >= f else relay_max_bytes
    if mode == "full":
        return 1.2 * GB + 10 * f + n_subs * f + n_subs * (0.7 * GB + 4.5 * f)
    return 1.2 * GB + 12 * f + n_subs * (0.7 * GB + f + relay) + 2.5 * f * min(warmup_batch, n_subs)


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass
class VersionResult:
    version: int
    counted: bool  # False for the initial anchor (warm-up)
    t_call: float
    publish_call_s: float
    encode_s: float
    step_s: float | None
    loss: float | None
    patch_bytes: int | None
    anchor_bytes: int | None
    object_bytes: int  # what subscribers fetch per version in this mode: the patch, or the full checkpoint
    publisher_digest: str
    latency_s: float  # publish call -> last subscriber holds the version
    first_latency_s: float
    mean_latency_s: float
    upload_bytes: int
    uploads: int
    digests_match: bool
    subscribers: list[dict[str, Any]] = field(default_factory=list)
    # the relay tree this version formed: depth of the deepest subscriber (publisher 0; None when a provider was
    # not one of the case's peers), and the bound "minimal tree depth x transfer time at --rate" (None on loopback)
    tree_depth: int | None = None
    min_depth: int = 0
    transfer_s: float | None = None
    bound_s: float | None = None


@dataclass
class CaseResult:
    condition: str
    subscribers: int
    mode: str
    num_params: int
    num_elements: int
    full_bf16_bytes: int
    versions: list[VersionResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    library: dict[str, Any] = field(default_factory=dict)  # revision when the workers started (it may change)
    peers: dict[str, int] = field(default_factory=dict)  # libp2p peer id -> worker index (publisher 0)

    def counted(self) -> list[VersionResult]:
        return [v for v in self.versions if v.counted]

    @property
    def all_digests_match(self) -> bool:
        return bool(self.versions) and all(v.digests_match for v in self.versions)

    def summary(self) -> dict[str, Any]:
        vs = self.counted()
        if not vs:
            return {}
        mean_obj = statistics.mean(v.object_bytes for v in vs)
        mean_up = statistics.mean(v.upload_bytes for v in vs)
        return {
            "versions": len(vs),
            "mean_object_bytes": mean_obj,
            "ratio_vs_full_bf16": mean_obj / self.full_bf16_bytes,
            "mean_upload_bytes": mean_up,
            "upload_x_object": mean_up / mean_obj,
            "max_upload_x_object": max(v.upload_bytes / v.object_bytes for v in vs),
            "mean_encode_s": statistics.mean(v.encode_s for v in vs),
            "mean_latency_s": statistics.mean(v.latency_s for v in vs),
            "median_latency_s": statistics.median(v.latency_s for v in vs),
            "max_latency_s": max(v.latency_s for v in vs),
            "all_digests_match": all(v.digests_match for v in vs),
            "digests_matched": sum(v.digests_match for v in vs),
            "mean_received_bytes": statistics.mean(h["bytes_received"] for v in vs for h in v.subscribers),
            # subscriber updates that did not take the mode's path (a patch, or a checkpoint in full mode)
            "off_path_updates": sum(
                h["path"] != ("anchor" if self.mode == "full" else "patch") for v in vs for h in v.subscribers
            ),
            **self.bound_summary(),
        }

    def bound_summary(self) -> dict[str, Any]:
        """Latency against the bound of issue 14 (minimal relay-tree depth x one transfer at the link rate)."""
        vs = [v for v in self.counted() if v.bound_s]
        if not vs:
            return {}
        ratios = [v.latency_s / v.bound_s for v in vs if v.bound_s]
        after = [(v.latency_s - v.encode_s) / v.bound_s for v in vs if v.bound_s]
        depths = [v.tree_depth for v in vs if v.tree_depth is not None]
        return {
            "min_depth": vs[0].min_depth,
            "formed_depth_max": max(depths) if depths else None,
            "mean_transfer_s": statistics.mean(v.transfer_s or 0.0 for v in vs),
            "mean_bound_s": statistics.mean(v.bound_s or 0.0 for v in vs),
            "mean_ratio": statistics.mean(ratios),
            "max_ratio": max(ratios),
            "mean_latency_after_encode_s": statistics.mean(v.latency_s - v.encode_s for v in vs),
            "mean_ratio_after_encode": statistics.mean(after),
        }


class WorkerFailed(RuntimeError):
    pass


@dataclass
class Worker:
    role: str
    index: int
    proc: procs.Proc


class Coordinator:
    """Starts each case's workers, drives them over the hub and measures every version."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from pulseloco.sync.signing import generate_key, save_keypair

        self.args = args
        self.workdir = workdir
        self.hub = channel.Hub(workdir / "hub.sock")
        self.key_path, self.pub_path = save_keypair(generate_key(), workdir / "publisher.key")
        self.workers: list[Worker] = []
        self.case_counter = 0
        self.current_case: CaseResult | None = None  # the case being measured; kept when it fails halfway
        config = "small" if args.small else "default"
        self.shapes_path = workdir / f"shapes-{config}.json"
        shapes = state_shapes(config)
        self.num_elements = sum(math.prod(shape) for shape in shapes.values())
        self.shapes_path.write_text(json.dumps(shapes))

    def close(self) -> None:
        self.stop_workers()
        self.hub.close()

    # ---- workers -----------------------------------------------------------------------------------------

    def start_worker(self, spec: WorkerSpec, runner: procs.Runner) -> Worker:
        """Write ``spec`` and start its worker (in its peer's namespace when the runner has a network); its log is
        ``case<N>-<role><index>.log`` beside the spec."""
        name = f"case{self.case_counter}-{spec.role}{spec.index}"
        spec_path = self.workdir / f"{name}.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--role", spec.role, "--spec", str(spec_path)]
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**self.hub.worker_env(), "PYTHONPATH": pythonpath}
        worker = Worker(spec.role, spec.index, runner.start(name, cmd, ns_index=spec.index, env=env))
        self.workers.append(worker)
        return worker

    def stop_workers(self) -> None:
        """Ask every worker to stop, wait (bounded), then stop each one's process group (which also holds its DHT
        process and libp2p daemon)."""
        started = time.monotonic()
        for w in self.workers:
            if w.proc.running:
                with contextlib.suppress(Exception):
                    self.hub.send(w.role, w.index, ("stop",))
        procs.wait_exited([w.proc for w in self.workers], STOP_TIMEOUT)
        procs.stop_all([w.proc for w in self.workers], grace=1.0)
        if self.workers:
            log(f"stopped {len(self.workers)} workers in {time.monotonic() - started:.1f} s")
        self.workers = []
        self.hub.forget()  # the connections and messages of the finished case

    def _check_alive(self) -> None:
        for w in self.workers:
            code = w.proc.poll()
            if code is not None:
                raise WorkerFailed(
                    f"{w.role} {w.index} exited with code {code}; log {w.proc.log_path}:\n{w.proc.tail(30)}"
                )

    def next_message(self, deadline: float, what: str, case: CaseResult | None) -> tuple[str, int, tuple]:
        """The next message from any worker; warnings are collected into ``case``. Raises on timeout/death."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                tails = "\n".join(
                    f"--- {w.role} {w.index} ({w.proc.log_path}):\n{w.proc.tail(15)}" for w in self.workers
                )
                raise TimeoutError(f"timed out waiting for {what}\n{tails}")
            got = self.hub.get(timeout=min(1.0, remaining))
            if got is None:
                self._check_alive()
                continue
            role, index, msg = got
            if msg[0] == "warning":
                if case is not None:
                    case.warnings.append(f"{role}{index}: {msg[1]}")
                continue
            if msg[0] == "eof":
                self._check_alive()
                time.sleep(1.0)
                self._check_alive()
                raise WorkerFailed(f"{role} {index} closed its connection")
            return role, index, msg

    def request(self, msg: tuple, reply: str, timeout: float, case: CaseResult) -> dict[str, Any]:
        """Send ``msg`` to the publisher and wait for its ``reply``; only warnings may arrive meanwhile."""
        self.hub.send("publisher", 0, msg)
        deadline = time.monotonic() + timeout
        while True:
            role, index, got = self.next_message(deadline, f"publisher reply {reply}", case)
            if role == "publisher" and got[0] == reply:
                return got[1]
            raise WorkerFailed(f"unexpected message from {role} {index} while waiting for {reply}: {got[0]}")

    # ---- one case ----------------------------------------------------------------------------------------

    def run_case(self, condition: str, netns: NetNS | None, n_subs: int, mode: str) -> CaseResult:
        """Measure one case: start the publisher and ``n_subs`` subscribers, publish the initial anchor and
        ``--versions`` versions, stop them. Raises WorkerFailed or TimeoutError (the case so far stays in
        ``current_case``)."""
        args = self.args
        self.case_counter += 1
        store_dir = self.workdir / f"store{self.case_counter}"
        started = time.perf_counter()
        runner = procs.Runner(self.workdir, netns=netns)
        try:
            case = self._start_case(runner, condition, n_subs, mode, store_dir)
            uploaded = self.request(("stats",), "stats", 60, case)
            for k in range(args.versions + 1):
                v, uploaded_bytes, uploads = self.one_version(case, step=k > 0, uploaded_before=uploaded, n_subs=n_subs)
                uploaded = {"bytes_uploaded": uploaded_bytes, "uploads": uploads}
                case.versions.append(v)
                log(
                    f"{condition} subscribers={n_subs} mode={mode} v{v.version}{'' if v.counted else ' (initial)'}: "
                    f"{v.object_bytes / 1e6:.3f} MB ({v.object_bytes / case.full_bf16_bytes:.4f} of BF16), "
                    f"upload {v.upload_bytes / 1e6:.3f} MB ({v.upload_bytes / v.object_bytes:.2f}x), "
                    f"encode {v.encode_s:.2f} s, last subscriber {v.latency_s:.2f} s, "
                    f"digests {'ok' if v.digests_match else 'MISMATCH'}"
                )
        finally:
            self.stop_workers()
            shutil.rmtree(store_dir, ignore_errors=True)
        case.seconds = time.perf_counter() - started
        return case

    def _start_case(self, runner: procs.Runner, condition: str, n_subs: int, mode: str, store_dir: Path) -> CaseResult:
        """Start the case's workers, wait until the publisher is ready and every subscriber joined its swarm."""
        args = self.args
        run_id = f"bench-{os.getpid()}-{self.case_counter}-{condition}-{n_subs}-{mode}"
        common = dict(
            socket=self.hub.path,
            run_id=run_id,
            config="small" if args.small else "default",
            full=mode == "full",
            seed=args.seed,
            poll=args.poll,
            fetch_timeout=args.fetch_timeout,
            relay_wait=args.relay_wait,
            relay_max_bytes=None if args.relay_max_mb is None else int(args.relay_max_mb * 1e6),
        )

        def host(i: int) -> str:
            return runner.netns.host(i) if runner.netns is not None else "127.0.0.1"

        publisher = WorkerSpec(
            role="publisher", index=0, host=host(0), key_path=str(self.key_path), store_dir=str(store_dir),
            lr=args.lr, **common,
        )  # fmt: skip
        self.start_worker(publisher, runner)
        for i in range(1, n_subs + 1):
            subscriber = WorkerSpec(
                role="subscriber", index=i, host=host(i), key_path=str(self.pub_path),
                shapes_path=str(self.shapes_path), **common,
            )  # fmt: skip
            self.start_worker(subscriber, runner)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        info: dict[str, Any] | None = None
        hellos: set[int] = set()
        while info is None or len(hellos) < n_subs:
            role, index, msg = self.next_message(deadline, "workers to start", None)
            if role == "publisher" and msg[0] == "ready":
                info = msg[1]
            elif role == "subscriber" and msg[0] == "hello":
                hellos.add(index)
        case = CaseResult(
            condition=condition,
            subscribers=n_subs,
            mode=mode,
            num_params=info["num_params"],
            num_elements=info["num_elements"],
            full_bf16_bytes=2 * info["num_elements"],
            library=library_revision(),
        )
        case.peers[info["peer_id"]] = 0
        self.current_case = case
        for i in range(1, n_subs + 1):
            self.hub.send("subscriber", i, ("join", info["maddrs"]))
        joined: set[int] = set()
        while len(joined) < n_subs:
            role, index, msg = self.next_message(deadline, "subscribers to join", case)
            if role == "subscriber" and msg[0] == "joined":
                joined.add(index)
                case.peers[msg[1]["peer_id"]] = index
        log(
            f"{condition} subscribers={n_subs} mode={mode}: {n_subs + 1} peers up "
            f"({info['num_params'] / 1e6:.1f}M params, trainer threads={info['threads']})"
        )
        return case

    def one_version(
        self, case: CaseResult, *, step: bool, uploaded_before: dict[str, int], n_subs: int
    ) -> tuple[VersionResult, int, int]:
        """Publish one version (after an optimizer step if ``step``) and wait until every subscriber holds it.

        The initial version (``step=False``) is the warm-up: subscribers start following one at a time, each
        after the previous one holds it, so that only one of them holds a checkpoint in flight at once (memory).
        Returns the result and the publisher's upload counters afterwards.
        """
        self.hub.send("publisher", 0, ("publish", step))
        deadline = time.monotonic() + self.args.version_timeout
        pub: dict[str, Any] | None = None
        reports: dict[int, dict[str, Any]] = {}
        started = 0
        if not step:  # the warm-up starts subscribers in batches (memory: each receives a full anchor)
            for started in range(1, min(self.args.warmup_batch, n_subs) + 1):
                self.hub.send("subscriber", started, ("follow",))
        # Subscribers may hold the version before the publisher's own reply (it comes after ``flush``).
        while pub is None or len(reports) < n_subs:
            role, index, msg = self.next_message(deadline, "the publisher and all subscribers to hold a version", case)
            if role == "publisher" and msg[0] == "published":
                pub = msg[1]
            elif role == "subscriber" and msg[0] == "holds":
                if index in reports:
                    raise WorkerFailed(f"subscriber {index} reports two versions for one publish: {msg[1]['version']}")
                reports[index] = msg[1]
                if not step and started < n_subs:
                    started += 1
                    self.hub.send("subscriber", started, ("follow",))
            else:
                raise WorkerFailed(f"unexpected message from {role} {index}: {msg[0]}")
        version = pub["version"]
        holds: dict[int, dict[str, Any]] = {}
        for index, report in reports.items():
            if report["version"] != version:
                raise WorkerFailed(f"subscriber {index} reports version {report['version']}, expected {version}")
            holds[index] = {"index": index, "latency_s": report["t"] - pub["t_call"], **report}
        stats = self.request(("stats",), "stats", 60, case)
        latencies = [h["latency_s"] for h in holds.values()]
        parents = {i: case.peers.get(h.get("served_by") or "") for i, h in holds.items()}
        for i, h in holds.items():
            h["parent"] = parents[i]
        full = case.mode == "full"
        object_bytes = pub["anchor_bytes"] if (full or not step) else pub["patch_bytes"]
        if object_bytes is None:
            raise WorkerFailed(f"version {version} has no {'anchor' if full else 'patch'} in the store")
        result = VersionResult(
            version=version,
            counted=step,
            t_call=pub["t_call"],
            publish_call_s=pub["publish_call_s"],
            encode_s=pub["encode_s"],
            step_s=pub["step_s"],
            loss=pub["loss"],
            patch_bytes=pub["patch_bytes"],
            anchor_bytes=pub["anchor_bytes"],
            object_bytes=object_bytes,
            publisher_digest=pub["digest"],
            latency_s=max(latencies),
            first_latency_s=min(latencies),
            mean_latency_s=statistics.mean(latencies),
            upload_bytes=stats["bytes_uploaded"] - uploaded_before["bytes_uploaded"],
            uploads=stats["uploads"] - uploaded_before["uploads"],
            digests_match=all(
                h["digest"] == pub["digest"] and h["reported_digest"] == pub["digest"] for h in holds.values()
            ),
            subscribers=[holds[i] for i in sorted(holds)],
            tree_depth=tree_depth(parents),
            min_depth=min_tree_depth(n_subs),
        )
        rate = parse_rate(self.args.rate)
        if case.condition != "loopback" and rate:
            result.transfer_s = object_bytes * 8 / rate
            result.bound_s = result.min_depth * result.transfer_s
        return result, stats["bytes_uploaded"], stats["uploads"]


# --------------------------------------------------------------------------------------------------
# The bound of issue 14: tree depth x one transfer
# --------------------------------------------------------------------------------------------------

PUBLISHER_FANOUT = 2  # Publisher(max_uploads_per_version=2)
TARGET_RATIO = 1.5


def min_tree_depth(n_subs: int, fanout: int = PUBLISHER_FANOUT) -> int:
    """The smallest depth d of a relay tree in which the publisher serves ``fanout`` subscribers and every
    subscriber then serves ``fanout`` others: fanout + fanout^2 + ... + fanout^d >= n_subs."""
    depth, reached, level = 0, 0, 1
    while reached < n_subs:
        depth += 1
        level *= fanout
        reached += level
    return depth


def tree_depth(parents: dict[int, int | None]) -> int | None:
    """Depth of the tree formed by ``{subscriber: index of the peer that served it}`` (publisher 0); None when a
    provider is unknown or the parents do not form a tree rooted at the publisher."""
    depths: dict[int, int] = {0: 0}

    def depth(i: int, seen: frozenset[int]) -> int | None:
        if i in depths:
            return depths[i]
        parent = parents.get(i)
        if parent is None or parent in seen:
            return None
        d = depth(parent, seen | {i})
        if d is None:
            return None
        depths[i] = d + 1
        return d + 1

    found = [depth(i, frozenset()) for i in parents]
    return None if not found or any(d is None for d in found) else max(d for d in found if d is not None)


Measured = tuple[CaseResult, dict[str, Any]]
"""A case and its :meth:`CaseResult.summary`: a row of the tables."""
CASE_COLUMNS: list[Column[Measured]] = [
    ("subs", 4, lambda cs: str(cs[0].subscribers)),
    ("mode", 7, lambda cs: cs[0].mode),
]
"""The label columns of both tables: subscribers and mode."""


def measured(cases: list[CaseResult]) -> list[Measured]:
    """The cases that measured at least one counted version, with their summaries."""
    return [(c, s) for c, s in ((c, c.summary()) for c in cases) if s]


BOUND_COLUMNS: list[Column[Measured]] = [
    *CASE_COLUMNS,
    ("depth_min", 9, lambda cs: str(cs[1]["min_depth"])),
    ("depth_formed", 12, lambda cs: "?" if cs[1]["formed_depth_max"] is None else str(cs[1]["formed_depth_max"])),
    ("transfer_s", 10, lambda cs: f"{cs[1]['mean_transfer_s']:.2f}"),
    ("bound_s", 7, lambda cs: f"{cs[1]['mean_bound_s']:.2f}"),
    ("latency_mean_s", 14, lambda cs: f"{cs[1]['mean_latency_s']:.2f}"),
    ("ratio_mean", 10, lambda cs: f"{cs[1]['mean_ratio']:.2f}"),
    ("ratio_max", 9, lambda cs: f"{cs[1]['max_ratio']:.2f}"),
    ("after_encode_s", 14, lambda cs: f"{cs[1]['mean_latency_after_encode_s']:.2f}"),
    ("ratio_after_encode", 18, lambda cs: f"{cs[1]['mean_ratio_after_encode']:.2f}"),
    ("upload_x_obj", 12, lambda cs: f"{cs[1]['upload_x_object']:.2f}"),
    ("target(<=1.5)", 13, lambda cs: "met" if cs[1]["mean_ratio"] <= TARGET_RATIO else "MISSED"),
]


def format_bound_table(cases: list[CaseResult]) -> str:
    return fixed_table(BOUND_COLUMNS, [(c, s) for c, s in measured(cases) if "mean_ratio" in s])


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------

COLUMNS: list[Column[Measured]] = [
    *CASE_COLUMNS,
    ("versions", 8, lambda cs: str(cs[1]["versions"])),
    ("MB/version", 10, lambda cs: f"{cs[1]['mean_object_bytes'] / 1e6:.3f}"),
    ("vs_full_bf16", 12, lambda cs: f"{cs[1]['ratio_vs_full_bf16']:.5f}"),
    ("upload_MB/v", 11, lambda cs: f"{cs[1]['mean_upload_bytes'] / 1e6:.3f}"),
    ("upload_x_obj", 12, lambda cs: f"{cs[1]['upload_x_object']:.2f}"),
    ("max_x_obj", 9, lambda cs: f"{cs[1]['max_upload_x_object']:.2f}"),
    ("encode_s", 8, lambda cs: f"{cs[1]['mean_encode_s']:.2f}"),
    ("latency_mean_s", 14, lambda cs: f"{cs[1]['mean_latency_s']:.2f}"),
    ("latency_max_s", 13, lambda cs: f"{cs[1]['max_latency_s']:.2f}"),
    ("recv_MB/sub", 11, lambda cs: f"{cs[1]['mean_received_bytes'] / 1e6:.3f}"),
    ("off_path", 8, lambda cs: str(cs[1]["off_path_updates"])),
    ("digests", 7, lambda cs: f"{cs[1]['digests_matched']}/{cs[1]['versions']}"),
]


def format_table(cases: list[CaseResult]) -> str:
    """A line per measured case, a blank line between subscriber counts."""
    return fixed_table(COLUMNS, measured(cases), group=lambda cs: cs[0].subscribers)


def summarize(cases: list[CaseResult]) -> list[dict[str, Any]]:
    """Patches vs full checkpoints for each (condition, subscriber count) measured in both modes."""
    out = []
    by = {(c.condition, c.subscribers, c.mode): c for c in cases}
    for (cond, n, mode), patches in by.items():
        full = by.get((cond, n, "full"))
        if mode != "patches" or full is None or not patches.counted() or not full.counted():
            continue
        p, f = patches.summary(), full.summary()
        out.append(
            {
                "condition": cond,
                "subscribers": n,
                "patches_mean_latency_s": p["mean_latency_s"],
                "full_mean_latency_s": f["mean_latency_s"],
                "latency_speedup": f["mean_latency_s"] / p["mean_latency_s"],
                "max_latency_speedup": f["max_latency_s"] / p["max_latency_s"],
                "bytes_ratio": p["mean_object_bytes"] / f["mean_object_bytes"],
                "upload_ratio": p["mean_upload_bytes"] / f["mean_upload_bytes"],
            }
        )
    return out


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def _worker_main(role: str, spec_path: str) -> int:
    spec = WorkerSpec(**json.loads(Path(spec_path).read_text()))
    if role == "publisher":
        publisher_worker(spec)
    else:
        subscriber_worker(spec)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=10, help="measured versions per case (after the initial anchor)")
    ap.add_argument("--subscribers", type=parse_ints, default=[1, 8], help="subscriber counts (comma list)")
    ap.add_argument("--small", action="store_true", help="~5M-parameter model instead of ~122M (smoke run)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only: skip the rate-limited namespaces")
    ap.add_argument("--rate", default="100mbit", help="tc rate of every link in the namespace condition")
    ap.add_argument("--modes", type=comma_list, default=list(MODES), help="subset of patches,full")
    ap.add_argument("--lr", type=float, default=LR, help="AdamW learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--poll",
        type=float,
        default=0.2,
        help="subscribers' follow interval in seconds (each poll is a DHT read of the head: with 8 subscribers on "
        "2 cores, 0.05 s doubled the publisher's encode time against 0.2 s)",
    )
    ap.add_argument("--fetch-timeout", type=float, default=600.0, help="subscribers' per-update fetch timeout")
    ap.add_argument(
        "--relay-wait",
        type=float,
        default=None,
        help="override SwarmSource.relay_wait: seconds a subscriber turned away by a busy publisher waits before "
        "looking for relays again (default: the library's)",
    )
    ap.add_argument(
        "--relay-max-mb",
        type=float,
        default=None,
        help="Subscriber(relay_max_bytes=) in MB (default: the library's); below a full BF16 copy plus a patch, a "
        "relay drops its anchor once patches arrive (memory with many subscribers)",
    )
    ap.add_argument(
        "--conditions",
        type=comma_list,
        default=["loopback", "netns"],
        help="subset of loopback,netns (netns: the rate-limited namespaces)",
    )
    ap.add_argument(
        "--warmup-batch",
        type=int,
        default=1,
        help="subscribers that fetch the initial anchor at once (memory: each holds about 2.5 copies meanwhile)",
    )
    ap.add_argument("--version-timeout", type=float, default=1800.0, help="bound on one version's distribution")
    ap.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run cases whose estimated peak memory exceeds MemAvailable minus a margin (default: skip them)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write every measurement as JSON to PATH")
    ap.add_argument("--role", choices=("publisher", "subscriber"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    return ap


def open_conditions(args: argparse.Namespace) -> tuple[list[dict[str, Any]], NetNS | None]:
    """The conditions to measure (loopback, the rate-limited namespaces or why they are skipped), and the network
    of the latter when it could be set up."""
    conditions: list[dict[str, Any]] = []
    if "loopback" in args.conditions:
        conditions.append({"name": "loopback", "rate": None, "skipped": None})
    netns: NetNS | None = None
    label = rate_label(args.rate)
    if "netns" not in args.conditions:
        pass
    elif args.no_netns:
        conditions.append({"name": label, "rate": args.rate, "skipped": "--no-netns"})
    else:
        netns, reason = open_netns(max(args.subscribers) + 1, args.rate)
        conditions.append({"name": label, "rate": args.rate, "skipped": reason})
        if reason is not None:
            log(f"{label}: skipped ({reason})")
    return conditions, netns


def run_cases(
    coordinator: Coordinator,
    conditions: list[dict[str, Any]],
    netns: NetNS | None,
    cases: list[CaseResult],
    skipped_cases: list[dict[str, Any]],
) -> None:
    """Every (condition, subscriber count, mode) case into ``cases``, or into ``skipped_cases`` when it would not
    fit in memory. Raises WorkerFailed or TimeoutError when a case fails (the cases so far stay)."""
    args = coordinator.args
    for cond in conditions:
        if cond["skipped"] is not None:
            continue
        ns = netns if cond["rate"] else None
        for n in args.subscribers:
            for mode in args.modes:
                need = estimate_memory(
                    coordinator.num_elements,
                    n,
                    mode,
                    warmup_batch=args.warmup_batch,
                    relay_max_bytes=None if args.relay_max_mb is None else args.relay_max_mb * 1e6,
                )
                reason = None if args.no_memory_check else memory.shortfall(need, MEMORY_MARGIN)
                if reason is not None:
                    reason += " (--no-memory-check to run anyway)"
                    skipped_cases.append({"condition": cond["name"], "subscribers": n, "mode": mode, "reason": reason})
                    log(f"{cond['name']} subscribers={n} mode={mode}: skipped: {reason}")
                    continue
                cases.append(coordinator.run_case(cond["name"], ns, n, mode))


def print_condition(
    args: argparse.Namespace,
    cond: dict[str, Any],
    cases: list[CaseResult],
    skipped_cases: list[dict[str, Any]],
    summary: list[dict[str, Any]],
) -> None:
    """One condition's tables and lines: the cases, the bound (rate-limited), skipped cases, the summary."""
    print()
    if cond["skipped"] is not None:
        print(f"{cond['name']}: skipped ({cond['skipped']})")
        return
    mine = [c for c in cases if c.condition == cond["name"]]
    print("loopback (127.0.0.1)" if cond["rate"] is None else f"{cond['name']} links (tc tbf, network namespaces)")
    print(format_table(mine))
    if cond["rate"] and any(c.bound_summary() for c in mine):
        print(
            f"\nBound (issue 14): minimal relay-tree depth d (publisher serves {PUBLISHER_FANOUT}, every relay "
            f"{PUBLISHER_FANOUT} more: {PUBLISHER_FANOUT} + {PUBLISHER_FANOUT}^2 + ... + "
            f"{PUBLISHER_FANOUT}^d >= subscribers) x one transfer of the object at {cond['name']}; ratio = "
            "publish() -> last subscriber / bound (mean and worst version); after_encode: from the version "
            "stored and announced; depth_formed: deepest subscriber in the tree of who served whom."
        )
        print(format_bound_table(mine))
    for sk in skipped_cases:
        if sk["condition"] == cond["name"]:
            print(f"  {sk['subscribers']} subscriber(s) {sk['mode']}: skipped ({sk['reason']})")
    for s in summary:
        if s["condition"] == cond["name"]:
            print(
                f"  {s['subscribers']} subscriber(s): patches reach the last subscriber "
                f"{s['latency_speedup']:.1f}x sooner than full checkpoints on average "
                f"({s['patches_mean_latency_s']:.2f} s vs {s['full_mean_latency_s']:.2f} s; "
                f"{s['max_latency_speedup']:.1f}x on the max), {1 / s['bytes_ratio']:.0f}x fewer bytes per "
                f"version, publisher upload {1 / s['upload_ratio']:.0f}x lower"
            )
    for c in mine:
        initial = next((v for v in c.versions if not v.counted), None)
        if c.warnings:
            print(f"  {c.subscribers} subscriber(s) {c.mode}: {len(c.warnings)} warning(s) from the library")
        if initial is not None and c.mode == "patches":
            print(
                f"  {c.subscribers} subscriber(s): initial anchor ({initial.object_bytes / 1e6:.1f} MB) reached "
                f"all subscribers, {args.warmup_batch} at a time, {initial.latency_s:.2f} s after publish "
                "(not counted)"
            )


def print_header(args: argparse.Namespace, cases: list[CaseResult], load_at_start: float) -> None:
    """What was measured, with which model, and what the columns mean."""
    first = cases[0] if cases else None
    if first is not None:
        print(
            f"pulseloco PULSESync benchmark: model={'small' if args.small else 'default'} "
            f"({first.num_params / 1e6:.1f}M params, full BF16 copy "
            f"{first.full_bf16_bytes / 1e6:.1f} MB), AdamW lr={args.lr:g}, {args.versions} versions per case "
            f"(+1 initial anchor, not counted), load average {os.getloadavg()[0]:.2f} (at start {load_at_start:.2f})"
        )
    print(
        "patches: Publisher defaults (anchor every 10 versions, publisher serves each version at most twice before "
        "sending subscribers to relays); full: anchor_every=1 + Subscriber(full_checkpoints=True), same transport."
    )
    print(
        "MB/version: what a subscriber fetches per version (patch or checkpoint file); upload_x_obj: publisher upload "
        "per version / that size; encode_s: publish() -> stored and announced; latency: publish() -> last subscriber "
        "holds the version (digest checked against the publisher's); recv_MB/sub: bytes a subscriber actually "
        "received per version; off_path: subscriber updates that fell back to another path (anchor + chain)."
    )


def report_json(
    args: argparse.Namespace, results: dict[str, Any], incomplete: CaseResult | None, revision: dict[str, Any]
) -> dict[str, Any]:
    """Everything measured, as ``--json`` writes it. ``results``: conditions, cases, skipped_cases, summary,
    completed, elapsed_s, load_average."""
    model = "small" if args.small else "default"
    return {
        "config": {
            "model": model,
            "model_config": MODEL_CONFIGS[model],
            "lr": args.lr,
            "versions": args.versions,
            "subscribers": args.subscribers,
            "modes": args.modes,
            "seed": args.seed,
            "poll_s": args.poll,
            "relay_wait_s": args.relay_wait,
            "relay_max_mb": args.relay_max_mb,
            "warmup_batch": args.warmup_batch,
            "fetch_timeout_s": args.fetch_timeout,
            "batch_size": BATCH_SIZE,
            "seq_len": SEQ_LEN,
            "rate": args.rate,
            "library": revision,
        },
        "conditions": results["conditions"],
        "cases": [
            {
                **{k: v for k, v in asdict(c).items() if k != "versions"},
                "all_digests_match": c.all_digests_match,
                "summary": c.summary(),
                "versions": [asdict(v) for v in c.versions],
            }
            for c in results["cases"]
        ],
        "skipped_cases": results["skipped_cases"],
        # versions measured before a failure or interruption (not in the tables)
        "incomplete_case": asdict(incomplete) if incomplete is not None else None,
        "summary": results["summary"],
        "completed": results["completed"],
        "elapsed_s": results["elapsed_s"],
        "load_average": {"start": results["load_at_start"], "end": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.role:
        return _worker_main(args.role, args.spec)
    if set(args.modes) - set(MODES) or not args.modes:
        ap.error(f"--modes must be a subset of {','.join(MODES)}")
    if args.versions < 1 or not args.subscribers or min(args.subscribers) < 1:
        ap.error("--versions and --subscribers must be positive")
    if set(args.conditions) - {"loopback", "netns"} or not args.conditions or args.warmup_batch < 1:
        ap.error("--conditions must be a subset of loopback,netns and --warmup-batch positive")
    procs.exit_on_signals()
    t_start = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    revision = library_revision()
    conditions, netns = open_conditions(args)

    workdir = Path(tempfile.mkdtemp(prefix="bsync"))  # short: AF_UNIX paths are limited to ~100 bytes
    cases: list[CaseResult] = []
    skipped_cases: list[dict[str, Any]] = []
    coordinator = Coordinator(args, workdir)
    failed, exit_code = False, 1
    try:
        run_cases(coordinator, conditions, netns, cases, skipped_cases)
    except (WorkerFailed, TimeoutError) as exc:
        failed = True
        log(f"benchmark failed: {exc}")
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, SIGHUP: clean up, then report what completed
        failed, exit_code = True, 130
        log("interrupted")
    finally:
        coordinator.close()
        if netns is not None:
            netns.teardown()
        if not failed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"worker logs kept in {workdir}")

    elapsed = time.perf_counter() - t_start
    summary = summarize(cases)
    print_header(args, cases, load_at_start)
    for cond in conditions:
        print_condition(args, cond, cases, skipped_cases, summary)
    if failed:
        print("\nThe benchmark did not finish; the tables show the cases that completed.")
    print(f"\nTotal time {elapsed:.0f}s")
    if args.json:
        incomplete = coordinator.current_case
        if not failed or any(c is incomplete for c in cases):
            incomplete = None
        results = dict(conditions=conditions, cases=cases, skipped_cases=skipped_cases, summary=summary)
        results.update(completed=not failed, elapsed_s=elapsed, load_at_start=load_at_start)
        with open(args.json, "w") as f:
            json.dump(report_json(args, results, incomplete, revision), f, indent=2)
    return exit_code if failed else 0


if __name__ == "__main__":
    sys.exit(main())
