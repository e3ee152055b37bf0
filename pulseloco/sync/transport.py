"""PULSESync over hivemind: DHT records for discovery, libp2p streams for payloads.

DHT records (small, with expirations; never payloads):

- ``pulseloco:<run>:head``: the publisher's signed ``head`` envelope (newest version, its digest, newest
  anchor). Anyone on the swarm can write a record under that key, so readers verify the signature.
- ``pulseloco:<run>:providers``: one subkey per peer that serves objects, with the range of versions it holds
  and whether it is the publisher. Unsigned hints: a wrong hint costs a failed request, never wrong weights.

Payloads travel over a libp2p stream handler (``SyncServicer.rpc_fetch``, namespaced by run id) in the stream
protocol of :mod:`pulseloco.p2p`: the header carries a status and the signed envelope, the following messages
chunks of the payload. The client bounds the total size, times out every message, and verifies the envelope and
the payload's SHA-256 before handing anything back.

A fetch asks for byte ranges of an object over several streams at once (:data:`FETCH_STREAMS`). libp2p's yamux gives
every new stream a 256 KiB receive window that grows only once the stream proves fast, so one stream moves at most
256 KiB per round trip at first: a 1.25 MB patch took 0.50 s over a 100 Mbit/s link with 100 ms round trips, 8
ranges of it 0.22 s, as much as a plain TCP connection (docs/results.md, "Emulated WAN links"). How the ranges are
cut: :func:`plan_ranges`.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import itertools
import json
import logging
import threading
import time
import typing
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from pulseloco.errors import PayloadError, PayloadSizeError, TruncatedPayloadError, UnauthorizedError
from pulseloco.keys import head_key, providers_key
from pulseloco.p2p import (
    P2PHost,
    asker_closes,
    close_stream,
    header_message,
    parse_header,
    read_payload,
    stream_messages,
)
from pulseloco.sync.signing import (
    MAX_ENVELOPE_BYTES,
    Envelope,
    public_key_fingerprint,
    public_key_source,
    verify_envelope,
)

logger = logging.getLogger(__name__)

__all__ = [
    "FETCH_STREAMS",
    "PROBE_KIND",
    "RANGE_BYTES",
    "ChunkSource",
    "FetchRequest",
    "ObjectSink",
    "Provided",
    "SwarmEndpoint",
    "SyncServicer",
    "plan_ranges",
    "read_head",
    "read_head_record",
    "read_signed_head",
]

#: The request kind of :meth:`SwarmEndpoint.probe`: no provider holds it, so every live one answers "missing".
PROBE_KIND = "probe"
#: Bound on the versions one provider record lists (a few kB in the DHT).
_MAX_ANNOUNCED_VERSIONS = 1024
#: Payload bytes per stream message of an object a relay forwards while it arrives. Smaller than
#: :data:`pulseloco.p2p.CHUNK_BYTES` (1 MiB) because a relay forwards a message once it has all of it: each hop
#: of a relay tree adds one message's transfer time (21 ms at 100 Mbit/s for 256 KiB, 84 ms for 1 MiB). A complete
#: object (the publisher's store, or a relay holding all of it) goes out in :data:`pulseloco.p2p.CHUNK_BYTES`
#: messages, so the first hop's pieces are 1 MiB and a relay re-cuts each one as it arrives.
SYNC_CHUNK_BYTES = 256 << 10
#: The most streams one fetch reads an object over at once (:func:`plan_ranges`).
FETCH_STREAMS = 8
#: The fewest bytes a range of a fetch asks for: one yamux stream window, what a new stream carries per round trip.
RANGE_BYTES = 256 << 10
#: Bound on a requested offset or length (far above any object a provider serves).
_MAX_RANGE = 1 << 50


def plan_ranges(size_hint: int | None) -> list[tuple[int, int | None]]:
    """The first ranges ``(offset, length)`` of a fetch, ``length`` None for "to the end": with ``size_hint`` (the
    size of the last object of the same kind fetched) up to :data:`FETCH_STREAMS` even ranges of at least
    :data:`RANGE_BYTES` over it, the last one open-ended, so that an object a little larger still arrives in one
    round trip; without one, the first :data:`RANGE_BYTES` only (the rest follows over more streams once its
    header tells the size: :func:`split_range`)."""
    if size_hint is None:
        return [(0, RANGE_BYTES)]
    if size_hint <= RANGE_BYTES:
        return [(0, None)]
    count = min(FETCH_STREAMS, -(-size_hint // RANGE_BYTES))
    cuts = [i * size_hint // count for i in range(count)]
    return [(start, stop - start) for start, stop in itertools.pairwise(cuts)] + [(cuts[-1], None)]


def split_range(start: int, stop: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into at most :data:`FETCH_STREAMS` even ranges of at least :data:`RANGE_BYTES`."""
    if stop <= start:
        return []
    count = max(1, min(FETCH_STREAMS, (stop - start) // RANGE_BYTES))
    cuts = [start + i * (stop - start) // count for i in range(count + 1)]
    return [(a, b - a) for a, b in itertools.pairwise(cuts)]


def _range_int(value: Any, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= _MAX_RANGE:
        raise PayloadError(f"malformed fetch request: {what} must be an integer in [{minimum}, 2^50], got {value!r}")
    return value


@dataclass(frozen=True)
class FetchRequest:
    """What a subscriber asks a provider for: ``kind`` in patch/squash/anchor, the target ``version`` and,
    for squash, the ``base_version``. ``force`` asks the publisher to serve even past its upload budget.
    ``offset`` and ``length`` ask for a byte range of the payload (``length`` None: to its end); a provider counts
    an upload against its budgets for the range at offset 0 only, which every whole fetch asks for once."""

    kind: str
    version: int
    base_version: int | None = None
    force: bool = False
    offset: int = 0
    length: int | None = None

    def encode(self, run_id: str) -> bytes:
        fields: dict[str, Any] = {"run_id": run_id, **self.__dict__}
        if self.offset == 0 and self.length is None:  # a whole object: the request as before ranges
            del fields["offset"], fields["length"]
        return json.dumps(fields).encode()

    @staticmethod
    def decode(blob: bytes) -> tuple[str, FetchRequest]:
        """Parse a request from the network; raises :class:`PayloadError` on anything malformed (an offset or
        length that is not an integer in range included)."""
        try:
            raw = json.loads(blob)
            length = raw.get("length")
            req = FetchRequest(
                kind=str(raw["kind"]),
                version=int(raw["version"]),
                base_version=None if raw.get("base_version") is None else int(raw["base_version"]),
                force=bool(raw.get("force", False)),
                offset=_range_int(raw.get("offset", 0), "offset", 0),
                length=None if length is None else _range_int(length, "length", 1),
            )
            return str(raw["run_id"]), req
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            if isinstance(exc, PayloadError):
                raise
            raise PayloadError(f"malformed fetch request: {exc}") from None


class ChunkSource(Protocol):
    """A payload served while it may still be arriving (a relay's object in progress): ``size`` bytes in all,
    read by :meth:`chunks` in order."""

    size: int

    def chunks(self) -> AsyncIterator[bytes | memoryview]:
        """The payload's bytes in order, each piece at most the size it was received in; waits (bounded by the
        source's own stall timeout) for pieces still to arrive. Ends after exactly ``size`` bytes once the whole
        payload is verified; raises (:class:`PayloadError`, :class:`TimeoutError`) when its upstream failed,
        did not verify or stalled, so that the asker's stream ends with an error and it tries another provider."""
        ...


class ObjectSink(Protocol):
    """Receives an object while :meth:`SwarmEndpoint.fetch` downloads it (a relay serving it onwards).

    ``chunk`` is called with each piece of the payload in order, then exactly one of ``complete`` (the payload
    matched its signed size and SHA-256) or ``fail`` (anything else: a stall, a truncated stream, a mismatch).
    Called on the endpoint's event loop thread; must not block.
    """

    def chunk(self, data: bytes) -> None: ...

    def complete(self, payload: bytes) -> None: ...

    def fail(self, reason: str) -> None: ...


ProvidedStatus = Literal["ok", "missing", "busy"]
"""A provider's answer to a fetch (the stream header also carries ``error`` for a bad request)."""
PROVIDED_STATUSES: tuple[ProvidedStatus, ...] = typing.get_args(ProvidedStatus)

#: ``on_start(envelope, envelope_bytes)``: called once an object's signed envelope verified, before its payload
#: arrives; returns where the payload's pieces should also go, or None.
OnStart = Callable[[Envelope, bytes], "ObjectSink | None"]


@dataclass(frozen=True)
class Provided:
    """A provider's answer: ``status`` is ok, missing or busy; ``envelope`` and ``payload`` when ok, or
    ``envelope`` and ``source`` for a payload still arriving (served as it arrives)."""

    status: ProvidedStatus
    envelope: bytes = b""
    payload: bytes = b""
    source: ChunkSource | None = None
    #: called once when the answer's stream ends, however it ends (a provider counting its uploads in flight)
    on_done: Callable[[], None] | None = None


class SyncServicer(ServicerBase):
    """Serves stored objects to subscribers. ``provide`` (called in an executor) returns :class:`Provided`.

    Requests for another run or malformed requests get an error status; they never raise into the daemon.
    """

    def __init__(self, run_id: str, provide: Callable[[FetchRequest], Provided]) -> None:
        self.run_id = run_id
        self._provide = provide
        self.bytes_uploaded = 0
        self.num_uploads = 0

    @asker_closes
    async def rpc_fetch(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:  # hivemind needs typing's alias for streams
        """Stream the requested object: a header with ``status`` (ok, missing, busy or error) and, when ok, the
        base64 signed envelope, then the payload's chunks. Bad requests get an error status, never an exception.

        A payload still arriving (``Provided.source``) is forwarded as it arrives; when its upstream fails, does
        not verify or stalls, the source raises and the stream ends with hivemind's error message, which the
        asker's :meth:`SwarmEndpoint.fetch` raises (it then tries the next provider)."""
        try:
            run_id, req = FetchRequest.decode(request.metadata)
            if run_id != self.run_id:
                raise PayloadError(f"unknown run {run_id!r}")
            provided = await asyncio.get_running_loop().run_in_executor(None, self._provide, req)
        except PayloadError as exc:
            logger.warning("bad fetch request peer=%s error=%s", context.remote_id, exc)
            for message in stream_messages(runtime_pb2.ExpertResponse, {"status": "error", "error": str(exc)}):
                yield message
            return
        try:
            if provided.status != "ok":
                for message in stream_messages(runtime_pb2.ExpertResponse, {"status": provided.status}):
                    yield message
                return
            if req.offset == 0:
                self.num_uploads += 1
            total = provided.source.size if provided.source is not None else len(provided.payload)
            start = min(req.offset, total)
            stop = total if req.length is None else min(total, start + req.length)
            head = {
                "status": "ok",
                "envelope": base64.b64encode(provided.envelope).decode(),
                "total": total,
                "offset": req.offset,
            }
            if provided.source is not None:  # an object still arriving: forward its pieces as they come
                yield header_message(runtime_pb2.ExpertResponse, {**head, "size": stop - start})
                async for piece in _byte_range(provided.source.chunks(), start, stop):
                    for first in range(0, len(piece), SYNC_CHUNK_BYTES):
                        data = bytes(piece[first : first + SYNC_CHUNK_BYTES])
                        self.bytes_uploaded += len(data)
                        yield runtime_pb2.ExpertResponse(metadata=data)
            else:
                body = memoryview(provided.payload)[start:stop]
                for index, message in enumerate(stream_messages(runtime_pb2.ExpertResponse, head, [body])):
                    if index:
                        self.bytes_uploaded += len(message.metadata)
                    yield message
        finally:
            if provided.on_done is not None:
                provided.on_done()
        logger.debug(
            "served kind=%s version=%d bytes=%d-%d of %d peer=%s",
            req.kind,
            req.version,
            start,
            stop,
            total,
            context.remote_id,
        )


async def _byte_range(pieces: AsyncIterator[bytes | memoryview], start: int, stop: int) -> AsyncIterator[memoryview]:
    """The bytes ``[start, stop)`` of the concatenation of ``pieces``, as views of them; stops reading there."""
    position = 0
    async for piece in pieces:
        if position >= stop:
            break
        view = memoryview(piece).cast("B")
        first, last = max(start - position, 0), min(len(view), stop - position)
        position += len(view)
        if first < last:
            yield view[first:last]


@dataclass
class _Range:
    """One range of a fetch: asked ``offset`` and ``length`` (None: to the end); once its header came, the range's
    ``size`` (-1 before); the bytes ``received`` so far."""

    offset: int
    length: int | None
    size: int = -1
    received: int = 0


class _Download:
    """The ranges of one object fetched from one provider (:meth:`SwarmEndpoint._fetch`), assembled in place: checks
    every header against the others and the request, passes the bytes on in order to a relay's sink, and checks the
    whole at the end. Lives on the endpoint's event loop."""

    def __init__(
        self,
        peer: PeerID,
        request: FetchRequest,
        max_bytes: int,
        key: Ed25519PublicKey | None,
        on_start: OnStart | None,
        check: Callable[[PeerID, FetchRequest, Ed25519PublicKey, bytes], Envelope],
    ) -> None:
        self.peer, self.request, self.max_bytes, self.key = peer, request, max_bytes, key
        self.on_start, self.check = on_start, check
        self.ranges: list[_Range] = []
        self.total: int | None = None
        self.envelope = b""
        self.env: Envelope | None = None
        self.buffer = bytearray()
        self.sink: ObjectSink | None = None
        self.delivered = 0
        self.ended = False

    def header(self, part: _Range, head: dict[str, Any]) -> str | None:
        """Check a range's header: None when it serves the range (``total`` and ``part.size`` set), else the
        provider's status (missing, busy). Raises as :meth:`SwarmEndpoint._fetch` says."""
        peer = self.peer
        try:
            status = str(head["status"])
            envelope = base64.b64decode(head.get("envelope", ""), validate=True)
        except (ValueError, KeyError, TypeError) as exc:
            raise PayloadError(f"malformed response header from {peer}: {exc!r}") from None
        if status == "error":
            raise PayloadError(f"provider {peer} refused the request: {head.get('error')}")
        size, total = head.get("size"), head.get("total", head.get("size"))
        for name, value in (("size", size), ("total", total)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PayloadError(f"provider {peer}: stream header has no valid {name}: {value!r}")
        if status not in PROVIDED_STATUSES:
            raise PayloadError(f"provider {peer}: unknown status {status[:40]!r} in the stream header")
        if status != "ok":
            return status
        size, total = typing.cast(int, size), typing.cast(int, total)
        if total > self.max_bytes:
            raise PayloadSizeError(
                f"provider {peer}: stream declares {total} bytes, above the limit of {self.max_bytes}"
            )
        stop = total if part.length is None else min(total, part.offset + part.length)
        if head.get("offset", 0) != part.offset or size != max(0, stop - part.offset):
            raise PayloadError(
                f"provider {peer} answered bytes {head.get('offset')!r}+{size} of {total} for the range asked at "
                f"{part.offset}+{part.length}"
            )
        if self.total is None:
            self.total, self.envelope = total, envelope
            if self.key is not None:
                self.env = self.check(peer, self.request, self.key, envelope)
                if self.env.size != total:
                    raise UnauthorizedError(
                        f"provider {peer} declares {total} bytes for a payload signed as {self.env.size}"
                    )
            self.buffer = bytearray(total)
            if self.env is not None and self.on_start is not None:
                self.sink = self.on_start(self.env, envelope)
        elif total != self.total:
            raise PayloadError(f"provider {peer}: ranges of one object declare {self.total} and {total} bytes")
        elif envelope != self.envelope:
            raise UnauthorizedError(f"provider {peer} sent two different envelopes for the ranges of one object")
        part.size = size
        return None

    def data(self, part: _Range, data: bytes) -> None:
        """Write a message's bytes of ``part`` in place (read_payload bounds them by the range's size) and pass the
        bytes now contiguous from the start on to the sink."""
        at = part.offset + part.received
        self.buffer[at : at + len(data)] = data
        part.received += len(data)
        if self.sink is None:
            return
        end = self.delivered
        for other in sorted(self.ranges, key=lambda r: r.offset):
            if other.offset > end or other.size < 0:
                break
            if other.offset + other.size <= end:
                continue
            end = other.offset + other.received
            if other.received < other.size:
                break
        if end > self.delivered:
            self.sink.chunk(bytes(self.buffer[self.delivered : end]))
            self.delivered = end

    def finish(self) -> bytes:
        """The whole payload once every range arrived: checks that the ranges cover it and its SHA-256 against the
        signed one (raises :class:`TruncatedPayloadError` or :class:`UnauthorizedError`); completes the sink."""
        total = self.total or 0
        covered = 0
        for part in sorted(self.ranges, key=lambda r: r.offset):
            if part.offset > covered:
                break
            covered = max(covered, part.offset + part.received)
        payload = bytes(self.buffer)
        try:
            if covered < total:
                raise TruncatedPayloadError(f"provider {self.peer}: ranges ended after {covered} of {total} bytes")
            if self.env is not None and hashlib.sha256(payload).hexdigest() != self.env.sha256:
                raise UnauthorizedError(
                    f"payload from {self.peer} does not match its signed SHA-256: corrupted in transit or forged"
                )
        except PayloadError as exc:
            self.fail(str(exc))
            raise
        if self.sink is not None:
            if self.delivered < total:
                self.sink.chunk(payload[self.delivered :])
            self.ended = True
            self.sink.complete(payload)
        return payload

    def fail(self, reason: str) -> None:
        """Tell the sink, once, that the object will not complete."""
        if self.sink is not None and not self.ended:
            self.ended = True
            self.sink.fail(reason)


async def _first_status(tasks: list[asyncio.Task[str | None]]) -> str | None:
    """Wait for ``tasks`` (more may be appended while waiting) until all ended: None when every one served its
    range, else the first status a provider answered instead (missing, busy); raises the first exception."""
    while True:
        running = [task for task in tasks if not task.done()]
        ended = [task for task in tasks if task.done()]
        for task in ended:
            if task.exception() is not None:
                raise typing.cast(BaseException, task.exception())
            if task.result() is not None:
                return task.result()
        if not running:
            return None
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)


def stored_in_time(future: concurrent.futures.Future[bool], timeout: float, what: str) -> bool:
    """Whether the DHT store behind ``future`` landed on some node within ``timeout`` s. A store that landed on
    none, failed or is still running is logged as a warning (naming ``what``) and gives False; never raises."""
    try:
        if future.result(timeout):
            return True
        logger.warning("DHT stored %s on no node", what)
    except concurrent.futures.TimeoutError:
        logger.warning("DHT did not store %s within %.1f s", what, timeout)
    except Exception as exc:  # a failed store is a lost hint, not an error of the caller
        logger.warning("DHT store of %s failed error=%r", what, exc)
    return False


class SwarmEndpoint:
    """One process's PULSESync presence on a hivemind swarm: a P2P replica of the DHT's daemon, an optional
    servicer, and helpers for the DHT records.

    Every remote operation takes a timeout; when it passes, the operation raises :class:`TimeoutError`
    (payload transfers) or logs a warning and returns an empty answer (None, False or ``{}`` for DHT records).
    DHT calls wait on hivemind's ``MPFuture``, a :class:`concurrent.futures.Future`, whose ``result(timeout)``
    raises :class:`concurrent.futures.TimeoutError`; that is the class caught around those waits.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, *, name: str = "pulsesync") -> None:
        self.dht = dht
        self.run_id = run_id
        self.head_key = head_key(run_id)
        self.providers_key = providers_key(run_id)
        self._host = P2PHost(dht, name=f"{name}-p2p")
        self.p2p: P2P = self._host.p2p
        self.peer_id: PeerID = self._host.peer_id
        self.servicer: SyncServicer | None = None
        #: per object kind, the size of the last one fetched: how the next fetch of that kind cuts its ranges
        self._size_hints: dict[str, int] = {}

    def serve(self, provide: Callable[[FetchRequest], Provided]) -> SyncServicer:
        """Register the fetch handler on this process's P2P replica (raises :class:`TimeoutError` after 30 s)."""
        servicer = SyncServicer(self.run_id, provide)
        self._host.serve(servicer, self.run_id)
        self.servicer = servicer
        return servicer

    # ---- DHT records -------------------------------------------------------------------------------------

    def store_head(self, envelope: bytes, ttl: float, *, timeout: float = 10.0) -> bool:
        """Announce a signed head envelope; returns whether the DHT accepted it within ``timeout`` s.

        A store that does not finish in time is logged and counts as not accepted (it may still land later).
        """
        future = self.dht.store(self.head_key, envelope, expiration_time=get_dht_time() + ttl, return_future=True)
        return stored_in_time(future, timeout, "the head record")

    def get_head_record(self, *, timeout: float = 10.0) -> bytes | None:
        """The newest head record's bytes, NOT verified (see :func:`read_head_record`)."""
        return read_head_record(self.dht, self.run_id, timeout=timeout)

    def get_head(self, key: Ed25519PublicKey, *, timeout: float = 10.0) -> tuple[Envelope, bytes] | None:
        """The newest head record that verifies under ``key`` and its signed bytes, or None (see
        :func:`read_signed_head`)."""
        return read_signed_head(self.dht, self.run_id, key, timeout=timeout)

    def announce_provider(
        self,
        versions: list[int],
        *,
        publisher: bool,
        ttl: float,
        timeout: float | None = None,
        partial: list[int] | None = None,
    ) -> concurrent.futures.Future[bool]:
        """Say in the DHT that this peer serves ``versions`` (hint only); wait up to ``timeout`` s if given.
        Returns the store's future (whether some node stored the record), for a caller that waits later
        (:func:`stored_in_time`).

        ``partial``: those of ``versions`` still arriving (a relay serves them as they arrive); askers prefer
        holders of the whole object. Readers that predate the field see partial versions as held, which is safe.

        With ``timeout``, a record the DHT did not store on any node in time is logged (nobody finds this peer
        through it until a later announcement lands); never raises for that.
        """
        # every version a publisher keeps (retention bounds them) so that late joiners find old anchors; deduplicated
        listed = sorted(set(versions))[-_MAX_ANNOUNCED_VERSIONS:]
        value: dict[str, Any] = {"versions": listed, "publisher": publisher}
        if partial:
            value["partial"] = sorted(set(partial) & set(listed))
        future = self.dht.store(
            self.providers_key,
            value,
            expiration_time=get_dht_time() + ttl,
            subkey=self.peer_id.to_base58(),
            return_future=True,
        )
        if timeout is not None:
            stored_in_time(future, timeout, f"the provider record key={self.providers_key}")
        return future

    def get_providers(self, *, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
        """Peers announcing objects for this run: ``{peer_id_base58: {"versions": [...], "publisher": bool,
        "partial": [...]}}`` (``partial``: versions the peer is still receiving; empty when it says none).
        Malformed entries are skipped."""
        future = self.dht.get(self.providers_key, latest=True, return_future=True)
        try:
            found = future.result(timeout)
        except concurrent.futures.TimeoutError:
            logger.warning("DHT lookup timed out key=%s timeout=%.1f", self.providers_key, timeout)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        out = {}
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            if (
                isinstance(subkey, str)
                and isinstance(value, dict)
                and isinstance(value.get("versions"), list)
                and all(isinstance(v, int) for v in value["versions"])
            ):
                partial = value.get("partial", [])
                if not isinstance(partial, list) or not all(isinstance(v, int) for v in partial):
                    partial = []
                out[subkey] = {
                    "versions": value["versions"],
                    "publisher": bool(value.get("publisher")),
                    "partial": partial,
                }
        return out

    # ---- payload transfer --------------------------------------------------------------------------------

    async def _fetch(
        self,
        peer: PeerID,
        request: FetchRequest,
        max_bytes: int,
        chunk_timeout: float,
        key: Ed25519PublicKey | None = None,
        on_start: OnStart | None = None,
    ) -> Provided:
        """Request ``request`` from ``peer`` as byte ranges over several streams at once (:func:`plan_ranges`, the
        size hint the last object of its kind), each read in the stream protocol of :mod:`pulseloco.p2p` (a header,
        then the range's chunks); the first answer's ``total`` tells the size, and ranges still missing then go out.

        With ``key``, the envelope in the first header is verified (signature, run id, the kind and version asked
        for, the signed size equal to the declared one) and every other range must carry the same envelope; the
        assembled payload's SHA-256 is checked against the signed one at the end. ``on_start(envelope,
        envelope_bytes)`` may then return an :class:`ObjectSink` that sees the payload's bytes in order as they
        arrive and, at the end, ``complete`` or ``fail`` (always exactly one of them).

        Returns the provider's status when a range was answered missing or busy (the other streams are closed).
        Raises :class:`TimeoutError` when a message does not come within ``chunk_timeout``, :class:`PayloadError`
        for an empty stream, a header without a status or size, a range that is not the one asked for, or ranges
        that disagree on the object's size, :class:`PayloadSizeError` for a size above ``max_bytes`` or more bytes
        than declared, :class:`TruncatedPayloadError` for a stream that ends early, :class:`UnauthorizedError` for
        an envelope that does not verify or does not answer the request, ranges with different envelopes, or a
        payload that does not match its SHA-256. Every stream is closed in every case.
        """
        download = _Download(peer, request, max_bytes, key, on_start, self._check_envelope)
        tasks: list[asyncio.Task[str | None]] = []

        def launch(offset: int, length: int | None) -> None:
            part = _Range(offset, length)
            download.ranges.append(part)
            tasks.append(asyncio.create_task(self._fetch_range(peer, request, part, download, chunk_timeout, more)))

        def more(total: int) -> None:  # the size is known: ask for whatever the planned ranges left out
            ends = [part.offset + part.length for part in download.ranges if part.length is not None]
            if len(ends) == len(download.ranges):  # no range is open-ended
                for offset, length in split_range(max(ends), total):
                    launch(offset, length)

        for offset, length in plan_ranges(self._size_hints.get(request.kind)):
            launch(offset, length)
        try:
            status = await _first_status(tasks)
        except BaseException as exc:
            download.fail(f"download from {peer} failed: {exc!r}")
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if status is not None:
            download.fail(f"provider {peer} answered {status} for a range")
            return Provided(typing.cast(ProvidedStatus, status))
        payload = download.finish()
        self._size_hints[request.kind] = len(payload)
        return Provided("ok", download.envelope, payload)

    async def _fetch_range(
        self,
        peer: PeerID,
        request: FetchRequest,
        part: _Range,
        download: _Download,
        chunk_timeout: float,
        on_total: Callable[[int], None],
    ) -> str | None:
        """Read one range of ``download`` from ``peer``: None once its bytes arrived, or the provider's status
        when it did not serve (raises as :meth:`_fetch` says)."""
        ranged = replace(request, offset=part.offset, length=part.length)
        stub = SyncServicer.get_stub(self.p2p, peer, namespace=self.run_id)
        stream = await asyncio.wait_for(
            stub.rpc_fetch(runtime_pb2.ExpertRequest(metadata=ranged.encode(self.run_id))), chunk_timeout
        )
        iterator = stream.__aiter__()
        try:
            try:
                first = await asyncio.wait_for(iterator.__anext__(), chunk_timeout)
            except StopAsyncIteration:
                raise PayloadError(f"provider {peer}: the stream ended without a header") from None
            status = download.header(part, parse_header(first.metadata))
            if status is not None:
                return status
            on_total(typing.cast(int, download.total))
            await read_payload(  # the bytes go into the download's buffer as they come, not into a second copy
                iterator,
                part.size,
                timeout=chunk_timeout,
                on_chunk=lambda message: download.data(part, message.metadata),
                collect=False,
            )
            return None
        finally:  # the asker ends the stream (pulseloco.p2p.asker_closes), once it has what it asked for
            await close_stream(iterator)

    def _check_envelope(self, peer: PeerID, request: FetchRequest, key: Ed25519PublicKey, blob: bytes) -> Envelope:
        """The verified envelope of an answer to ``request``; raises :class:`UnauthorizedError` (bad signature,
        another run, or another object than the one asked for) or :class:`PayloadError` (not an envelope)."""
        env = verify_envelope(key, blob, run_id=self.run_id)
        if (
            env.kind != request.kind
            or env.version != request.version
            or (request.kind == "squash" and env.base_version != request.base_version)
        ):
            raise UnauthorizedError(
                f"provider {peer} answered a request for {request.kind} v{request.base_version}->"
                f"v{request.version} with {env.kind} v{env.base_version}->v{env.version}"
            )
        return env

    def fetch(
        self,
        peer: str | PeerID,
        request: FetchRequest,
        key: Ed25519PublicKey,
        *,
        max_bytes: int,
        timeout: float,
        chunk_timeout: float = 10.0,
        on_start: OnStart | None = None,
    ) -> tuple[Envelope, bytes, bytes] | str:
        """Fetch an object from ``peer`` and authenticate it.

        Returns ``(envelope, signed envelope bytes, payload)``, or the provider's status string
        (``missing``/``busy``) when it did not serve. The envelope is verified from the stream's header, before
        the payload arrives; ``on_start`` (see :meth:`_fetch`) then lets a relay serve the payload onwards while
        it arrives; its sink is told ``fail`` on any error below, timeouts included. Raises
        :class:`UnauthorizedError` for a bad signature, an envelope for another object, or a payload whose
        SHA-256 is not the signed one (corruption in transit or a malicious relay), :class:`PayloadError` for a
        malformed or oversized response or a provider's error (a relay whose own upstream failed),
        :class:`TimeoutError` when the provider stalls for ``chunk_timeout`` or the whole fetch exceeds
        ``timeout``.
        """
        peer_id = peer if isinstance(peer, PeerID) else PeerID.from_base58(peer)
        provided = self._host.run(
            self._fetch(peer_id, request, max_bytes, chunk_timeout, key, on_start), timeout=timeout
        )
        if provided.status != "ok":
            return provided.status
        env = self._check_envelope(peer_id, request, key, provided.envelope)
        if len(provided.payload) != env.size:  # _fetch checked both already; cheap, and keeps the contract local
            raise UnauthorizedError(f"payload from {peer_id} is not of its signed size")
        return env, provided.envelope, provided.payload

    async def _probe_one(self, peer: str, timeout: float) -> str | None:
        try:
            peer_id = PeerID.from_base58(peer)
        except Exception as exc:  # base58 and multihash errors come as assorted types
            return f"not a peer id ({exc})"
        try:
            # no provider holds this kind: a live handler answers "missing" at once and reads nothing from disk
            await asyncio.wait_for(self._fetch(peer_id, FetchRequest(PROBE_KIND, 0), 0, timeout), timeout)
        except TimeoutError:
            return f"no answer within {timeout:.1f} s"
        except Exception as exc:  # the daemon reports dial failures ("routing: not found", ...) as plain errors
            lines = str(exc).strip().splitlines()
            return f"{type(exc).__name__}: {lines[0] if lines else 'no detail'}"
        return None

    def probe(self, peers: list[str], *, timeout: float = 3.0) -> dict[str, str | None]:
        """Whether each provider's fetch handler answers: ``{peer: None}`` if it answered within ``timeout`` s,
        else ``{peer: why not}`` (one line: the dial error or the timeout).

        One request per peer, all at once, for an object kind no provider holds: reaching the handler costs a
        libp2p dial (direct or relayed) and a one-message answer, no payload and no upload budget. Never raises;
        the whole probe ends within about ``timeout`` s.
        """

        async def probe_all() -> list[str | None]:
            return list(await asyncio.gather(*(self._probe_one(p, timeout) for p in peers)))

        try:
            answers = self._host.run(probe_all(), timeout=timeout + 5.0)
        except TimeoutError:
            return {p: f"no answer within {timeout:.1f} s" for p in peers}
        return dict(zip(peers, answers))

    def close(self) -> None:
        """Remove handlers, close the replica and stop the loop (bounded; errors are logged, not raised)."""
        self._host.close()


def read_head_record(dht: hivemind.DHT, run_id: str, *, timeout: float = 10.0) -> bytes | None:
    """The newest head record's bytes, NOT verified (callers verify; ``pulseloco status`` may only show it).

    None when there is no record, when it is not bytes of at most ``MAX_ENVELOPE_BYTES`` (logged), or when
    the lookup does not finish within ``timeout`` s (logged).
    """
    key = head_key(run_id)
    future = dht.get(key, latest=True, return_future=True)
    try:
        found = future.result(timeout)
    except concurrent.futures.TimeoutError:
        logger.warning("DHT lookup timed out key=%s timeout=%.1f", key, timeout)
        return None
    if found is None:
        return None
    value = found.value
    if not isinstance(value, bytes) or len(value) > MAX_ENVELOPE_BYTES:
        logger.warning("ignoring malformed head record run=%s", run_id)
        return None
    return value


def read_head(dht: hivemind.DHT, run_id: str, key: Ed25519PublicKey, *, timeout: float = 10.0) -> Envelope | None:
    """The newest head record of ``run_id`` that verifies under ``key``, or None (nothing published, a lookup
    past ``timeout``, or a forged or malformed record, which is logged and skipped)."""
    signed = read_signed_head(dht, run_id, key, timeout=timeout)
    return None if signed is None else signed[0]


def read_signed_head(
    dht: hivemind.DHT, run_id: str, key: Ed25519PublicKey, *, timeout: float = 10.0
) -> tuple[Envelope, bytes] | None:
    """:func:`read_head` with the record's signed bytes (which vouch for the head's version and digest to anyone
    holding the public key); None as there."""
    value = read_head_record(dht, run_id, timeout=timeout)
    if value is None:
        return None
    try:
        env = verify_envelope(key, value, run_id=run_id)
    except (UnauthorizedError, PayloadError) as exc:
        _note_refused_head(run_id, key, exc)
        return None
    return (env, value) if env.kind == "head" else None


REFUSED_HEAD_SUMMARY_EVERY = 300.0
"""Seconds between the warnings that sum up a run's head records that keep failing verification (the first failure
is an error line of its own, the ones between summaries are logged at debug level)."""

_refused_heads: dict[tuple[str, str], list[float]] = {}  # (run, key fingerprint) -> [failures, last said (monotonic)]
_refused_heads_lock = threading.Lock()


def _note_refused_head(run_id: str, key: Ed25519PublicKey, exc: Exception) -> None:
    """Say that a head record of ``run_id`` fails verification under ``key``: at once and once per (run, key) as
    one error line naming the key file and what to do, then at debug level, with a warning that sums them up every
    :data:`REFUSED_HEAD_SUMMARY_EVERY` seconds (a reader polls the head every few seconds). Never raises."""
    fingerprint = public_key_fingerprint(key)
    now = time.monotonic()
    with _refused_heads_lock:
        entry = _refused_heads.get((run_id, fingerprint))
        if entry is None:
            _refused_heads[(run_id, fingerprint)] = entry = [0.0, now]
            first = True
        else:
            first = False
        entry[0] += 1
        summary = not first and now - entry[1] >= REFUSED_HEAD_SUMMARY_EVERY
        if summary:
            entry[1] = now
        failures = int(entry[0])
    if first:
        source = public_key_source(key)
        trusted = f"the public key {source} (fingerprint {fingerprint})" if source else f"the public key {fingerprint}"
        logger.error(
            "ignoring head record that fails verification run=%s error=%s: no version of this run will be used "
            "until its head verifies under %s; give the .pub file of the key the publisher signs with (`pulseloco "
            "keygen --out KEY` writes KEY and KEY.pub; the publisher prints its key's fingerprint), or the run id "
            "the publisher uses (repeats of this are logged at debug level)",
            run_id,
            exc,
            trusted,
        )
    elif summary:
        logger.warning(
            "still ignoring the head record of run=%s: it failed verification under the public key %s %d times",
            run_id,
            fingerprint,
            failures,
        )
    else:
        logger.debug("ignoring head record that fails verification run=%s error=%s", run_id, exc)


def now() -> float:
    """Wall-clock seconds, for envelopes."""
    return time.time()
