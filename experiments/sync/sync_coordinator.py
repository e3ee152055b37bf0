"""The coordinator of ``experiments/sync/bench_sync.py``: it starts each case's publisher and subscribers
(:mod:`sync_workers`, one process each, in their peers' network namespaces when there are some), drives
them over a :class:`harness.channel.Hub` and measures every version (:class:`sync_report.VersionResult`).

A worker that exits, closes its connection or sends what the protocol does not expect raises :class:`WorkerFailed`;
a wait past its bound raises ``TimeoutError`` with the tails of the workers' logs. Either way the case measured so
far stays in :attr:`Coordinator.current_case` and the case's workers are stopped (their whole process groups).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness import REPO, channel, procs
from harness.logs import progress
from harness.machine import library_revision
from harness.models import state_shapes
from harness.netns import NetNS, parse_rate
from sync_report import CaseResult, VersionResult, min_tree_depth, tree_depth
from sync_workers import WorkerSpec

STARTUP_TIMEOUT = 300.0  # importing torch/transformers/hivemind in 9 processes on 2 shared cores is slow
STOP_TIMEOUT = 30.0
WORKER_PRELOAD = (
    "torch", "hivemind", "transformers.models.qwen2.modeling_qwen2", "pulseloco.swarm", "pulseloco.sync.publisher",
    "pulseloco.sync.subscriber", "sync_workers",
)  # fmt: skip
"""What a publisher or subscriber worker imports: on loopback the workers are forks of a fork server that imported
these once (:class:`harness.procs.Runner`); in a network namespace each is a new interpreter."""

log = progress("bench_sync")


class WorkerFailed(RuntimeError):
    """A worker exited, closed its connection or broke the protocol (the message says which, with its log)."""


@dataclass
class Worker:
    """A started worker: its role and index (the hub's address of it) and its process."""

    role: str
    index: int
    proc: procs.Proc


class Coordinator:
    """Starts each case's workers, drives them over the hub and measures every version.

    ``args`` are the script's parsed flags; ``workdir`` holds the hub's socket, the keys, the specs, the workers'
    logs and the version stores; ``script`` is the file run (with ``--role`` and ``--spec``) as each worker. Raises
    OSError when the hub's socket cannot be made."""

    def __init__(self, args: argparse.Namespace, workdir: Path, script: Path) -> None:
        from pulseloco.sync.signing import generate_key, save_keypair

        self.args = args
        self.workdir = workdir
        self.script = script
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
        """Stop the workers and the hub (never raises for workers already gone)."""
        self.stop_workers()
        self.hub.close()

    # ---- workers -----------------------------------------------------------------------------------------

    def start_worker(self, spec: WorkerSpec, runner: procs.Runner) -> Worker:
        """Write ``spec`` and start its worker (in its peer's namespace when the runner has a network); its log is
        ``case<N>-<role><index>.log`` beside the spec."""
        name = f"case{self.case_counter}-{spec.role}{spec.index}"
        spec_path = self.workdir / f"{name}.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        cmd = [sys.executable, str(self.script), "--role", spec.role, "--spec", str(spec_path)]
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
        """Raises WorkerFailed, with the tail of its log, for the first worker whose process has exited."""
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
        runner = procs.Runner(self.workdir, netns=netns, preload=WORKER_PRELOAD)
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
