"""Where a PULSESync subscriber gets the publisher's heads and authenticated objects: a version store directory
(:class:`DirectorySource`) or the providers of a hivemind swarm (:class:`SwarmSource`: relays first, the publisher
last).

Every object a source returns is authenticated: its Ed25519 envelope verified against the publisher's public key
and its payload's size and SHA-256 checked against the signed ones. A source returns None for what it cannot get
(nothing listed, nobody served it in time); failures of single providers are logged and the next one is tried.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulseloco.sync.signing import Envelope, check_payload, verify_envelope
from pulseloco.sync.store import VersionStore
from pulseloco.sync.transport import FetchRequest, OnStart, SwarmEndpoint

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "DirectorySource", "Fetched", "Head", "Source", "SwarmSource"]

#: Default bound on one payload (anchor or patch) a subscriber accepts: 64 GiB, above a 30B BF16 model.
DEFAULT_MAX_PAYLOAD_BYTES = 64 << 30

#: Times a subscriber asks the publisher for one object whose transfer fails (a stream that ends early, a
#: timeout) before it gives up on that request; relays, which other providers can replace, are asked once.
PUBLISHER_ATTEMPTS = 3


@dataclass(frozen=True)
class Head:
    """The newest published version as its publisher signed it (``time``: the publisher's clock when it signed
    the head, seconds since the epoch; 0.0 when unknown; ``envelope_blob``: signed bytes that vouch for ``version``
    and ``digest``, empty when unknown)."""

    version: int
    digest: str
    anchor_version: int | None
    time: float = 0.0
    envelope_blob: bytes = b""


@dataclass(frozen=True)
class Fetched:
    """An authenticated object: the parsed envelope, its signed bytes (relays re-serve them) and the payload."""

    envelope: Envelope
    envelope_blob: bytes
    payload: bytes
    kind: str


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
        blob = self.store.read_envelope(kind, latest)
        env = verify_envelope(self.key, blob, run_id=self.run_id)
        anchors = self.store.list("anchor")
        return Head(latest, env.digest, anchors[-1] if anchors else None, env.time, blob)

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
    and the next one is tried (a relay that failed once is not asked again for that object; the publisher, the
    one provider that always has it, is asked up to :data:`PUBLISHER_ATTEMPTS` times, every ``poll_interval``
    seconds, so that one broken stream does not fail the update). When providers
    answer ``busy`` (the publisher past its upload budget, relays serving as many downloads as they will), the
    source asks again every ``poll_interval`` seconds, reading the provider records anew, so it picks up relays
    as soon as they announce (they do when an object starts arriving); after ``relay_wait`` seconds of busy
    answers it asks the publisher with ``force``. ``relay_wait`` must exceed the time the first relays need to
    start receiving the object, or the publisher ends up serving everyone.

    A patch or anchor newer than any version a relay listed at the last lookup is asked of the publisher first,
    without a lookup, when a peer the providers record lists as the publisher has served this source a verified
    object before (``publishers``; anyone can list itself as a publisher, so a listing alone earns no first try,
    and a peer that fails a first try loses it): right after a version is
    published no relay holds it yet, so the lookup could only name the publisher, and a subscriber woken by a
    pushed head record (:meth:`Subscriber.offer_head`) would spend a DHT round trip, or more, learning that. A
    ``busy`` (the publisher past its upload budget), ``missing`` or failed answer falls back to the lookup and the
    order above.

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
        #: peers listed as the publisher that served this source a verified object (asked first for a new version)
        self.publishers: list[str] = []
        #: the newest version a relay listed complete at the last lookup (-1: none)
        self._relayed = -1

    def _providers(
        self, request: FetchRequest, me: str, failed: set[str], deadline: float
    ) -> tuple[list[str], list[str], list[str]]:
        """Look the providers up: ``(complete relays, relays still receiving, publishers)`` listing ``request``,
        relays shuffled, this peer and ``failed`` left out; for a patch or anchor newer than every version a
        publisher's entry lists, that publisher too (its entry may not list it yet: a pushed head reaches workers
        before the publisher's record is stored, while relays served by it already list the version). Remembers
        the newest version a relay holds complete, for the next request's first try."""
        providers = self.endpoint.get_providers(timeout=min(10.0, max(0.1, deadline - time.monotonic())))
        complete, partial, publishers = [], [], []
        relayed = -1
        for peer, info in providers.items():
            if not info["publisher"] and peer != me:
                relayed = max([relayed, *(v for v in info["versions"] if v not in info["partial"])])
            listed = request.kind == "squash" or request.version in info["versions"]
            if info["publisher"] and request.kind in ("patch", "anchor"):
                # the publisher holds a version newer than its record, or answers missing
                listed = listed or request.version > max(info["versions"], default=-1)
            if peer == me or peer in failed or not listed:
                continue
            if info["publisher"]:
                publishers.append(peer)
            elif request.version in info["partial"]:
                partial.append(peer)
            else:
                complete.append(peer)
        self._relayed = relayed
        random.shuffle(complete)
        random.shuffle(partial)
        return complete, partial, publishers

    def head(self) -> Head | None:
        signed = self.endpoint.get_head(self.key)
        if signed is None:
            return None
        env, blob = signed
        return Head(env.version, env.digest, env.anchor_version, env.time, blob)

    def fetch(self, request: FetchRequest) -> Fetched | None:
        """The authenticated object, or None when no provider lists it or none served it by ``timeout``."""
        deadline = time.monotonic() + self.timeout
        me = self.endpoint.peer_id.to_base58()
        first_busy: float | None = None
        failed: set[str] = set()  # relays that failed this request, publishers that failed it every attempt
        failures: dict[str, int] = {}  # failed transfers per provider
        direct = request.kind in ("patch", "anchor") and request.version > self._relayed
        while time.monotonic() < deadline:
            tried_direct = direct
            if direct:  # the first try only: the publishers of the last lookup, no lookup now
                complete: list[str] = []
                partial: list[str] = []
                publishers = [peer for peer in self.publishers if peer != me]
                direct = False
            else:
                complete, partial, publishers = self._providers(request, me, failed, deadline)
            force = first_busy is not None and time.monotonic() - first_busy >= self.relay_wait
            busy = retry = False
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
                    if tried_direct and peer in self.publishers:
                        self.publishers.remove(peer)  # no first try again until it serves a verified object
                    failures[peer] = failures.get(peer, 0) + 1
                    if peer in publishers and failures[peer] < PUBLISHER_ATTEMPTS:
                        retry = True
                    else:
                        failed.add(peer)
                    continue
                if isinstance(result, tuple):
                    self.served_by.append((request.kind, request.version, peer))
                    if peer in publishers and peer not in self.publishers:
                        self.publishers.append(peer)
                    return Fetched(result[0], result[1], result[2], request.kind)
                busy |= result == "busy"
            if tried_direct and not busy:
                continue  # the publisher did not have it, or failed: look the providers up
            if not busy and not retry:
                return None
            if busy and first_busy is None:
                first_busy = time.monotonic()
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
        logger.warning("no provider served request=%s within %.1f s", request, self.timeout)
        return None
