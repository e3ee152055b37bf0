"""The rollout worker's server: takes leases from trainers over libp2p and generates them with the version it holds.

A :class:`RolloutServer` sits beside a :class:`pulseloco.sync.subscriber.Subscriber` that keeps a rollout engine's
weights at the newest published version. Leases (:class:`pulseloco.rollouts.protocol.Lease`) arrive on the
``rpc_generate`` handler, wait in a bounded queue and are generated one at a time by one generation thread, each
under the subscriber's lock: a lease is generated with one version from start to end, and its reply names that
version and its state digest. The subscriber downloads and verifies the next patch while a lease generates and
applies it between leases.

The server announces itself in the DHT (:func:`pulseloco.keys.workers_key`) every few seconds with the
version it serves, its measured throughput and its queue, so that trainers can find it and size their leases.

Failure behaviour: a malformed or oversized lease is answered with an ``error`` status naming the reason (it never
raises into the daemon); a full queue answers ``busy`` and a worker holding no version ``not_ready``, so the
trainer asks another worker; a lease still queued when its deadline passes, or whose trainer hung up, is dropped
without generating. An engine failure answers ``error`` for that lease and the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from pulseloco.errors import PayloadError
from pulseloco.keys import workers_key
from pulseloco.p2p import CHUNK_BYTES, P2PHost, asker_closes, stream_messages
from pulseloco.rollouts.protocol import (
    COMPUTE_DTYPES,
    Lease,
    ReplyHeader,
    WorkerInfo,
    decode_lease,
    encode_reply,
)
from pulseloco.swarm import is_reachable

logger = logging.getLogger(__name__)

__all__ = ["RolloutServer", "RolloutServicer", "rollout_namespace"]


MIN_VERSION_WAIT_S = 10.0
"""Seconds a lease waits at most for its ``min_version`` (several versions' way over a WAN) before it is answered
``not_ready``: the one generation thread serves every trainer, so a lease naming a version that never comes (a
trainer's mistake, or a stranger's) holds the others back by at most this, not by its deadline."""


def rollout_namespace(run_id: str) -> str:
    """The libp2p handler namespace of the rollout service of PULSESync run ``run_id``."""
    return f"{run_id}.rollouts"


@dataclass
class _Job:
    lease: Lease
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[tuple[ReplyHeader, list[bytes]]]
    received: float = field(default_factory=time.monotonic)
    cancelled: bool = False

    def resolve(self, header: ReplyHeader, payload: list[bytes]) -> None:
        def set_result() -> None:
            if not self.future.done():
                self.future.set_result((header, payload))

        self.loop.call_soon_threadsafe(set_result)


class RolloutServicer(ServicerBase):
    """The ``rpc_generate`` and ``rpc_head`` handlers of a :class:`RolloutServer` (trainers build their stub from
    this class)."""

    def __init__(self, server: RolloutServer) -> None:
        self.server = server

    @asker_closes
    async def rpc_head(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        """Take a head record a trainer pushes when it publishes (the signed bytes it stored in the DHT): the
        subscriber checks it (:meth:`pulseloco.sync.subscriber.Subscriber.offer_head`) and, when it is newer,
        fetches that version now rather than at its next poll. Answers ``{"taken": bool}``; a record that does not
        verify is refused there and logged, and changes nothing."""
        offer = getattr(self.server.subscriber, "offer_head", None)
        taken = bool(offer(bytes(request.metadata))) if offer is not None else False
        if not taken:
            logger.debug("pushed head not taken peer=%s", context.remote_id)
        for message in stream_messages(runtime_pb2.ExpertResponse, {"taken": taken}):
            yield message

    @asker_closes
    async def rpc_generate(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:  # hivemind needs typing's alias for streams
        """Answer one lease: the reply's header and payload (:mod:`pulseloco.rollouts.protocol`)."""
        server = self.server
        try:
            lease = decode_lease(
                request.metadata,
                run_id=server.run_id,
                vocab_size=server.vocab_size,
                max_new_tokens=server.max_new_tokens,
                max_prompt_tokens=server.max_prompt_tokens,
            )
        except PayloadError as exc:
            logger.warning("refused lease peer=%s error=%s", context.remote_id, exc)
            server.num_refused += 1
            for message in stream_messages(runtime_pb2.ExpertResponse, {"status": "error", "error": str(exc)}):
                yield message
            return
        status = server.admit()
        if status != "ok":
            for message in stream_messages(
                runtime_pb2.ExpertResponse, ReplyHeader(status, lease_id=lease.lease_id).to_json()
            ):
                yield message
            return
        loop = asyncio.get_running_loop()
        job = _Job(lease, loop, loop.create_future())
        server.submit(job)
        try:
            header, payload = await asyncio.wait_for(job.future, lease.deadline_s)
        except TimeoutError:
            header, payload = ReplyHeader("error", lease.lease_id, error="the lease's deadline passed"), []
        finally:
            job.cancelled = True  # a trainer that hung up or timed out: the generation thread skips it
        for message in stream_messages(runtime_pb2.ExpertResponse, header.to_json(), payload, chunk_bytes=CHUNK_BYTES):
            yield message


class RolloutServer:
    """Serves leases with ``engine`` (a :class:`pulseloco.rollouts.engines.hf.RolloutEngine`) at the version
    ``subscriber`` holds.

    Args:
        dht: the worker's running DHT (it must be reachable by the trainers: server mode, or a relay address).
        run_id: the PULSESync run followed (``<run_id>.policy``).
        engine: generates; ``engine_name`` is announced with it, and its ``compute_dtype`` (what it computes in) is
            sent with every reply.
        subscriber: keeps ``engine.weights()`` current; its ``lock`` is held while a lease generates.
        vocab_size, max_new_tokens, max_prompt_tokens: limits every lease is checked against.
        max_queue: leases waiting at once; more are answered ``busy``.
        announce_every, record_ttl: how often the DHT record is refreshed, and how long it lives.

    Call :meth:`weights_loaded` whenever the engine serves a new version (after ``engine.weights_updated``): a
    lease is generated only while the engine's loaded version is the one the subscriber holds, so that the reply
    never names a version the engine has not loaded yet.
    """

    def __init__(
        self,
        dht: Any,
        run_id: str,
        engine: Any,
        subscriber: Any,
        *,
        engine_name: str,
        vocab_size: int,
        max_new_tokens: int,
        max_prompt_tokens: int = 4096,
        max_queue: int = 8,
        announce_every: float = 5.0,
        record_ttl: float = 30.0,
    ) -> None:
        if max_queue < 1 or max_new_tokens < 1 or max_prompt_tokens < 1 or vocab_size < 1:
            raise ValueError("max_queue, max_new_tokens, max_prompt_tokens and vocab_size must be at least 1")
        self.dht = dht
        self.run_id = run_id
        self.engine = engine
        self.engine_name = engine_name
        self.compute_dtype = str(engine.compute_dtype)
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"the engine computes in {self.compute_dtype}; a reply may say {', '.join(COMPUTE_DTYPES)}"
            )
        self.subscriber = subscriber
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.max_queue = max_queue
        self.announce_every = announce_every
        self.record_ttl = record_ttl
        self.num_served = 0
        self.num_refused = 0
        #: called (on the generation thread) with one record per lease served: its wall-clock times (``received``
        #: from the trainer, ``began`` when the generation thread took it, ``started`` generating once the version
        #: it needs was loaded, ``finished``), ``seconds`` of generation, the version ``held`` when it began, its
        #: ``min_version``, the ``version`` it was made with, ``completions`` and ``tokens``. An exception it
        #: raises is logged; the lease is answered all the same (the recipe appends to ``leases.jsonl``).
        self.on_lease: Callable[[dict[str, Any]], None] | None = None
        self.num_expired = 0
        self.tokens_per_s = 0.0
        self.samples_per_s = 0.0
        self._loaded: tuple[int, str] | None = None
        self._cond = threading.Condition(subscriber.lock)
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._stop = threading.Event()
        self._announce_wanted = True
        if not is_reachable(dht):
            logger.warning(
                "this worker is in client mode without a relay address: trainers cannot reach it to send leases; "
                "it reserves a relay slot by default when an initial peer (or --relays) has a public address, "
                "so check its log for 'no relay reservation' and --use_auto_relay (or run it where it can listen "
                "publicly)"
            )
        self.host = P2PHost(dht, name="rollout-worker")
        try:
            self.host.serve(RolloutServicer(self), rollout_namespace(run_id))
        except BaseException:
            self.host.close()
            raise
        self._threads = [
            threading.Thread(target=self._generate_loop, name="rollout-generate", daemon=True),
            threading.Thread(target=self._announce_loop, name="rollout-announce", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def peer_id(self) -> str:
        return self.host.peer_id.to_base58()

    @property
    def version(self) -> int | None:
        """The version the engine serves (None before the first)."""
        loaded = self._loaded
        return loaded[0] if loaded is not None else None

    def weights_loaded(self, version: int, digest: str) -> None:
        """The engine now generates with ``version`` (state digest ``digest``)."""
        with self._cond:
            self._loaded = (version, digest)
            self._cond.notify_all()
        self._announce_soon()

    def admit(self) -> str:
        """``ok`` if a new lease may queue; else the status to answer (``not_ready``, ``busy``)."""
        if self._loaded is None:
            return "not_ready"
        if self._jobs.qsize() >= self.max_queue:
            return "busy"
        return "ok"

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)

    # ---- generation ---------------------------------------------------------------------------------------

    def _generate_loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            lease = job.lease
            if job.cancelled or time.monotonic() - job.received > lease.deadline_s:
                self.num_expired += 1
                continue
            try:
                header, payload = self._generate(job)
            except Exception as exc:  # an engine failure fails this lease, not the worker
                logger.warning("lease failed lease=%s error=%r", lease.lease_id, exc)
                header, payload = ReplyHeader("error", lease.lease_id, error=f"generation failed: {exc!r}"[:500]), []
            job.resolve(header, payload)

    def _generate(self, job: _Job) -> tuple[ReplyHeader, list[bytes]]:
        lease = job.lease
        began = time.monotonic()
        held = self.version
        deadline = job.received + lease.deadline_s
        version_deadline = min(deadline, time.monotonic() + MIN_VERSION_WAIT_S)
        with self._cond:
            # the subscriber may hold a version that the engine has not loaded yet (a vLLM engine loads after the
            # patch is applied): wait for the engine, never label completions with a version they were not made with;
            # and for the lease's oldest usable version (waiting releases the lock, so the subscriber can apply it)
            while (
                self._loaded is None
                or self._loaded != (self.subscriber.version, self.subscriber.digest)
                or self._loaded[0] < lease.min_version
            ):
                now = time.monotonic()
                behind = self._loaded is not None and self._loaded[0] < lease.min_version
                if self._stop.is_set() or now > deadline or (behind and now > version_deadline):
                    return ReplyHeader("not_ready", lease.lease_id), []
                self._cond.wait(timeout=0.5)
            version, digest = self._loaded
            ready = time.monotonic()
            envelope = self.subscriber.envelope  # its signature vouches for (version, digest)
            prompts = [prompt for prompt in lease.prompts for _ in range(lease.num_samples)]
            sequences = [first + j for first in lease.sequences for j in range(lease.num_samples)]
            started = time.perf_counter()
            completions = self.engine.generate_ids(
                prompts,
                max_new_tokens=lease.max_new_tokens,
                temperature=lease.temperature,
                seed=lease.seed,
                sequences=sequences,
            )
            seconds = time.perf_counter() - started
        num_tokens = sum(len(c.token_ids) for c in completions)
        self._note_throughput(num_tokens / max(seconds, 1e-6), len(completions) / max(seconds, 1e-6))
        self.num_served += 1
        if self.on_lease is not None:
            # wall-clock times, to line up with the trainer's and the publisher's records
            now_wall, now = time.time(), time.monotonic()
            record = {
                "lease_id": lease.lease_id,
                "received": round(now_wall - (now - job.received), 3),
                "began": round(now_wall - (now - began), 3),
                "started": round(now_wall - (now - ready), 3),
                "finished": round(now_wall, 3),
                "seconds": round(seconds, 4),
                "held": held,
                "min_version": lease.min_version,
                "version": version,
                "completions": len(completions),
                "tokens": num_tokens,
            }
            try:
                self.on_lease(record)
            except Exception as exc:  # a full disk must not fail the lease it describes
                logger.warning("lease record not written lease=%s error=%r", lease.lease_id, exc)
        logger.info(
            "served lease=%s version=%d completions=%d tokens=%d seconds=%.3f",
            lease.lease_id,
            version,
            len(completions),
            num_tokens,
            seconds,
        )
        completed = [(c.token_ids, c.logprobs) for c in completions]
        return encode_reply(lease, version, digest, completed, seconds, envelope, compute_dtype=self.compute_dtype)

    def _note_throughput(self, tokens_per_s: float, samples_per_s: float) -> None:
        if self.tokens_per_s == 0:
            self.tokens_per_s, self.samples_per_s = tokens_per_s, samples_per_s
        else:  # an exponential moving average: leases differ in length
            self.tokens_per_s = 0.7 * self.tokens_per_s + 0.3 * tokens_per_s
            self.samples_per_s = 0.7 * self.samples_per_s + 0.3 * samples_per_s

    # ---- the DHT record -----------------------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            engine=self.engine_name,
            version=self.version if self.version is not None else -1,
            tokens_per_s=round(self.tokens_per_s, 3),
            samples_per_s=round(self.samples_per_s, 3),
            queue=self._jobs.qsize(),
            served=self.num_served,
            max_new_tokens=self.max_new_tokens,
        )

    def _announce_soon(self) -> None:
        self._announce_wanted = True

    def _announce_loop(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            if self._announce_wanted or time.monotonic() - last >= self.announce_every:
                self._announce_wanted = False
                last = time.monotonic()
                self.announce()
            self._stop.wait(0.1)

    def announce(self, timeout: float = 10.0) -> None:
        """Store this worker's record in the DHT now (logged, not raised, when the DHT does not answer)."""
        try:
            future = self.dht.store(
                workers_key(self.run_id),
                self.info().to_record(),
                expiration_time=get_dht_time() + self.record_ttl,
                subkey=self.peer_id,
                return_future=True,
            )
            future.result(timeout)
        except Exception as exc:  # the DHT is slow or shutting down: the next announce retries
            logger.debug("worker record not stored error=%r", exc)

    def close(self) -> None:
        """Stop serving: queued leases are answered ``not_ready`` by their handlers' deadlines, the record expires,
        the handler is removed. Bounded; never raises."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=15)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job.resolve(ReplyHeader("not_ready", job.lease.lease_id, error="the worker is shutting down"), [])
        with contextlib.suppress(Exception):
            self.host.close()
