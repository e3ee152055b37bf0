"""The PULSESync subscriber: keeps a rollout worker's model at the newest published version.

``update(model)`` brings the model to the head: the next patch when one behind, one squashed patch (made and
signed by the publisher) or the chain of patches when further behind, and an anchor plus patches when it has
nothing usable. Every object is authenticated (Ed25519 envelope over the payload's SHA-256) before use and
every step is verified by state digest; a digest mismatch falls back to an anchor. Each step is applied
atomically under a lock, so a reader holding :attr:`Subscriber.lock` never sees half-applied weights. The
objects of a catch-up are downloaded and authenticated before that lock is taken, so a rollout worker keeps
generating with the current version while the next one arrives; only applying them waits for the lock.

A subscriber on the swarm is also a relay: it serves the objects it holds and says so in the DHT, so the
publisher's upload does not grow with the number of workers. It registers and announces an object as soon as
the object's signed envelope verified, and forwards the payload's chunks while they still arrive (a pipelined
relay tree); downstreams verify the SHA-256 themselves, and a download that fails ends its downstream streams
with an error (they try another provider). It says so only while others can reach it
(:func:`pulseloco.swarm.is_reachable`: a server-mode peer, or one holding a relay address from
``use_auto_relay``): a client-mode worker behind NAT that announced itself would be tried first by every other
subscriber, fail ("routing: not found") and send them all back to the publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Protocol

import hivemind
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulseloco.errors import (
    DigestMismatchError,
    PatchError,
    PayloadError,
    StalePatchError,
    TensorMismatchError,
    UnauthorizedError,
)
from pulseloco.swarm import is_reachable
from pulseloco.sync.anchor import load_anchor
from pulseloco.sync.patch import apply_patch
from pulseloco.sync.signing import Envelope, check_payload, public_key_fingerprint, verify_envelope
from pulseloco.sync.store import VersionStore
from pulseloco.sync.transport import FetchRequest, OnStart, Provided, SwarmEndpoint

logger = logging.getLogger(__name__)

__all__ = ["DirectorySource", "Head", "Subscriber", "SwarmSource", "UpdateReport"]

#: Default bound on one payload (anchor or patch) a subscriber accepts: 64 GiB, above a 30B BF16 model.
DEFAULT_MAX_PAYLOAD_BYTES = 64 << 30


@dataclass(frozen=True)
class Head:
    """The newest published version as its publisher signed it (``time``: the publisher's clock when it signed
    the head, seconds since the epoch; 0.0 when unknown)."""

    version: int
    digest: str
    anchor_version: int | None
    time: float = 0.0


@dataclass(frozen=True)
class UpdateReport:
    """One completed :meth:`Subscriber.update`: what moved and how long it took.

    ``version``: the version the model holds now (the head read when the update started); ``previous``: the one it
    held before (None for none). ``num_changed`` elements changed, ``bytes_received`` payload bytes fetched over
    ``seconds`` (fetching and applying, not the wait for :attr:`Subscriber.lock`). ``digest``: the state digest
    now held. ``lag``: how many versions the newest head, read again once the update finished, is ahead of
    ``version`` (versions published while the update ran; 0 when it is current or no head is readable then).
    ``path``: how it got there (patch, squash, chain or anchor). ``published``: when the publisher signed this
    version's head (its clock; 0.0 when unknown). ``changed``: the flat indices (int64, sorted, unique) that
    changed per tensor since ``previous``; None when every element may have changed (an anchor was applied).
    """

    version: int
    previous: int | None
    num_changed: int
    bytes_received: int
    seconds: float
    digest: str
    lag: int
    path: str
    published: float = 0.0
    changed: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    #: wall-clock time (seconds since the epoch) at which the model held ``version``, before the head was read
    #: again for ``lag``
    held_at: float = 0.0


@dataclass(frozen=True)
class Fetched:
    """An authenticated object: the parsed envelope, its signed bytes (relays re-serve them) and the payload."""

    envelope: Envelope
    envelope_blob: bytes
    payload: bytes
    kind: str


@dataclass(frozen=True)
class _Prefetch:
    """Catch-up objects fetched before :attr:`Subscriber.lock` was taken, to go from version ``base`` to ``head``:
    those of the catch-up path at ``index`` (see :meth:`Subscriber._catch_up_paths`), the earlier paths having
    served nothing or failed (logged); ``index`` is past the last path, and ``objects`` empty, when all did."""

    base: int
    head: int
    index: int
    objects: list[Fetched]


class Source(Protocol):
    """Where a subscriber gets heads and authenticated objects from."""

    def head(self) -> Head | None: ...

    def fetch(self, request: FetchRequest) -> Fetched | None: ...


class DirectorySource:
    """Objects from a version store directory (shared file system, or a synced copy of an HTTP mirror)."""

    def __init__(self, path: str | os.PathLike[str], public_key: Ed25519PublicKey, run_id: str | None = None):
        self.store = VersionStore(path, create=False)
        self.key = public_key
        self.run_id = run_id

    def head(self) -> Head | None:
        latest = self.store.latest()
        if latest is None:
            return None
        kind = "patch" if self.store.has("patch", latest) else "anchor"
        env = verify_envelope(self.key, self.store.read_envelope(kind, latest), run_id=self.run_id)
        anchors = self.store.list("anchor")
        return Head(latest, env.digest, anchors[-1] if anchors else None, env.time)

    def fetch(self, request: FetchRequest) -> Fetched | None:
        if request.kind not in ("patch", "anchor") or not self.store.has(request.kind, request.version):
            return None
        env_blob, payload = self.store.read(request.kind, request.version)
        env = verify_envelope(self.key, env_blob, run_id=self.run_id)
        check_payload(env, payload, str(self.store.object_path(request.kind, request.version)))
        return Fetched(env, env_blob, payload, request.kind)


class SwarmSource:
    """Objects from providers on a hivemind swarm: relays holding the whole object first, then relays still
    receiving it (they forward it as it arrives), each group in random order, and the publisher last.

    Every request has a timeout; a provider that stalls, answers garbage or fails authentication is logged
    and the next one is tried (a relay that failed once is not asked again for that object). When providers
    answer ``busy`` (the publisher past its upload budget, relays serving as many downloads as they will), the
    source asks again every ``poll_interval`` seconds, reading the provider records anew, so it picks up relays
    as soon as they announce (they do when an object starts arriving); after ``relay_wait`` seconds of busy
    answers it asks the publisher with ``force``. ``relay_wait`` must exceed the time the first relays need to
    start receiving the object, or the publisher ends up serving everyone.

    ``on_start`` (set by a relaying :class:`Subscriber`) is passed to :meth:`SwarmEndpoint.fetch`, so the
    object is relayed while it arrives. ``served_by`` lists, per object fetched, ``(kind, version, peer id)``
    (the newest 64).
    """

    def __init__(
        self,
        endpoint: SwarmEndpoint,
        public_key: Ed25519PublicKey,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        timeout: float = 60.0,
        chunk_timeout: float = 10.0,
        relay_wait: float = 10.0,
        poll_interval: float = 0.1,
        on_start: OnStart | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.key = public_key
        self.max_payload_bytes = max_payload_bytes
        self.timeout = timeout
        self.chunk_timeout = chunk_timeout
        self.relay_wait = relay_wait
        self.poll_interval = poll_interval
        self.on_start = on_start
        self.served_by: deque[tuple[str, int, str]] = deque(maxlen=64)

    def head(self) -> Head | None:
        env = self.endpoint.get_head(self.key)
        return None if env is None else Head(env.version, env.digest, env.anchor_version, env.time)

    def fetch(self, request: FetchRequest) -> Fetched | None:
        """The authenticated object, or None when no provider lists it or none served it by ``timeout``."""
        deadline = time.monotonic() + self.timeout
        me = self.endpoint.peer_id.to_base58()
        first_busy: float | None = None
        failed: set[str] = set()  # relays that failed this request: not asked again
        while time.monotonic() < deadline:
            providers = self.endpoint.get_providers(timeout=min(10.0, max(0.1, deadline - time.monotonic())))
            complete, partial, publishers = [], [], []
            for peer, info in providers.items():
                listed = request.kind == "squash" or request.version in info["versions"]
                if peer == me or peer in failed or not listed:
                    continue
                if info["publisher"]:
                    publishers.append(peer)
                elif request.version in info["partial"]:
                    partial.append(peer)
                else:
                    complete.append(peer)
            random.shuffle(complete)
            random.shuffle(partial)
            force = first_busy is not None and time.monotonic() - first_busy >= self.relay_wait
            busy = False
            for peer in complete + partial + publishers:
                req = FetchRequest(request.kind, request.version, request.base_version, force and peer in publishers)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    result = self.endpoint.fetch(
                        peer,
                        req,
                        self.key,
                        max_bytes=self.max_payload_bytes,
                        timeout=remaining,
                        chunk_timeout=self.chunk_timeout,
                        on_start=self.on_start,
                    )
                except Exception as exc:  # any failure of a stranger's provider: log it and try the next one
                    logger.warning("fetch failed peer=%s request=%s error=%r", peer, request, exc)
                    if peer not in publishers:
                        failed.add(peer)
                    continue
                if isinstance(result, tuple):
                    self.served_by.append((request.kind, request.version, peer))
                    return Fetched(result[0], result[1], result[2], request.kind)
                busy |= result == "busy"
            if not busy:
                return None
            if first_busy is None:
                first_busy = time.monotonic()
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
        logger.warning("no provider served request=%s within %.1f s", request, self.timeout)
        return None


#: Default bound on the bytes a relay holds (objects complete and in progress, anchors included): 1 GiB, a few
#: anchors of a ~100M-parameter model or about a hundred patches of a 1B one.
DEFAULT_RELAY_MAX_BYTES = 1 << 30
#: Default number of downloads a relay serves at once (its uplink is shared between them); more are told busy.
DEFAULT_RELAY_UPLOADS = 2


class _RelayObject:
    """One object a relay holds or is still receiving: its signed envelope, and the payload's pieces so far.

    ``done``: every byte arrived and matched the signed SHA-256; ``error``: the download failed (the object is
    then out of the relay, and readers still streaming it end with an error). Guarded by the relay's lock;
    readers on an event loop are woken through ``waiters``.
    """

    def __init__(
        self, kind: str, version: int, base_version: int | None, envelope: bytes, size: int, *, done: bool = False
    ) -> None:
        self.kind = kind
        self.version = version
        self.base_version = base_version
        self.envelope = envelope
        self.size = size
        self.chunks: list[bytes] = []
        self.received = 0
        self.done = done
        self.error: str | None = None
        self.started = time.monotonic()
        self.completed_at: float | None = time.monotonic() if done else None
        #: monotonic time at which a downstream was first sent a piece, and how many bytes downstreams were sent
        #: before this relay had the whole object (pipelining, visible to tests and logs)
        self.first_served_at: float | None = None
        self.bytes_served_early = 0
        self.readers = 0
        self.waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def wake(self) -> None:
        """Wake every reader (call with the relay's lock held)."""
        for loop, event in self.waiters:
            with contextlib.suppress(RuntimeError):  # a loop that closed has no reader left to wake
                loop.call_soon_threadsafe(event.set)


class _RelayReader:
    """A :class:`pulseloco.sync.transport.ChunkSource` over a relay object: the pieces already received at once,
    then each new one as it arrives. Raises :class:`PayloadError` when the download fails or does not verify,
    :class:`TimeoutError` when nothing arrives for ``stall_timeout`` seconds."""

    def __init__(self, relay: _Relay, obj: _RelayObject, stall_timeout: float) -> None:
        self.relay = relay
        self.obj = obj
        self.size = obj.size
        self.stall_timeout = stall_timeout

    async def chunks(self) -> AsyncIterator[bytes | memoryview]:
        obj, lock = self.obj, self.relay.lock
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        index = 0
        with lock:
            obj.waiters.add(waiter)
        try:
            while True:
                with lock:
                    waiter[1].clear()  # before reading the state, so that a piece arriving after it wakes us
                    new, done, error = obj.chunks[index:], obj.done, obj.error
                    if new and not done:
                        obj.bytes_served_early += sum(len(c) for c in new)
                        if obj.first_served_at is None:
                            obj.first_served_at = time.monotonic()
                index += len(new)
                for piece in new:
                    yield piece
                if new:
                    continue
                if error is not None:
                    raise PayloadError(f"relay's download of {obj.kind} v{obj.version} failed: {error}")
                if done:
                    return
                try:
                    await asyncio.wait_for(waiter[1].wait(), self.stall_timeout)
                except TimeoutError:
                    raise TimeoutError(
                        f"relay's download of {obj.kind} v{obj.version} stalled for {self.stall_timeout:.1f} s"
                    ) from None
        finally:
            with lock:
                obj.waiters.discard(waiter)


class _RelaySink:
    """The :class:`pulseloco.sync.transport.ObjectSink` of an object a relay receives: pieces go into the relay
    object as they arrive; a failure drops the object from the relay and ends its readers with an error."""

    def __init__(self, relay: _Relay, obj: _RelayObject) -> None:
        self.relay = relay
        self.obj = obj

    def chunk(self, data: bytes) -> None:
        with self.relay.lock:
            self.obj.chunks.append(data)
            self.obj.received += len(data)
            self.obj.wake()

    def complete(self, payload: bytes) -> None:
        with self.relay.lock:
            self.obj.done = True
            self.obj.completed_at = time.monotonic()
            self.obj.wake()
        logger.debug(
            "relayed kind=%s version=%d bytes=%d early_bytes=%d",
            self.obj.kind,
            self.obj.version,
            self.obj.size,
            self.obj.bytes_served_early,
        )

    def fail(self, reason: str) -> None:
        with self.relay.lock:
            self.obj.error = reason
            self.obj.chunks = []
            key = (self.obj.kind, self.obj.version)
            if self.relay.objects.get(key) is self.obj:
                del self.relay.objects[key]
            self.obj.wake()
        logger.info("dropped kind=%s version=%d from the relay: %s", self.obj.kind, self.obj.version, reason)
        self.relay.changed()


class _Relay:
    """Objects this subscriber holds or is receiving, served to other subscribers.

    An object is registered as soon as its signed envelope verified (:meth:`begin`, before its payload arrives)
    and served while it arrives: a downstream gets the pieces received so far, then each new one (pipelining a
    relay tree instead of storing and forwarding whole objects). The downstream verifies the SHA-256 itself;
    a download that fails or does not match drops the object and ends its downstream streams with an error.

    Bounds: at most ``capacity`` objects and ``max_bytes`` bytes (payload sizes, in-progress objects counted at
    their signed size, anchors included) and one anchor; the oldest objects that are complete and not being
    served are evicted first. An object that cannot fit (everything else in progress or being served, or larger
    than ``max_bytes`` itself) is not relayed. At most ``max_uploads`` downloads are served at once; more are
    answered ``busy``.
    """

    def __init__(
        self,
        capacity: int = 16,
        *,
        max_bytes: int = DEFAULT_RELAY_MAX_BYTES,
        max_uploads: int = DEFAULT_RELAY_UPLOADS,
        stall_timeout: float = 10.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.objects: OrderedDict[tuple[str, int], _RelayObject] = OrderedDict()
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.max_uploads = max_uploads
        self.stall_timeout = stall_timeout
        self.on_change = on_change
        self.uploads = 0
        self.lock = threading.Lock()

    @property
    def bytes_held(self) -> int:
        with self.lock:
            return sum(o.size for o in self.objects.values())

    def changed(self) -> None:
        """Tell the owner that the set of held objects changed (it re-announces); never raises."""
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # announcing is best effort; a relay keeps serving
                logger.exception("relay change hook failed")

    def _make_room(self, size: int, kind: str) -> bool:
        """Evict (lock held) until an object of ``size`` bytes fits; False (nothing evicted) when it cannot."""
        if size > self.max_bytes:
            return False

        def evictable(o: _RelayObject) -> bool:
            return o.done and o.readers == 0

        candidates = [k for k, o in self.objects.items() if evictable(o)]  # oldest first
        victims: list[tuple[str, int]] = []
        if kind == "anchor":  # a full copy of the model: keep only the newest one
            victims += [k for k in candidates if k[0] == "anchor"]
        count = len(self.objects) - len(victims) + 1
        total = sum(o.size for k, o in self.objects.items() if k not in victims) + size
        for k in candidates:
            if count <= self.capacity and total <= self.max_bytes:
                break
            if k not in victims:
                victims.append(k)
                count -= 1
                total -= self.objects[k].size
        if count > self.capacity or total > self.max_bytes:
            return False
        for k in victims:
            del self.objects[k]
        return True

    def begin(self, envelope: Envelope, blob: bytes) -> _RelaySink | None:
        """Register an object whose envelope verified and whose payload is about to arrive; returns the sink for
        its pieces, or None when it is already held or does not fit the bounds (then it is not relayed)."""
        key = (envelope.kind, envelope.version)
        with self.lock:
            held = self.objects.get(key)
            if held is not None and held.base_version == envelope.base_version and held.error is None:
                return None
            if held is not None and held.readers == 0:
                del self.objects[key]  # a squash from another base, or a failed attempt: replace it
            elif held is not None:
                return None
            if not self._make_room(envelope.size, envelope.kind):
                logger.debug("not relaying kind=%s version=%d: over the relay's bounds", *key)
                return None
            obj = _RelayObject(envelope.kind, envelope.version, envelope.base_version, blob, envelope.size)
            self.objects[key] = obj
        self.changed()
        return _RelaySink(self, obj)

    def add(self, kind: str, version: int, envelope: bytes, payload: bytes, base_version: int | None = None) -> None:
        """Hold a complete, verified object (no-op when it is held already, or when it does not fit)."""
        with self.lock:
            held = self.objects.get((kind, version))
            if held is not None and held.base_version == base_version and held.error is None:
                return
            if held is not None:
                if held.readers:
                    return
                del self.objects[(kind, version)]
            if not self._make_room(len(payload), kind):
                logger.debug("not relaying kind=%s version=%d: over the relay's bounds", kind, version)
                return
            obj = _RelayObject(kind, version, base_version, envelope, len(payload), done=True)
            obj.chunks, obj.received = [payload], len(payload)
            self.objects[(kind, version)] = obj

    def provide(self, request: FetchRequest) -> Provided:
        """Answer a fetch: ``missing`` for what is not held (or a squash from another base), ``busy`` past
        ``max_uploads`` downloads at once, else the envelope and a reader of the payload (complete or arriving)."""
        with self.lock:
            obj = self.objects.get((request.kind, request.version))
            other_base = obj is not None and request.kind == "squash" and obj.base_version != request.base_version
            if obj is None or obj.error is not None or other_base:
                return Provided("missing")  # a squash from another base is no use to the asker
            if self.uploads >= self.max_uploads:
                return Provided("busy")
            self.uploads += 1
            obj.readers += 1

        def done() -> None:
            with self.lock:
                self.uploads -= 1
                obj.readers -= 1

        return Provided("ok", obj.envelope, source=_RelayReader(self, obj, self.stall_timeout), on_done=done)

    def get(self, kind: str, version: int) -> _RelayObject | None:
        with self.lock:
            return self.objects.get((kind, version))

    def versions(self) -> list[int]:
        """Every version held or in progress."""
        with self.lock:
            return sorted({v for _, v in self.objects})

    def partial(self) -> list[int]:
        """Versions still arriving."""
        with self.lock:
            return sorted({o.version for o in self.objects.values() if not o.done})


def _union_indices(changed: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per tensor, the sorted union of the flat indices several patches wrote."""
    return {
        name: (parts[0] if len(parts) == 1 else torch.unique(torch.cat(parts), sorted=True)).to(torch.int64)
        for name, parts in changed.items()
    }


def _float_state(model: torch.nn.Module | MutableMapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


class Subscriber:
    """Follow a publisher and keep a model at its newest version.

    Args:
        dht: a running hivemind DHT (or None with ``source=``; see :meth:`from_directory`).
        run_id: the run to follow.
        public_key: the publisher's Ed25519 public key; anything not signed by it is rejected.
        relay: serve held objects to other subscribers (default True on the swarm); announced in the DHT only
            while this peer is reachable (server mode, or a relay address), otherwise logged once and skipped.
        mirror_dir: optional directory where received objects are kept (atomically); a subscriber restarted
            on it restores its last complete version without the network.
        full_checkpoints: the comparison baseline: fetch the full BF16 anchor of every version (the publisher
            must use ``anchor_every=1``) instead of patches, over the same transport and relays.
        max_payload_bytes, timeout: limits for one object and one update.
        relay_max_bytes: bound on the bytes the relay holds (objects complete and in progress, anchors included;
            oldest complete ones not being served are evicted first; an object that does not fit is not relayed).
            A subscriber that does not serve (``relay=False``, or a ``source`` such as a directory) holds nothing.
        relay_uploads: downloads the relay serves at once (others are told ``busy`` and look elsewhere).
        chunk_timeout: seconds one message of a download may take; a relay ends its downstreams with an error
            when its own download stalls that long.
        no_head_warning_after: seconds without any head (nothing published yet, or the wrong run id or key)
            after which one warning says what this subscriber is waiting for; once per wait.

    Errors: :meth:`update` raises :class:`pulseloco.errors.PatchError` only when no provider can bring the
    model to a verified version; the model then still holds its previous complete version.
    """

    def __init__(
        self,
        dht: hivemind.DHT | None,
        run_id: str,
        public_key: Ed25519PublicKey,
        *,
        source: Source | None = None,
        relay: bool = True,
        full_checkpoints: bool = False,
        mirror_dir: str | os.PathLike[str] | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        timeout: float = 60.0,
        provider_ttl: float = 30.0,
        no_head_warning_after: float = 30.0,
        relay_max_bytes: int = DEFAULT_RELAY_MAX_BYTES,
        relay_uploads: int = DEFAULT_RELAY_UPLOADS,
        chunk_timeout: float = 10.0,
    ) -> None:
        self.run_id = run_id
        self.no_head_warning_after = no_head_warning_after
        self._no_head_since: float | None = None
        self._no_head_warned = False
        self.key = public_key
        self.lock = threading.RLock()
        self.version: int | None = None
        self.digest = ""
        #: the publisher's signed envelope of the object that brought the state to ``version`` (its signature
        #: vouches for ``version`` and ``digest`` to anyone holding the public key: rollout workers pass it on)
        self.envelope = b""
        self.provider_ttl = provider_ttl
        # Only a subscriber that serves others holds objects for them: one that reads a directory, or does not
        # relay, would keep an anchor (a second full BF16 copy) in memory for nobody.
        serving = source is None and dht is not None and relay
        self._relay = _Relay(
            max_bytes=relay_max_bytes if serving else 0,
            max_uploads=relay_uploads,
            stall_timeout=chunk_timeout,
            on_change=self._request_announce,
        )
        self._announce_wanted = threading.Event()
        self._announcer: threading.Thread | None = None
        self._shadow: dict[str, torch.Tensor] | None = None
        self._changed: dict[str, list[torch.Tensor]] | None = {}  # indices written by the update in progress
        self.endpoint: SwarmEndpoint | None = None
        self._dht = dht
        self._unreachable_logged = False
        if source is None:
            if dht is None:
                raise ValueError("give a DHT or a source")
            self.endpoint = SwarmEndpoint(dht, run_id, name="subscriber")
            source = SwarmSource(
                self.endpoint,
                public_key,
                max_payload_bytes=max_payload_bytes,
                timeout=timeout,
                chunk_timeout=chunk_timeout,
                on_start=self._relay.begin if relay else None,
            )
        self.source = source
        self.full_checkpoints = full_checkpoints
        self.mirror = VersionStore(mirror_dir) if mirror_dir is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.endpoint is not None and relay:
            self.endpoint.serve(self._relay.provide)
            self._announcer = threading.Thread(target=self._announce_loop, name="pulsesync-announce", daemon=True)
            self._announcer.start()

    @classmethod
    def from_directory(
        cls,
        path: str | os.PathLike[str],
        public_key: Ed25519PublicKey,
        *,
        run_id: str | None = None,
        **kwargs,
    ) -> Subscriber:
        """A subscriber that follows a version store directory instead of the swarm."""
        return cls(None, run_id or "", public_key, source=DirectorySource(path, public_key, run_id), **kwargs)

    # ---- applying ----------------------------------------------------------------------------------------

    def _target_state(
        self, model: torch.nn.Module | MutableMapping[str, torch.Tensor]
    ) -> MutableMapping[str, torch.Tensor]:
        """The BF16 state patches are applied to: the model's own tensors when they are BF16, else a shadow."""
        state = _float_state(model)
        if all(t.dtype == torch.bfloat16 for t in state.values()):
            if isinstance(model, MutableMapping) and len(state) == len(model):
                return model  # the caller's own dict, so that an empty one adopts the publisher's tensors
            return state
        if self._shadow is None or set(self._shadow) != set(state):
            self._shadow = {k: v.detach().to("cpu", torch.bfloat16, copy=True) for k, v in state.items()}
        return self._shadow

    def _sync_model(
        self, model: torch.nn.Module | MutableMapping[str, torch.Tensor], target: MutableMapping[str, torch.Tensor]
    ) -> None:
        if target is model:
            return
        state = _float_state(model)
        if all(state[k] is target.get(k) for k in state):
            return
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(target[name])  # converts dtype and device in place: no tensor-sized temporary

    def _apply_anchor(self, target: MutableMapping[str, torch.Tensor], env: Envelope, payload: bytes) -> None:
        loaded = load_anchor(payload, expected_digest=env.digest)
        if not target:  # an empty state dict adopts the publisher's tensors (``pulseloco sync follow``)
            target.update(loaded)
            return
        if set(loaded) != set(target):
            missing = sorted(set(target) ^ set(loaded))[:5]
            raise TensorMismatchError(f"anchor tensors differ from the model's: {missing}")
        for name, t in loaded.items():
            if t.shape != target[name].shape or t.dtype != target[name].dtype:
                raise TensorMismatchError(f"anchor tensor {name!r} is {t.dtype}{tuple(t.shape)}")
        with torch.no_grad():
            for name, t in loaded.items():
                target[name].copy_(t)

    def _keep(self, obj: Fetched) -> None:
        """Remember an applied object: served to other subscribers, and kept in the mirror directory."""
        self._relay.add(obj.kind, obj.envelope.version, obj.envelope_blob, obj.payload, obj.envelope.base_version)
        if self.mirror is not None:
            # squashed patches are kept as the patch of their version: restore walks envelopes' base versions
            kind = "anchor" if obj.kind == "anchor" else "patch"
            self.mirror.write(kind, obj.envelope.version, obj.payload, obj.envelope_blob)
            self.mirror.prune(2)

    def _read_mirrored(self, mirror: VersionStore, kind: str, version: int) -> Fetched:
        """An object from the mirror directory, authenticated like one from the network: envelope signature,
        then the payload's size and SHA-256 against the signed ones. Raises :class:`PayloadError` (naming the
        file) or :class:`FileNotFoundError`."""
        env_blob, payload = mirror.read(kind, version)
        path = mirror.object_path(kind, version)
        try:
            env = verify_envelope(self.key, env_blob, run_id=self.run_id or None)
        except UnauthorizedError as exc:
            raise UnauthorizedError(f"{path}.env: {exc}") from None
        except PayloadError as exc:
            raise PayloadError(f"{path}.env: {exc}") from None
        check_payload(env, payload, str(path))
        return Fetched(env, env_blob, payload, "anchor" if kind == "anchor" else env.kind)

    def restore(self, model: torch.nn.Module | MutableMapping[str, torch.Tensor]) -> int | None:
        """Bring ``model`` to the newest complete version in the mirror directory, without the network.

        Every mirrored object is checked like one from the network (signature, then the payload's signed size
        and SHA-256). Returns that version, or None when the mirror is empty or does not verify (a warning names
        the file that failed; nothing changed and :meth:`update` starts from an anchor). Objects left
        half-written by a killed process are ignored.
        """
        if self.mirror is None or self.mirror.latest() is None:
            return None
        with self.lock:
            target = self._target_state(model)
            try:
                chain: list[Fetched] = []
                v: int | None = self.mirror.latest()
                while v is not None and not self.mirror.has("anchor", v):
                    got = self._read_mirrored(self.mirror, "patch", v)
                    chain.append(got)
                    v = got.envelope.base_version
                if v is None:
                    raise PayloadError("mirror chain does not reach an anchor")
                anchor = self._read_mirrored(self.mirror, "anchor", v)
                result = self._apply_objects(target, anchor, chain[::-1], keep=False)
            except (PatchError, PayloadError, FileNotFoundError) as exc:
                logger.warning("mirror %s does not restore (%s); starting from the swarm", self.mirror.path, exc)
                return None
            if result is None:
                return None
            self._sync_model(model, target)
            logger.info("restored version=%s from mirror=%s", self.version, self.mirror.path)
            return self.version

    def update(self, model: torch.nn.Module | MutableMapping[str, torch.Tensor]) -> int | None:
        """Bring ``model`` to the newest version; returns the version it holds afterwards (None if nothing
        was ever published). See :meth:`update_report` for what moved."""
        report = self.update_report(model)
        return report.version if report is not None else self.version

    def update_report(self, model: torch.nn.Module | MutableMapping[str, torch.Tensor]) -> UpdateReport | None:
        """Like :meth:`update`, returning an :class:`UpdateReport` (None when already current or nothing is
        published yet).

        When the model holds a version and the head is ahead, the catch-up objects (a squash, the next patch or
        the patch chain) are downloaded and authenticated (envelope signature, payload SHA-256) *before*
        :attr:`lock` is taken, so a rollout worker holding the lock keeps generating meanwhile; the lock is held
        only to apply them (each verified by state digest) and to hand the result to ``model``. Fallbacks (the
        next catch-up path after one that fails to apply, then an anchor and its patch chain) fetch under the
        lock. Assumes a single updating thread (the :meth:`follow` thread, or the caller's): the version read
        before taking the lock is checked again under it, and objects fetched for another base are discarded.

        Raises :class:`pulseloco.errors.PatchError` when no provider brings the model to the head; errors reading
        the head propagate (e.g. :class:`pulseloco.errors.UnauthorizedError` for one the publisher did not sign).
        Either way the model still holds its previous complete version.
        """
        head = self.source.head()
        if head is None:
            self._note_no_head()
            return None
        self._no_head_since, self._no_head_warned = None, False
        started = time.perf_counter()
        prefetched = self._prefetch(head)  # downloads while a rollout may hold the lock and generate
        waiting = time.perf_counter()
        with self.lock:
            waited = time.perf_counter() - waiting
            if self.version == head.version and self.digest == head.digest:
                return None
            previous = self.version
            target = self._target_state(model)
            received, changed, path = 0, 0, ""
            self._changed = {}
            if self.full_checkpoints:  # baseline: a full BF16 copy per version (publisher anchors every version)
                head = Head(head.version, head.digest, head.version, head.time)
            elif self.version is not None:
                # apply_patch checks the state's digest against each patch's base (a state changed behind our
                # back is refused there and recovered from an anchor), so no extra full-state digest here
                result = self._catch_up(target, head, prefetched)
                if result is not None:
                    received, changed, path = result
            if self.version != head.version:
                result = self._from_anchor(target, head)
                if result is None:
                    raise PatchError(
                        f"could not reach version {head.version} of run {self.run_id!r}: no provider served a "
                        "verifiable anchor and patch chain (see warnings above)"
                    )
                received, changed, path = received + result[0], result[1], result[2]
                self._changed = None
            self._sync_model(model, target)
            seconds, digest, held_at = time.perf_counter() - started - waited, self.digest, time.time()
        report = UpdateReport(
            version=head.version,
            previous=previous,
            num_changed=changed,
            bytes_received=received,
            seconds=seconds,
            digest=digest,
            lag=self._lag(head.version),
            path=path,
            published=head.time,
            held_at=held_at,
            changed=_union_indices(self._changed) if self._changed is not None else None,
        )
        self._request_announce()
        logger.info(
            "updated version=%d previous=%s changed=%d bytes=%d seconds=%.3f path=%s",
            report.version,
            previous,
            changed,
            received,
            report.seconds,
            path,
        )
        return report

    def _request_announce(self) -> None:
        """Ask the announcer thread to publish the relay's holdings (coalesced; returns at once)."""
        self._announce_wanted.set()

    def _announce_loop(self) -> None:
        """Announce the relay's objects (complete and arriving) whenever they change, and every third of
        ``provider_ttl`` so the record does not expire; until :meth:`close`. DHT errors are logged, retried."""
        while not self._stop.is_set():
            self._announce_wanted.wait(timeout=self.provider_ttl / 3)
            self._announce_wanted.clear()
            if self._stop.is_set() or self.endpoint is None:
                return
            versions = self._relay.versions()
            if not versions or not self._reachable():
                continue
            try:
                self.endpoint.announce_provider(
                    versions, partial=self._relay.partial(), publisher=False, ttl=self.provider_ttl, timeout=10.0
                )
            except Exception as exc:  # the DHT process is gone or stuck: keep the relay serving, try again later
                logger.warning("announcing the relay failed error=%r", exc)

    def _reachable(self) -> bool:
        """Whether other peers can reach this subscriber's relay (checked before every announcement: a relay
        address can arrive, or go, after start). The first refusal is logged with what to change."""
        reachable = self._dht is not None and is_reachable(self._dht)
        if not reachable and not self._unreachable_logged:
            self._unreachable_logged = True
            logger.info(
                "not announcing this subscriber as a relay: it is in client mode without a relay address, so "
                "nobody can reach it (client-mode peers reserve a relay slot on a public initial peer by default; "
                "see the log for 'no relay reservation', or set use_auto_relay true / relays)"
            )
        return reachable

    @property
    def announced(self) -> bool:
        """Whether this subscriber announces itself as a relay (it relays and is reachable now)."""
        return self.endpoint is not None and self.endpoint.servicer is not None and self._reachable()

    def _lag(self, version: int) -> int:
        """Versions the newest head (read now) is ahead of ``version``; 0 when no head is readable."""
        try:
            newest = self.source.head()
        except (PayloadError, OSError) as exc:  # the update itself succeeded; only the lag is unknown
            logger.debug("cannot read the head again for the lag: %s", exc)
            return 0
        return max(0, newest.version - version) if newest is not None else 0

    def _note_no_head(self) -> None:
        """Warn once per wait when no head has been readable for ``no_head_warning_after`` seconds."""
        now = time.monotonic()
        if self._no_head_since is None:
            self._no_head_since = now
        if self._no_head_warned or now - self._no_head_since < self.no_head_warning_after:
            return
        self._no_head_warned = True
        if isinstance(self.source, SwarmSource):
            where = (
                f"a head record under DHT key {self.source.endpoint.head_key!r} signed by the key with fingerprint "
                f"{public_key_fingerprint(self.key)}"
            )
        elif isinstance(self.source, DirectorySource):
            where = f"a version in {self.source.store.path}"
        else:
            where = f"a head from {type(self.source).__name__}"
        hint = "" if self.run_id.endswith(".policy") else " (the recipes publish under '<run_id>.policy')"
        logger.warning(
            "no version of run %r after %.0f s: waiting for %s; check the run id%s and the public key",
            self.run_id,
            now - self._no_head_since,
            where,
            hint,
        )

    def _apply_chain(
        self, target: MutableMapping[str, torch.Tensor], objects: list[Fetched], *, keep: bool = True
    ) -> int:
        changed = 0
        for obj in objects:
            info = apply_patch(target, obj.payload)
            changed += info.num_changed
            if self._changed is not None:
                for name, indices in info.changed.items():
                    self._changed.setdefault(name, []).append(indices)
            self.version, self.digest, self.envelope = obj.envelope.version, info.digest, obj.envelope_blob
            if keep:
                self._keep(obj)
            else:
                env = obj.envelope
                self._relay.add(obj.kind, env.version, obj.envelope_blob, obj.payload, env.base_version)
        return changed

    def _walk_back(self, version: int, stop: int | None) -> list[Fetched] | None:
        """Patches from ``stop`` (exclusive) to ``version``, oldest first; None if the chain cannot be fetched."""
        chain: list[Fetched] = []
        v = version
        while v != stop:
            got = self.source.fetch(FetchRequest("patch", v))
            if got is None:
                return None
            chain.append(got)
            base = got.envelope.base_version
            if base is None or (stop is not None and base < stop) or len(chain) > 10_000:
                return None
            v = base
        return chain[::-1]

    def _catch_up_paths(self, head: Head, current: int) -> list[tuple[str, Callable[[], list[Fetched] | None]]]:
        """The ways from ``current`` to ``head`` in the order they are tried, each a name and a function that
        fetches (and authenticates) its objects: a squash when more than one behind, then the next patch or the
        chain. A function returns None (or nothing) when no provider served the objects and raises what the
        source raises (:class:`PayloadError` for objects that do not authenticate)."""

        def by_squash() -> list[Fetched] | None:
            got = self.source.fetch(FetchRequest("squash", head.version, current))
            return None if got is None else [got]

        def by_chain() -> list[Fetched] | None:
            return self._walk_back(head.version, current)

        paths: list[tuple[str, Callable[[], list[Fetched] | None]]] = [
            ("patch" if head.version - current == 1 else "chain", by_chain)
        ]
        if head.version - current > 1:
            paths.insert(0, ("squash", by_squash))
        return paths

    @staticmethod
    def _fetch_path(name: str, get: Callable[[], list[Fetched] | None]) -> list[Fetched] | None:
        """The objects of one catch-up path; None when it served nothing or they failed (logged as a warning)."""
        try:
            return get() or None
        except (StalePatchError, DigestMismatchError, PayloadError) as exc:
            logger.warning("catch-up by %s failed error=%s; trying the next path", name, exc)
            return None

    def _prefetch(self, head: Head) -> _Prefetch | None:
        """Fetch, without :attr:`lock`, the objects of the first catch-up path that serves them; None when there
        is no catch-up to prepare (no version held, already at or past the head, or full checkpoints).

        Touches neither the model nor the version (a rollout may be generating with them); relies on a single
        updating thread, so that the version read here is still the one held when the lock is taken (checked
        again by :meth:`_catch_up`). Errors other than those of a failing path (logged) propagate, with the
        model untouched."""
        current = self.version
        if self.full_checkpoints or current is None or head.version <= current:
            return None
        paths = self._catch_up_paths(head, current)
        for index, (name, get) in enumerate(paths):
            objects = self._fetch_path(name, get)
            if objects:
                return _Prefetch(current, head.version, index, objects)
        return _Prefetch(current, head.version, len(paths), [])

    def _catch_up(
        self, target: MutableMapping[str, torch.Tensor], head: Head, prefetched: _Prefetch | None = None
    ) -> tuple[int, int, str] | None:
        """From the current version by one patch, a squash, or the patch chain; None on failure (the state then
        holds the last version applied completely). Call with :attr:`lock` held.

        ``prefetched``: objects :meth:`_prefetch` fetched for this base and head; they are applied first, the
        paths that failed to fetch are not tried again, and the later paths are fetched here if they fail to
        apply. Objects fetched for another base or head are discarded."""
        current = self.version
        if current is None or head.version <= current:
            return None
        paths = self._catch_up_paths(head, current)
        first: list[Fetched] | None = None
        if prefetched is not None:
            if (prefetched.base, prefetched.head) == (current, head.version):
                paths, first = paths[prefetched.index :], prefetched.objects
            else:
                logger.debug(
                    "discarding objects fetched for v%d->v%d: now at v%s", prefetched.base, prefetched.head, current
                )
        for index, (name, get) in enumerate(paths):
            objects = first if index == 0 and first else self._fetch_path(name, get)
            if not objects:
                continue
            try:
                changed = self._apply_chain(target, objects)
            except (StalePatchError, DigestMismatchError, PayloadError) as exc:
                logger.warning("catch-up by %s failed error=%s; trying the next path", name, exc)
                continue
            return sum(len(o.payload) for o in objects), changed, name
        return None

    def _apply_objects(
        self, target: MutableMapping[str, torch.Tensor], anchor: Fetched, chain: list[Fetched], *, keep: bool = True
    ) -> int | None:
        """Anchor then patches, all or nothing: on failure the previous tensors and version are restored."""
        backup = {k: v.clone() for k, v in target.items()}
        previous = (self.version, self.digest, self.envelope)
        adopted = not target
        try:
            self._apply_anchor(target, anchor.envelope, anchor.payload)
            self.version, self.digest = anchor.envelope.version, anchor.envelope.digest
            self.envelope = anchor.envelope_blob
            if keep:
                self._keep(anchor)
            changed = self._apply_chain(target, chain, keep=keep)
        except (PatchError, PayloadError) as exc:
            logger.warning("anchor and patch chain failed to apply error=%s; state restored", exc)
            with torch.no_grad():
                if adopted:
                    target.clear()
                for k, v in backup.items():
                    target[k].copy_(v)
            self.version, self.digest, self.envelope = previous
            return None
        return changed

    def _from_anchor(self, target: MutableMapping[str, torch.Tensor], head: Head) -> tuple[int, int, str] | None:
        """Restore the newest anchor, then the patch chain to the head; None (state untouched) on failure."""
        if head.anchor_version is None:
            return None
        try:
            anchor = self.source.fetch(FetchRequest("anchor", head.anchor_version))
            if anchor is None:
                return None
            version = anchor.envelope.version
            chain = [] if head.version == version else self._walk_back(head.version, version)
        except (PatchError, PayloadError) as exc:
            logger.warning("fetching the anchor failed error=%s", exc)
            return None
        if chain is None:
            return None
        changed = self._apply_objects(target, anchor, chain)
        if changed is None:
            return None
        return len(anchor.payload) + sum(len(o.payload) for o in chain), changed, "anchor"

    # ---- following ---------------------------------------------------------------------------------------

    def follow(
        self,
        model: torch.nn.Module | MutableMapping[str, torch.Tensor],
        on_update: Callable[[UpdateReport], None] | None = None,
        *,
        interval: float = 1.0,
    ) -> threading.Thread:
        """Keep ``model`` current in a background thread (until :meth:`close`); errors are logged and retried.

        Hold :attr:`lock` while generating so an update never lands mid-generation; the next version downloads
        meanwhile and is applied once the lock is released. While it follows, do not call :meth:`update` from
        another thread: updates assume one updating thread.
        """

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    report = self.update_report(model)
                    if report is not None and on_update is not None:
                        on_update(report)
                except Exception as exc:  # a follower keeps serving its last complete version
                    logger.warning("update failed error=%r; retrying in %.1f s", exc, interval)
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="pulsesync-follow", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop following and leave the swarm (bounded)."""
        self._stop.set()
        self._announce_wanted.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._announcer is not None:
            self._announcer.join(timeout=15)
        if self.endpoint is not None:
            self.endpoint.close()
