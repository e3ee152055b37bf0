"""The trainer's side of the rollout loop: leases to the swarm's rollout workers, re-leased until every prompt is
answered once, with every reply checked.

A :class:`RolloutClient` turns a batch of prompt groups (one prompt, ``num_samples`` completions) into leases and
runs them on the workers it finds in the DHT (:func:`pulseloco.keys.workers_key`):

- at most ``leases_per_worker`` leases of this trainer run on a worker at once, and a worker gets its next lease
  as soon as one of its own returns; a batch is cut into leases by each worker's measured rate (completions
  answered per second of lease, from the trainer's side: generation, queue and link together, :func:`lease_shares`), so
  that a worker on a slow machine or link gets a smaller part and every worker finishes at about the same time;
  a worker not yet measured counts as the median of those measured, and with none measured the cut is even;
- a lease that fails (the worker died, hung past the lease's deadline, answered busy or not ready, or sent a reply
  that does not pass :func:`pulseloco.rollouts.protocol.decode_reply`) goes back to the front of the queue and
  goes to another worker; a group's result is taken once, from the first lease that returns it verified, so no
  prompt is answered twice and none is dropped;
- a reply must name a published version (read from the publisher's signed head record, whose digest it must
  match) no more than ``max_lag`` versions behind the newest; an older one is dropped and counted, and its groups
  are generated again;
- a worker whose replies fail those checks ``max_refusals`` times in a row is refused for the rest of the run
  (logged with the reason).

Failure behaviour: when no worker is usable for ``rollout_timeout`` seconds while leases wait, the batch fails with
:class:`NoWorkersError` (or, with ``wait=True``, a warning says so every ``rollout_timeout`` seconds and the batch
keeps waiting). Every remote call is bounded by the lease's deadline. Nothing a worker sends can raise anything
but a refusal.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import random
import shlex
import statistics
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from pulseloco.errors import ConfigError, PayloadError, SwarmError, TruncatedPayloadError
from pulseloco.keys import refused_key, training_run_id, workers_key
from pulseloco.p2p import P2PHost, parse_header, read_reply, read_stream
from pulseloco.rollouts.protocol import (
    MAX_REASON_CHARS,
    MAX_REFUSALS_LISTED,
    MAX_SEQUENCE,
    Lease,
    Samples,
    WorkerInfo,
    decode_reply,
    parse_worker_record,
    reply_max_bytes,
)
from pulseloco.rollouts.worker import RolloutServicer, rollout_namespace
from pulseloco.sync.signing import verify_envelope
from pulseloco.sync.transport import read_head

logger = logging.getLogger(__name__)

__all__ = [
    "GroupResult",
    "LeaseConfig",
    "NoWorkersError",
    "RolloutClient",
    "RolloutStats",
    "lease_shares",
    "worker_command",
]

#: Seconds a trainer's list of refused workers lives in the DHT (a run's length, about).
REFUSALS_TTL = 24 * 3600.0

#: Seconds one push of a new head record to one worker may take (:meth:`RolloutClient.push_head`).
HEAD_PUSH_TIMEOUT = 5.0

#: Weight of a lease's rate in a worker's measured rate (an exponential moving average over its answered leases).
RATE_WEIGHT = 0.5


def lease_shares(peers: Sequence[str], rates: dict[str, float]) -> dict[str, float]:
    """Each of ``peers``' share of a batch (summing to 1), in proportion to its measured ``rates`` (completions per
    second; a peer without one counts as the median of the measured ones, and with none measured every peer gets
    the same). Returns ``{}`` for no peers; never raises."""
    measured = [rates[p] for p in peers if rates.get(p, 0.0) > 0.0]
    default = statistics.median(measured) if measured else 1.0
    weights = {p: rates[p] if rates.get(p, 0.0) > 0.0 else default for p in peers}
    total = sum(weights.values())
    return {p: w / total for p, w in weights.items()}


def lease_order(
    peers: Sequence[str], rates: dict[str, float], inflight: dict[str, int], queues: dict[str, int]
) -> list[str]:
    """``peers`` in the order they are offered leases and backups: measured ones first, the highest measured
    ``rates`` first, then those not measured yet; ties go to fewer leases in flight, then shorter queues. What a
    worker reports of its own throughput is not used: a stranger could claim any. Never raises."""
    return sorted(
        peers,
        key=lambda p: (rates.get(p, 0.0) <= 0.0, -rates.get(p, 0.0), inflight.get(p, 0), queues.get(p, 0), p),
    )


class NoWorkersError(SwarmError):
    """No rollout worker was usable for ``rollout_timeout`` seconds while leases waited."""


@dataclass(frozen=True)
class GroupResult:
    """The ``num_samples`` completions of one prompt, as one worker generated them with ``version``: in lease
    ``lease_id``, with the sampling noise keyed by ``seed``, as the sequences ``sequence``, ``sequence + 1``, ...
    (:mod:`pulseloco.rollouts.sampling`), computing in ``compute_dtype`` (what the worker says)."""

    version: int
    digest: str
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    worker: str
    lease_id: str = ""
    seed: int = 0
    sequence: int = 0
    compute_dtype: str = "bfloat16"


@dataclass
class RolloutStats:
    """Counters of a client's whole run (what ``pulseloco status`` and the metrics report)."""

    leases: int = 0
    released: int = 0
    failed: int = 0
    refused: int = 0
    check_failed: int = 0
    check_failures: collections.Counter[str] = field(default_factory=collections.Counter)
    stale_dropped: int = 0
    backups: int = 0
    """Backup leases: a straggler's lease leased again to an idle worker (:attr:`LeaseConfig.backup_after`)."""
    backups_won: int = 0
    """Backup leases whose reply came first (the straggler's lease was then released)."""
    heads_pushed: int = 0
    """Workers that took a head record this client pushed (:meth:`RolloutClient.push_head`)."""
    by_worker: collections.Counter[str] = field(default_factory=collections.Counter)
    refusals: dict[str, str] = field(default_factory=dict)
    lag: collections.Counter[int] = field(default_factory=collections.Counter)
    rates: dict[str, float] = field(default_factory=dict)
    """Each worker's measured rate, completions per second of lease seen from the trainer (what cuts the batches)."""


@dataclass(kw_only=True)
class LeaseConfig:
    """How a trainer leases work to rollout workers (also the recipes' flags, read by ``HfArgumentParser``, with
    the help texts in ``metadata``). Raises :class:`ConfigError` naming a bad value."""

    max_lag: int = field(
        default=2, metadata={"help": "A completion made with version v is trained on only up to version v + max_lag."}
    )
    lease_timeout: float = field(
        default=60.0,
        metadata={
            "help": "Seconds a worker has for one lease (its deadline); then it goes to another worker: a worker that "
            "dies mid-lease costs at most this."
        },
    )
    rollout_timeout: float = field(
        default=60.0,
        metadata={
            "help": "Seconds without any usable rollout worker before the trainer stops waiting for a batch: it "
            "generates the batch itself with --rollout_fallback local (the default), or warns and waits on with wait."
        },
    )
    leases_per_worker: int = field(
        default=2, metadata={"help": "Leases of this trainer running on one worker at once."}
    )
    max_refusals: int = field(
        default=3,
        metadata={"help": "Failed leases (bad replies or failed checks) before a worker is refused for the run."},
    )
    backup_after: float = field(
        default=2.0,
        metadata={
            "help": "A lease still out after this many times the batch's median lease time, when nothing else is "
            "left to lease and a worker is idle, is leased to that worker too; the first valid reply is taken and "
            "the other lease released (a straggler holds a batch back by at most this). 0 turns backups off."
        },
    )

    def __post_init__(self) -> None:
        if self.max_lag < 0:
            raise ConfigError(f"max_lag must be >= 0, got {self.max_lag}")
        for name in ("lease_timeout", "rollout_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if not (self.backup_after == 0 or (self.backup_after >= 1 and math.isfinite(self.backup_after))):
            raise ConfigError(f"backup_after must be 0 (off) or a factor of at least 1, got {self.backup_after}")
        for name in ("leases_per_worker", "max_refusals"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass
class _Batch:
    groups: list[list[int]]
    num_samples: int
    max_new_tokens: int
    temperature: float
    seed: int
    #: each group's first sequence index of the sampling noise
    sequences: list[int]
    #: the oldest version a worker may generate the batch with (:attr:`Lease.min_version`)
    min_version: int = 0
    results: dict[int, GroupResult] = field(default_factory=dict)


def worker_command(
    run_id: str, *, model: str | None = None, public_key: str | None = None, initial_peers: str | None = None
) -> str:
    """The command line that starts a rollout worker serving training run ``run_id`` (the bare id: the worker
    follows ``<run_id>.policy``) with every option ``recipes/rollout_worker.py`` requires: the policy's starting
    checkpoint ``model``, the publisher's ``public_key`` file and a multiaddr of the swarm ``initial_peers``, each
    a placeholder in capitals (``MODEL_DIR``, ``PUBLISHER_KEY.pub``, ``MADDR``) when not known (the command then
    parses once the address is a multiaddr). Quoted for a POSIX shell; never raises."""
    return shlex.join(
        [
            "python",
            "recipes/rollout_worker.py",
            "--serve_rollouts",
            "--run_id",
            run_id,
            "--initial_peers",
            initial_peers or "MADDR",
            "--model_name_or_path",
            model or "MODEL_DIR",
            "--public_key",
            public_key or "PUBLISHER_KEY.pub",
        ]
    )


def _own_maddr(dht: Any) -> str | None:
    """A multiaddr (with its ``/p2p/`` peer id) at which others reach ``dht``, for the worker command; None when
    it has none or cannot say (logged at debug level; never raises)."""
    try:
        return next((str(a) for a in dht.get_visible_maddrs() if "/p2p/" in str(a)), None)
    except Exception as exc:  # a stand-in DHT, or one shutting down: the hint keeps its placeholder
        logger.debug("no multiaddr for the worker command: %r", exc)
        return None


class RolloutClient:
    """Runs batches of prompt groups on the swarm's rollout workers (see the module docstring).

    Args:
        dht: this trainer's running DHT.
        run_id: the PULSESync run the workers follow (``<run_id>.policy``).
        public_key: the publisher's key; the head record it signed says which versions exist.
        vocab_size: token ids in replies must be below it.
        config: the leases' settings (:class:`LeaseConfig`; default its defaults): ``max_lag`` (a completion made
            with version v is used only while the newest version is at most v + max_lag), ``lease_timeout`` (a
            worker's deadline for one lease), ``rollout_timeout`` (seconds without any usable worker before a batch
            fails, or warns with ``wait``), ``leases_per_worker``, and ``max_refusals`` (replies in a row that fail
            the checks of this client, or leases whose completions fail the trainer's checks,
            :meth:`report_check_failure`, however far apart, before a worker is refused for the run; refusals are
            logged and stored in the DHT, :func:`pulseloco.keys.refused_key`).
        seed: seeds the batches' sampling seeds (:meth:`next_seed`).
        worker_hint: the command that starts a worker for this run, named when no worker could take a lease
            (default: :func:`worker_command` with placeholders for the model, the key and the swarm address).
    """

    def __init__(
        self,
        dht: Any,
        run_id: str,
        public_key: Ed25519PublicKey,
        *,
        vocab_size: int,
        config: LeaseConfig | None = None,
        seed: int = 0,
        worker_hint: str | None = None,
    ) -> None:
        config = config or LeaseConfig()
        self.dht = dht
        self.worker_hint = worker_hint or worker_command(training_run_id(run_id), initial_peers=_own_maddr(dht))
        self.run_id = run_id
        self.public_key = public_key
        self.vocab_size = vocab_size
        self.config = config
        self.stats = RolloutStats()
        #: version -> state digest, from the signed head records and envelopes seen; written from the client's
        #: event loop and the caller's thread, so only through _published_version
        self.published: dict[int, str] = {}
        #: the newest version in ``published`` (None before any)
        self.newest: int | None = None
        #: set by :meth:`note_published`: this process publishes the run, so its newest version is known here
        self.own_publisher = False
        self._published_lock = threading.Lock()
        self._rng = random.Random(seed)
        self._inflight: collections.Counter[str] = collections.Counter()
        self._strikes: collections.Counter[str] = collections.Counter()
        self._cooldown: dict[str, float] = {}
        self._workers: dict[str, WorkerInfo] = {}
        self._workers_read = 0.0
        self._workers_lookup: concurrent.futures.Future[Any] | None = None
        self.host = P2PHost(dht, name="rollout-client")

    # ---- what the swarm says ------------------------------------------------------------------------------

    def newest_version(self) -> int | None:
        """The newest published version (None before any): the publisher's head record read from the DHT now, or,
        when this process publishes the run (:meth:`note_published`), the newest it announced, with no DHT read
        (a round trip on every round's path over a WAN)."""
        if not self.own_publisher:
            env = read_head(self.dht, self.run_id, self.public_key, timeout=10.0)
            if env is not None:
                self._published_version(env.version, env.digest)
        return self.newest

    def note_published(self, version: int, digest: str) -> None:
        """This process's own publisher announced ``version`` (state digest ``digest``; its head record is in the
        DHT): it is the newest the workers can find, and from now on :meth:`newest_version` does not read the DHT.
        Call from any thread; never raises."""
        self.own_publisher = True
        self._published_version(version, digest)

    def push_head(self, version: int, head: bytes) -> None:
        """Push ``head``, the signed head record of ``version`` of this process's own publisher, to every worker
        this client knows (in the background, each push bounded by :data:`HEAD_PUSH_TIMEOUT`), so that they fetch
        the version now instead of finding it at their next poll of the DHT (a poll and a DHT lookup: about a
        second at 100 ms round trips). A worker that misses the push finds the version as before; one that gets it
        checks its signature (:meth:`pulseloco.sync.subscriber.Subscriber.offer_head`). Call from any thread;
        never raises."""
        peers = [peer for peer in list(self._workers) if peer not in self.stats.refusals]
        if head and peers:
            try:
                asyncio.run_coroutine_threadsafe(self._push_head(peers, head), self.host.loop.loop)
            except RuntimeError as exc:  # the client is closing: the workers will poll
                logger.debug("head not pushed version=%d error=%r", version, exc)

    async def _push_head(self, peers: list[str], head: bytes) -> None:
        """Push ``head`` to ``peers`` at once; count those that took it. Never raises."""

        async def push(peer: str) -> bool:
            try:
                stub = RolloutServicer.get_stub(
                    self.host.p2p, PeerID.from_base58(peer), namespace=rollout_namespace(self.run_id)
                )

                async def ask() -> dict[str, Any]:
                    stream = await stub.rpc_head(runtime_pb2.ExpertRequest(metadata=head))
                    return parse_header((await read_reply(stream, timeout=HEAD_PUSH_TIMEOUT)).metadata)

                return bool((await asyncio.wait_for(ask(), HEAD_PUSH_TIMEOUT)).get("taken"))
            except Exception as exc:  # unreachable, gone, or a worker without the handler: it polls the DHT
                logger.debug("head push failed worker=%s error=%r", peer, exc)
                return False

        taken = await asyncio.gather(*(push(peer) for peer in peers))
        self.stats.heads_pushed += sum(taken)

    def workers(self, *, max_age: float = 2.0) -> dict[str, WorkerInfo]:
        """The workers' DHT records, refused workers left out. Records older than ``max_age`` s are read again in
        the background and these are returned meanwhile (a DHT lookup is a round trip or more over a WAN, and
        leases should not wait for it); only the first call, with nothing read yet, waits for the lookup
        (at most 10 s; a lookup that times out is logged and leaves the records as they were)."""
        now = time.monotonic()
        lookup = self._workers_lookup
        if lookup is not None and lookup.done():
            self._workers_lookup = None
            self._take_workers(lookup)
        if self._workers_lookup is None and now - self._workers_read >= max_age:
            first = self._workers_read == 0.0
            self._workers_read = now
            lookup = self.dht.get(workers_key(self.run_id), latest=True, return_future=True)
            if first:
                try:
                    lookup.result(10.0)
                except concurrent.futures.TimeoutError:
                    logger.warning("DHT lookup of the rollout workers timed out")
                    lookup.cancel()
                else:
                    self._take_workers(lookup)
            else:
                self._workers_lookup = lookup
        return {peer: info for peer, info in self._workers.items() if peer not in self.stats.refusals}

    def _take_workers(self, lookup: concurrent.futures.Future[Any]) -> None:
        """The workers' records from a finished DHT lookup (one that failed is logged and changes nothing)."""
        try:
            record = lookup.result(0)
        except Exception as exc:  # cancelled, or the DHT process failed the lookup
            logger.warning("DHT lookup of the rollout workers failed error=%r", exc)
            return
        found: dict[str, WorkerInfo] = {}
        if record is not None and isinstance(record.value, dict):
            for subkey, item in record.value.items():
                info = parse_worker_record(getattr(item, "value", None))
                if isinstance(subkey, str) and info is not None:
                    found[subkey] = info
        self._workers = found

    def check_version(self, version: int, digest: str, envelope: bytes = b"") -> str | None:
        """Why a reply's version claim is refused (None when it is a published version with its digest).

        A version this trainer saw in a head record is checked against that record's digest. Another one (published
        and superseded between two reads) is accepted when ``envelope`` is the publisher's signed envelope of
        that version and digest (the worker passes on the envelope of the object it applied last)."""
        if version not in self.published and (self.newest is None or version > self.newest):
            self.newest_version()  # a version published since we last looked
        if version not in self.published and envelope:
            try:
                env = verify_envelope(self.public_key, envelope, run_id=self.run_id)
            except PayloadError as exc:  # UnauthorizedError is one too
                return f"the envelope of version {version} does not verify: {exc}"
            if env.version != version or env.digest != digest:
                return f"the signed envelope names version {env.version}, digest {env.digest[:16]}, not the claimed"
            self._published_version(version, digest)
        if version not in self.published:
            return f"version {version} was not published (no head record or signed envelope says so)"
        if self.published[version] != digest:
            return f"digest {digest[:16]} is not the published digest of version {version}"
        return None

    def lag(self, version: int) -> int:
        """Versions between ``version`` and the newest published one known."""
        newest = self.newest
        return (newest if newest is not None else version) - version

    def _published_version(self, version: int, digest: str) -> None:
        with self._published_lock:
            self.published[version] = digest
            self.newest = version if self.newest is None else max(self.newest, version)

    # ---- running batches ----------------------------------------------------------------------------------

    def submit(
        self,
        groups: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        wait: bool = False,
        seed: int | None = None,
        group_ids: Sequence[int] | None = None,
        min_version: int = 0,
    ) -> concurrent.futures.Future[list[GroupResult]]:
        """Start generating ``num_samples`` completions of each prompt in ``groups`` (token ids); returns at once.
        ``min_version``: the oldest version the workers may generate them with (:attr:`Lease.min_version`).

        Sampling noise: the batch is keyed by ``seed`` (None: the next of the client's generator, see
        :meth:`next_seed`) and group ``g`` by its id ``group_ids[g]`` (default ``g``): its samples are the sequences
        ``group_ids[g] * num_samples + j``, whichever worker and lease generate them. To have some groups of a batch
        generated again exactly as they would have been, submit them with the batch's seed and their ids.

        The future's result lists one :class:`GroupResult` per group, in order. It fails with
        :class:`NoWorkersError` as the module docstring says. Raises ``ValueError`` for a ``seed`` outside
        ``[0, 2**63)`` or ``group_ids`` that are not one distinct integer >= 0 per group whose sequences fit in 32
        bits.
        """
        if seed is not None and not 0 <= seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        ids = list(range(len(groups))) if group_ids is None else [int(i) for i in group_ids]
        if len(ids) != len(groups) or len(set(ids)) != len(ids) or (ids and min(ids) < 0):
            raise ValueError(f"group_ids must be {len(groups)} distinct integers >= 0, got {list(group_ids or [])}")
        if ids and (max(ids) + 1) * num_samples > MAX_SEQUENCE:
            raise ValueError(f"group ids up to {max(ids)} with {num_samples} samples overflow 32-bit sequence indices")
        batch = _Batch(
            [list(g) for g in groups],
            num_samples,
            max_new_tokens,
            temperature,
            seed=self.next_seed() if seed is None else seed,
            sequences=[i * num_samples for i in ids],
            min_version=max(0, int(min_version)),
        )
        return asyncio.run_coroutine_threadsafe(self._run(batch, wait), self.host.loop.loop)

    def next_seed(self) -> int:
        """The next batch seed of this client's generator (seeded by the constructor's ``seed``)."""
        return self._rng.getrandbits(63)

    def _lease(self, batch: _Batch, indices: list[int]) -> Lease:
        return Lease(
            run_id=self.run_id,
            lease_id=uuid.uuid4().hex,
            prompts=[batch.groups[i] for i in indices],
            num_samples=batch.num_samples,
            max_new_tokens=batch.max_new_tokens,
            temperature=batch.temperature,
            seed=batch.seed,
            deadline_s=self.config.lease_timeout,
            sequences=[batch.sequences[i] for i in indices],
            min_version=batch.min_version,
        )

    def _usable(self, workers: dict[str, WorkerInfo], batch: _Batch) -> tuple[list[str], str]:
        """Workers that may take a lease of ``batch`` now, the fastest measured first (:func:`lease_order`), and why
        the others may not (for the message when none is usable)."""
        now = time.monotonic()
        newest = self.newest
        free, why = [], collections.Counter[str]()
        for peer, info in workers.items():
            if info.version < 0:
                why["holds no version yet"] += 1
            elif newest is not None and newest - info.version > self.config.max_lag:
                why[f"more than max_lag={self.config.max_lag} versions behind"] += 1
            elif info.max_new_tokens < batch.max_new_tokens:
                why[f"takes at most {info.max_new_tokens} new tokens, {batch.max_new_tokens} asked"] += 1
            elif self._cooldown.get(peer, 0.0) > now:
                why["cooling down after a failure"] += 1
            elif self._inflight[peer] < self.config.leases_per_worker:
                free.append(peer)
        free = lease_order(free, self.stats.rates, self._inflight, {p: workers[p].queue for p in free})
        return free, ", ".join(f"{n} {reason}" for reason, n in why.items())

    async def _run(self, batch: _Batch, wait: bool) -> list[GroupResult]:
        """Lease ``batch`` until every group has a result. Fails with :class:`NoWorkersError` (or warns, with
        ``wait``) when no lease was running for ``rollout_timeout`` s, or when every lease failed for
        ``rollout_timeout + lease_timeout`` s (workers that answer but cannot serve this batch)."""
        loop = asyncio.get_running_loop()
        workers = await loop.run_in_executor(None, self.workers)
        slots = self.config.leases_per_worker
        shares = lease_shares(sorted(workers), self.stats.rates)
        unleased = collections.deque(range(len(batch.groups)))  # groups not leased yet
        pending: collections.deque[list[int]] = collections.deque()  # leases to lease again, whole

        def take(peer: str) -> list[int]:
            """The next lease for ``peer``: one to lease again, else its share of the batch over its slots (the
            shares are cut again when a worker that was not announced at the batch's start takes a lease)."""
            nonlocal shares
            if pending:
                return pending.popleft()
            if peer not in shares:
                shares = lease_shares(sorted(set(workers) | {peer}), self.stats.rates)
            size = max(1, math.ceil(len(batch.groups) * shares[peer] / slots))
            return [unleased.popleft() for _ in range(min(size, len(unleased)))]

        running: dict[asyncio.Task[tuple[str, Any]], tuple[list[int], str, Lease]] = {}
        started: dict[asyncio.Task[tuple[str, Any]], float] = {}
        backed_up: set[tuple[int, ...]] = set()  # leases (their groups) leased a second time
        backups: set[asyncio.Task[tuple[str, Any]]] = set()  # the tasks of those second leases
        durations: list[float] = []  # this batch's leases answered in full, in seconds

        def start(peer: str, indices: list[int]) -> asyncio.Task[tuple[str, Any]]:
            lease = self._lease(batch, indices)
            self._inflight[peer] += 1
            self.stats.leases += 1
            task = asyncio.create_task(self._call(peer, lease))
            running[task], started[task] = (indices, peer, lease), time.monotonic()
            return task

        def release(task: asyncio.Task[tuple[str, Any]]) -> None:
            """Cancel a running lease (not needed, or its worker refused)."""
            task.cancel()
            _indices, peer, _lease = running.pop(task)
            started.pop(task)
            self._inflight[peer] -= 1
            self.stats.released += 1

        def requeue(indices: list[int]) -> None:
            """Lease ``indices`` again, unless a backup of them is still out."""
            if not any(other[0] == indices for other in running.values()):
                pending.appendleft(indices)

        idle_since = last_ok = head_read = time.monotonic()
        last_failure = ""
        try:
            while pending or unleased or running:
                now = time.monotonic()
                if now - head_read >= 2.0:  # the lag is measured against the newest version: keep it current
                    head_read = now
                    await loop.run_in_executor(None, self.newest_version)
                if pending or unleased:
                    workers = await loop.run_in_executor(None, self.workers)
                    free, unusable = self._usable(workers, batch)
                    # breadth first: one lease to each free worker (fastest first) before a second to any, so
                    # that a batch of fewer leases than slots is spread over as many workers as it can use
                    while (pending or unleased) and free:
                        free = [p for p in free if self._inflight[p] < slots]
                        for peer in free:
                            if not (pending or unleased):
                                break
                            start(peer, take(peer))
                    if running:
                        idle_since = now
                    failing = now - last_ok > self.config.rollout_timeout + self.config.lease_timeout
                    if now - idle_since > self.config.rollout_timeout or failing:
                        if failing:
                            message = (
                                f"every lease to the rollout workers of run {self.run_id!r} failed for "
                                f"{now - last_ok:.0f} s (last: {last_failure})"
                            )
                        else:
                            refused = len(self.stats.refusals)
                            message = (
                                f"no rollout worker of run {self.run_id!r} could take a lease for "
                                f"{self.config.rollout_timeout:.0f} s ({len(workers)} announced"
                                f"{': ' + unusable if unusable else ''}"
                                f"{f'; {refused} refused for failing the checks' if refused else ''}); start one "
                                f"with `{self.worker_hint}`"
                            )
                        if not wait:
                            raise NoWorkersError(message)
                        logger.warning("%s; still waiting", message)
                        idle_since = last_ok = now
                for task, (indices, peer, _lease) in list(running.items()):
                    if peer in self.stats.refusals:  # refused meanwhile: its open leases go to other workers
                        release(task)
                        requeue(indices)
                if not (pending or unleased) and running and durations and self.config.backup_after:
                    for peer, indices in await self._backups_due(batch, running, started, backed_up, durations, now):
                        backed_up.add(tuple(indices))
                        backups.add(start(peer, indices))
                        self.stats.backups += 1
                if not running:
                    await asyncio.sleep(0.25)
                    continue
                done, _ = await asyncio.wait(running, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    indices, peer, lease = running.pop(task)
                    took = time.monotonic() - started.pop(task)
                    self._inflight[peer] -= 1
                    kind, value = task.result()
                    if kind == "ok":
                        fresh = not all(i in batch.results for i in indices)
                        kind, value = await loop.run_in_executor(None, self._accept, batch, indices, peer, value)
                        if kind == "ok" and fresh and task in backups:
                            self.stats.backups_won += 1
                    if kind == "ok":
                        last_ok = time.monotonic()
                        durations.append(took)
                        self._note_rate(peer, len(indices) * batch.num_samples / max(took, 1e-3))
                    else:
                        last_failure = f"worker {peer[-8:]}: {kind}: {value}"
                        self._note_failure(peer, lease, kind, str(value))
                        requeue(indices)
                # a lease whose groups all have replies (its backup's or its original's) is not needed any more
                for task, (indices, _peer, _lease) in list(running.items()):
                    if all(i in batch.results for i in indices):
                        release(task)
        finally:
            for task in running:
                task.cancel()
                self._inflight[running[task][1]] -= 1
        return [batch.results[i] for i in range(len(batch.groups))]

    async def _backups_due(
        self,
        batch: _Batch,
        running: dict[asyncio.Task[tuple[str, Any]], tuple[list[int], str, Lease]],
        started: dict[asyncio.Task[tuple[str, Any]], float],
        backed_up: set[tuple[int, ...]],
        durations: list[float],
        now: float,
    ) -> list[tuple[str, list[int]]]:
        """The straggling leases to lease to an idle worker too (MapReduce's backup tasks), as ``(idle worker,
        groups)``: when nothing is left to lease, a worker holds no lease of this client, and a lease has been out
        more than ``backup_after`` times the median time of this batch's answered leases. Each lease is backed up
        once; the same groups, seed and sampling sequences, so an honest backup gives the same completions. Never
        raises."""
        median = statistics.median(durations)
        bar = self.config.backup_after * median
        late = [
            task
            for task, (indices, _peer, _lease) in running.items()
            if now - started[task] > bar and tuple(indices) not in backed_up
        ]
        if not late:
            return []
        workers = await asyncio.get_running_loop().run_in_executor(None, self.workers)
        free, _ = self._usable(workers, batch)
        idle = [p for p in free if self._inflight[p] == 0]
        due = []
        for task in sorted(late, key=lambda t: started[t]):
            indices, straggler, _lease = running[task]
            others = [p for p in idle if p != straggler]
            if not others:
                break
            idle.remove(others[0])
            due.append((others[0], indices))
            logger.info(
                "lease of %d groups out %.1f s on worker %s (batch median %.1f s): leased to %s too",
                len(indices),
                now - started[task],
                straggler[-8:],
                median,
                others[0][-8:],
            )
        return due

    async def _call(self, peer: str, lease: Lease) -> tuple[str, Any]:
        """One lease on one worker: ``("ok", Samples)`` or ``(failure kind, reason)``; never raises."""
        try:
            namespace = rollout_namespace(self.run_id)
            stub = RolloutServicer.get_stub(self.host.p2p, PeerID.from_base58(peer), namespace=namespace)

            async def exchange() -> tuple[dict[str, Any], bytes]:
                stream = await stub.rpc_generate(runtime_pb2.ExpertRequest(metadata=lease.encode()))
                return await read_stream(stream, max_bytes=reply_max_bytes(lease), timeout=lease.deadline_s)

            header, payload = await asyncio.wait_for(exchange(), lease.deadline_s + 5.0)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return "failed", f"no reply within the lease's deadline of {lease.deadline_s:.0f} s"
        except TruncatedPayloadError as exc:  # the worker died or hung up mid-reply: honest workers do that too
            return "failed", str(exc)
        except PayloadError as exc:
            return "refused", str(exc)
        except Exception as exc:  # the daemon reports a dead or unreachable peer as assorted errors
            lines = str(exc).strip().splitlines()
            return "failed", f"{type(exc).__name__}: {lines[0] if lines else 'no detail'}"
        status = header.get("status")
        if status in ("busy", "not_ready"):
            return str(status), f"worker answered {status}"
        if status != "ok":
            return "failed", f"worker answered {str(status)[:20]!r}: {str(header.get('error'))[:300]}"
        try:
            return "ok", decode_reply(lease, header, payload, vocab_size=self.vocab_size)
        except PayloadError as exc:
            return "refused", str(exc)

    def _accept(self, batch: _Batch, indices: list[int], peer: str, samples: Samples) -> tuple[str, Any]:
        """Check a decoded reply's version claim and lag; store its groups. Runs in an executor (reads the DHT)."""
        if peer in self.stats.refusals:
            return "released", "the worker was refused while the lease ran"
        why = self.check_version(samples.version, samples.digest, samples.envelope)
        if why is not None:
            return "refused", why
        lag = self.lag(samples.version)
        if lag > self.config.max_lag:
            self.stats.stale_dropped += len(indices) * batch.num_samples
            return "stale", f"version {samples.version} is {lag} versions behind (max_lag {self.config.max_lag})"
        self._strikes[peer] = 0
        for position, index in enumerate(indices):
            if index not in batch.results:  # taken once: a late duplicate of a re-leased group is ignored
                self.stats.by_worker[peer] += batch.num_samples
                batch.results[index] = GroupResult(
                    samples.version,
                    samples.digest,
                    samples.completion_ids[position],
                    samples.logprobs[position],
                    peer,
                    lease_id=samples.lease_id,
                    seed=samples.seed,
                    sequence=samples.sequences[position],
                    compute_dtype=samples.compute_dtype,
                )
        return "ok", None

    def _note_rate(self, peer: str, rate: float) -> None:
        """Fold one answered lease's rate (completions per second) into ``peer``'s measured rate."""
        old = self.stats.rates.get(peer)
        self.stats.rates[peer] = rate if old is None else (1.0 - RATE_WEIGHT) * old + RATE_WEIGHT * rate

    def _note_failure(self, peer: str, lease: Lease, kind: str, reason: str) -> None:
        self.stats.released += 1
        if kind == "released":
            return
        if kind in ("busy", "not_ready"):
            self._cooldown[peer] = time.monotonic() + 1.0
            logger.debug("lease %s back in the queue: worker=%s %s", lease.lease_id, peer, reason)
            return
        if kind == "stale":  # the worker falls behind: others first, until its record shows it caught up
            self._cooldown[peer] = time.monotonic() + 2.0
            logger.info("dropped stale completions worker=%s %s; generating them again", peer, reason)
            return
        if kind == "refused":
            self.stats.refused += 1
            self._strikes[peer] += 1
            logger.warning("refused reply worker=%s lease=%s reason=%s", peer, lease.lease_id, reason)
            if self._strikes[peer] >= self.config.max_refusals:
                self.refuse(peer, reason)
            return
        self.stats.failed += 1
        self._cooldown[peer] = time.monotonic() + 5.0
        logger.warning("lease failed worker=%s lease=%s reason=%s; leasing it again", peer, lease.lease_id, reason)

    def report_check_failure(self, peer: str, lease_id: str, reason: str) -> bool:
        """The trainer found completions of ``lease_id`` that fail its checks (:mod:`pulseloco.rollouts.sampling`):
        count it against ``peer``, and refuse the worker for the rest of the run at ``max_refusals`` such leases.
        Returns whether the worker is refused now. Thread-safe enough for its callers (one trainer thread)."""
        self.stats.check_failed += 1
        self.stats.check_failures[peer] += 1
        logger.warning(
            "completions failed the checks worker=%s lease=%s reason=%s (failed leases %d, refused at %d)",
            peer,
            lease_id,
            reason,
            self.stats.check_failures[peer],
            self.config.max_refusals,
        )
        if self.stats.check_failures[peer] >= self.config.max_refusals and peer not in self.stats.refusals:
            self.refuse(peer, reason)
        return peer in self.stats.refusals

    def refuse(self, peer: str, reason: str) -> None:
        """Refuse ``peer`` for the rest of the run: no more leases, its open leases go to other workers, its replies
        still in flight are dropped; logged, and listed in the DHT for ``pulseloco status`` (best effort)."""
        self.stats.refusals[peer] = reason[:MAX_REASON_CHARS]
        logger.warning("refusing worker %s for the rest of the run: %s", peer, reason)
        try:
            self.dht.store(
                refused_key(self.run_id),
                dict(list(self.stats.refusals.items())[-MAX_REFUSALS_LISTED:]),
                expiration_time=get_dht_time() + REFUSALS_TTL,
                subkey=self.host.peer_id.to_base58(),
                return_future=True,
            )
        except Exception as exc:  # the DHT is shutting down: the log still says it
            logger.debug("refusal record not stored error=%r", exc)

    def close(self) -> None:
        """Stop the client's P2P host (bounded; never raises)."""
        self.host.close()
