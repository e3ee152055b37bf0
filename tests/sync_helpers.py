"""Helpers for the PULSESync tests: a tiny transformers trainer, and processes for subscribers and rogue peers.

Everything here is real: models are transformers models built from a config (no downloads), DHTs are hivemind
DHTs on 127.0.0.1 with their own libp2p daemons, and the worker functions run in processes forked from a
``multiprocessing`` fork server (:data:`WORKER_PRELOAD`): they share nothing with the test process but their
arguments and its environment, and do not import torch, hivemind and transformers again (5-8 CPU-s each with
``spawn``).

Worker processes talk to the test over a ``multiprocessing`` pipe, one request and one answer at a time; every
wait in the test process has a timeout (:class:`WorkerProcess`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from harness import procs

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
)
"""A Qwen2 small enough that 20 versions, their anchors and four peers fit in seconds on two CPU cores."""

LR = 3e-6
"""An RL learning rate: most BF16 weights do not change per step, which is what PULSESync exploits."""

TIMEOUT = 60.0
"""Upper bound for any single wait on another process (the suite's waits normally take well under a second)."""

WORKER_PRELOAD = (
    "torch", "hivemind", "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "pulseloco.sync.publisher", "pulseloco.sync.subscriber", "pulseloco.rollouts", "sync_helpers", "rollout_helpers",
)  # fmt: skip
"""What :class:`WorkerProcess` targets import: the fork server that starts them imports these once per test process
(a clean interpreter, not a fork of the test process with its threads and DHTs)."""


# ---- models --------------------------------------------------------------------------------------------------


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A randomly initialized tiny Qwen2 causal LM (deterministic for a seed)."""
    from pulseloco.models import random_causal_lm

    return random_causal_lm("qwen2", seed=seed, dtype=dtype, **TINY_CONFIG)


def float_state(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def bf16_digest(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """The PULSESync state digest of a model's floating tensors cast to BF16 (what a publisher publishes)."""
    from pulseloco.sync import state_digest

    return state_digest({k: v.detach().to("cpu", torch.bfloat16) for k, v in float_state(model).items()})


class Trainer:
    """A tiny model taking deterministic AdamW steps on random token batches (FP32 master weights)."""

    def __init__(self, seed: int = 0, lr: float = LR) -> None:
        self.model = tiny_model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed + 1)

    def step(self) -> None:
        tokens = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 16), generator=self.generator)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def digest(self) -> str:
        return bf16_digest(self.model)


# ---- DHTs ----------------------------------------------------------------------------------------------------


def start_dht(initial_peers: Sequence[str] = ()) -> Any:
    """A hivemind DHT on 127.0.0.1 (its own process and libp2p daemon)."""
    import hivemind

    return hivemind.DHT(
        start=True,
        initial_peers=list(initial_peers) or None,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        startup_timeout=30,
    )


def maddrs(dht: Any) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def wait_until_provider_lists(endpoint: Any, peer_id: str, version: int, timeout: float = 10.0) -> None:
    """Wait until the DHT shows ``peer_id`` as a provider of ``version`` (announcements are asynchronous)."""
    wait_for(
        lambda: version in endpoint.get_providers(timeout=5.0).get(peer_id, {}).get("versions", []),
        timeout,
        f"peer {peer_id} to announce version {version}",
    )


# ---- worker processes ----------------------------------------------------------------------------------------


def close_all(workers: Sequence[WorkerProcess], timeout: float = 30.0) -> None:
    """Close workers in parallel: ask every one to leave the swarm, then wait for each."""
    for worker in workers:
        worker.begin_close()
    for worker in workers:
        worker.close(timeout)


def _with_environment(target: Callable[..., None], environ: dict[str, str], *args: Any) -> None:
    """Run ``target(*args)`` with the environment the test process had when it started the worker (the fork
    server's is that of its own start)."""
    procs.own_hivemind_locks()  # a fork of the server, as its siblings: none may hold this one's locks
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


class WorkerProcess:
    """A process forked from the fork server (:data:`WORKER_PRELOAD`) running ``target(conn, *args)`` with the test
    process's environment; :meth:`call` sends a request and waits for the answer.

    Answers are ``("ok", value)`` or ``("error", text)``; an error answer raises AssertionError in the test.
    """

    def __init__(self, target: Callable[..., None], *args: Any, name: str) -> None:
        ctx = procs.fork_server(WORKER_PRELOAD)  # the preload is read when the server starts, with the first worker
        self.conn, child_conn = ctx.Pipe()
        self.name = name
        self._closing = False
        args = (target, dict(os.environ), child_conn, *args)
        self.process = ctx.Process(target=_with_environment, args=args, name=name, daemon=False)
        self.process.start()
        child_conn.close()

    def send(self, *request: Any) -> None:
        self.conn.send(request)

    def receive(self, timeout: float = TIMEOUT) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.name} did not answer within {timeout:.0f} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"{self.name} failed: {value}")
        return value

    def call(self, *request: Any, timeout: float = TIMEOUT) -> Any:
        self.send(*request)
        return self.receive(timeout)

    def begin_close(self) -> None:
        """Ask the worker to leave the swarm and exit (once)."""
        if not self._closing and not self.conn.closed:
            self._closing = True
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(("close",))

    def close(self, timeout: float = 15.0) -> None:
        """:meth:`begin_close`, then wait for the worker to exit; kill it after ``timeout``. Idempotent."""
        if self.conn.closed:
            return
        self.begin_close()
        with contextlib.suppress(OSError, EOFError):
            if self.conn.poll(timeout):
                self.conn.recv()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


def _serve_requests(conn: Any, handlers: Mapping[str, Callable[..., Any]]) -> None:
    """The worker side of :class:`WorkerProcess`: answer requests until ``close`` (or the pipe breaks)."""
    while True:
        try:
            command, *args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            value = handlers[command](*args)
            conn.send(("ok", value))
        except Exception as exc:  # report to the test, which fails with the text
            import traceback

            conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
        if command == "close":
            # everything is shut down: skip the interpreter's finalization, seconds of GC on a loaded machine
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _worker_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(processName)s %(name)s: %(message)s")


def subscriber_worker(conn: Any, initial_peers: list[str], run_id: str, public_pem: bytes, options: dict) -> None:
    """A rollout worker in its own process: joins the swarm on ``start`` and updates its model on ``update``.

    ``options``: ``model`` is ``bfloat16`` (a transformers model updated in place), ``float32`` (a transformers
    model updated through the subscriber's BF16 shadow) or ``dict`` (an empty state dict that adopts the
    publisher's tensors, as ``pulseloco sync follow`` does); other keys go to :class:`Subscriber`.
    """
    _worker_logging()
    torch.set_num_threads(1)
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber

    options = dict(options)
    kind = options.pop("model", "bfloat16")
    model: Any = {} if kind == "dict" else tiny_model(seed=1234, dtype=getattr(torch, kind))  # not the trainer's
    state: dict[str, Any] = {}

    def start() -> str:
        state["dht"] = start_dht(initial_peers)
        state["sub"] = Subscriber(state["dht"], run_id, load_public_key(public_pem), **options)
        return state["sub"].endpoint.peer_id.to_base58()

    def update() -> dict:
        sub = state["sub"]
        report = sub.update_report(model)
        if sub.version is not None:  # a relay is only useful once the DHT shows it
            wait_until_provider_lists(sub.endpoint, sub.endpoint.peer_id.to_base58(), sub.version)
        return {
            "version": sub.version,
            "digest": sub.digest,
            "model_digest": bf16_digest(model),
            "path": report.path if report else None,
            "bytes": report.bytes_received if report else 0,
            "relay_bytes_uploaded": sub.endpoint.servicer.bytes_uploaded,
        }

    def close() -> None:
        if "sub" in state:
            state["sub"].close()
            state["dht"].shutdown()

    _serve_requests(conn, {"start": start, "update": update, "close": close})


def _flip_one_bit(payload: bytes, position: float = 0.5) -> bytes:
    data = bytearray(payload)
    data[int(len(data) * position)] ^= 0x01
    return bytes(data)


def forge_object(
    store_dir: str | os.PathLike[str], kind: str, version: int, stranger_key: Any
) -> tuple[bytes, bytes] | None:
    """A well-formed object for ``version`` whose weights differ from the publisher's in one element, with an
    envelope carrying its true SHA-256, signed by ``stranger_key``: everything checks out except the signature.
    Returns ``(envelope, payload)``, or None if the store cannot build that version.
    """
    import json

    from pulseloco.digest import state_digest
    from pulseloco.sync.anchor import anchor_bytes, load_anchor
    from pulseloco.sync.patch import apply_patch, make_patch
    from pulseloco.sync.signing import Envelope, sign_envelope
    from pulseloco.sync.store import VersionStore

    store = VersionStore(store_dir, create=False)
    try:
        run_id = json.loads(store.read_envelope(kind, version))["fields"]["run_id"]
        anchor, patches = store.chain_to(version)
        state = load_anchor(store.read("anchor", anchor)[1])
        base_state, base_version, current = None, None, anchor
        for v in patches:
            base_state, base_version = {k: t.clone() for k, t in state.items()}, current
            apply_patch(state, store.read("patch", v)[1])
            current = v
    except (ValueError, FileNotFoundError):
        return None  # pruned or being written: the rogue just says it has nothing
    forged = {k: t.clone() for k, t in state.items()}
    name = sorted(forged)[0]
    forged[name].view(-1).view(torch.int16)[0] += 1  # the neighbouring BF16 value: plausible, and wrong
    if kind == "patch":
        if base_state is None:
            return None
        payload = make_patch(base_state, forged, version=version, base_version=base_version)
        base_digest = state_digest(base_state)
    else:
        payload, base_version, base_digest = anchor_bytes(forged), None, ""
    envelope = Envelope(
        run_id=run_id,
        kind=kind,
        version=version,
        base_version=base_version,
        digest=state_digest(forged),
        base_digest=base_digest,
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
    )
    return sign_envelope(stranger_key, envelope), payload


def rogue_provider_worker(conn: Any, mode: str) -> None:
    """A stranger on the swarm that serves a run's objects badly and announces itself as a relay.

    ``mode``: ``corrupt`` serves the publisher's genuine envelope with one flipped bit in the payload (corruption in
    transit, or a malicious relay); ``forged`` serves a well-formed object with other weights signed by another
    key; ``stall`` accepts requests and never answers. Once started it announces every version in the
    publisher's store (``publisher=False``, so subscribers try it before the publisher).

    Requests: ``start(initial_peers, run_id, store_dir)`` -> peer id, ``served`` -> requests it received, ``close``.
    """
    _worker_logging()
    torch.set_num_threads(1)
    from pulseloco.sync.signing import generate_key
    from pulseloco.sync.store import VersionStore
    from pulseloco.sync.transport import Provided, SwarmEndpoint

    stranger = generate_key()
    served = {"count": 0}
    state: dict[str, Any] = {}
    stop = threading.Event()

    def provide(request: Any) -> Provided:
        served["count"] += 1
        if mode == "stall":
            stop.wait(120)
            return Provided("missing")
        store = VersionStore(state["store_dir"], create=False)
        if request.kind not in ("patch", "anchor") or not store.has(request.kind, request.version):
            return Provided("missing")
        if mode == "corrupt":
            envelope, payload = store.read(request.kind, request.version)
            return Provided("ok", envelope, _flip_one_bit(payload))
        forged = forge_object(state["store_dir"], request.kind, request.version, stranger)
        return Provided("missing") if forged is None else Provided("ok", *forged)

    def announce_loop(endpoint: Any) -> None:
        while not stop.is_set():
            store = VersionStore(state["store_dir"], create=False)
            held = store.list("patch") + store.list("anchor")
            if held:
                endpoint.announce_provider(held, publisher=False, ttl=30)
            stop.wait(0.2)

    def start(initial_peers: list[str], run_id: str, store_dir: str) -> str:
        state["store_dir"] = store_dir
        state["dht"] = start_dht(initial_peers)
        endpoint = SwarmEndpoint(state["dht"], run_id, name=f"rogue-{mode}")
        endpoint.serve(provide)
        state["endpoint"] = endpoint
        threading.Thread(target=announce_loop, args=(endpoint,), daemon=True).start()
        return endpoint.peer_id.to_base58()

    def close() -> None:
        stop.set()
        if "endpoint" in state:
            state["endpoint"].close()
            state["dht"].shutdown()

    _serve_requests(conn, {"start": start, "served": lambda: served["count"], "close": close})


# ---- command line ----------------------------------------------------------------------------------------------

FOLLOW_LINE = re.compile(r"^(\d+) (\d+) (\d+) ([\d.]+) ([0-9a-f]{32}) (\d+) (\w+)$")
RESTORED_LINE = re.compile(r"^restored version=(\d+) digest=([0-9a-f]{32}) from ")


class LineReader:
    """Collects a subprocess's stdout lines in a thread, so the test can wait for a line with a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: re.Pattern[str] | str, timeout: float = TIMEOUT, start: int = 0) -> re.Match[str]:
        """The first line at or after index ``start`` matching ``pattern``; AssertionError after ``timeout``."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self.lines):
                    m = regex.search(self.lines[i])
                    if m:
                        return m
                    i += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._thread.is_alive()):
                    raise AssertionError(
                        f"no line matching {regex.pattern!r} within {timeout:.0f} s "
                        f"(exit code {self.proc.poll()}); output:\n" + "\n".join(self.lines)
                    )
                self._cond.wait(min(remaining, 0.5))

    def join(self, timeout: float = 10.0) -> None:
        self._thread.join(timeout)


@contextlib.contextmanager
def popen(cmd: Sequence[str], **kwargs: Any) -> Iterator[subprocess.Popen[str]]:
    """Start ``cmd`` (stdout piped as text, stderr to a file-like passed in kwargs or inherited); kill it on exit."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
