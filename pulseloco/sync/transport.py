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
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import json
import logging
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from pulseloco.errors import PayloadError, UnauthorizedError
from pulseloco.p2p import P2PHost, read_stream, stream_messages
from pulseloco.sync.signing import MAX_ENVELOPE_BYTES, Envelope, verify_envelope

logger = logging.getLogger(__name__)

__all__ = [
    "PROBE_KIND",
    "FetchRequest",
    "Provided",
    "SwarmEndpoint",
    "SyncServicer",
]

#: The request kind of :meth:`SwarmEndpoint.probe`: no provider holds it, so every live one answers "missing".
PROBE_KIND = "probe"
#: Bound on the versions one provider record lists (a few kB in the DHT).
_MAX_ANNOUNCED_VERSIONS = 1024


@dataclass(frozen=True)
class FetchRequest:
    """What a subscriber asks a provider for: ``kind`` in patch/squash/anchor, the target ``version`` and,
    for squash, the ``base_version``. ``force`` asks the publisher to serve even past its upload budget."""

    kind: str
    version: int
    base_version: int | None = None
    force: bool = False

    def encode(self, run_id: str) -> bytes:
        return json.dumps({"run_id": run_id, **self.__dict__}).encode()

    @staticmethod
    def decode(blob: bytes) -> tuple[str, FetchRequest]:
        """Parse a request from the network; raises :class:`PayloadError` on anything malformed."""
        try:
            raw = json.loads(blob)
            req = FetchRequest(
                kind=str(raw["kind"]),
                version=int(raw["version"]),
                base_version=None if raw.get("base_version") is None else int(raw["base_version"]),
                force=bool(raw.get("force", False)),
            )
            return str(raw["run_id"]), req
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise PayloadError(f"malformed fetch request: {exc}") from None


@dataclass(frozen=True)
class Provided:
    """A provider's answer: ``status`` is ok, missing or busy; ``envelope`` and ``payload`` when ok."""

    status: str
    envelope: bytes = b""
    payload: bytes = b""


class SyncServicer(ServicerBase):
    """Serves stored objects to subscribers. ``provide`` (called in an executor) returns :class:`Provided`.

    Requests for another run or malformed requests get an error status; they never raise into the daemon.
    """

    def __init__(self, run_id: str, provide: Callable[[FetchRequest], Provided]) -> None:
        self.run_id = run_id
        self._provide = provide
        self.bytes_uploaded = 0
        self.num_uploads = 0

    async def rpc_fetch(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:  # hivemind needs typing's alias for streams
        """Stream the requested object: a header with ``status`` (ok, missing, busy or error) and, when ok, the
        base64 signed envelope, then the payload's chunks. Bad requests get an error status, never an exception."""
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
        if provided.status != "ok":
            for message in stream_messages(runtime_pb2.ExpertResponse, {"status": provided.status}):
                yield message
            return
        self.num_uploads += 1
        head = {"status": "ok", "envelope": base64.b64encode(provided.envelope).decode()}
        for index, message in enumerate(stream_messages(runtime_pb2.ExpertResponse, head, [provided.payload])):
            if index:
                self.bytes_uploaded += len(message.metadata)
            yield message
        logger.debug(
            "served kind=%s version=%d bytes=%d peer=%s",
            req.kind,
            req.version,
            len(provided.payload),
            context.remote_id,
        )


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
        self.head_key = f"pulseloco:{run_id}:head"
        self.providers_key = f"pulseloco:{run_id}:providers"
        self._host = P2PHost(dht, name=f"{name}-p2p")
        self.p2p: P2P = self._host.p2p
        self.peer_id: PeerID = self._host.peer_id
        self.servicer: SyncServicer | None = None

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
        try:
            return bool(future.result(timeout))
        except concurrent.futures.TimeoutError:
            logger.warning("DHT did not store the head record within %.1f s key=%s", timeout, self.head_key)
            return False

    def get_head_record(self, *, timeout: float = 10.0) -> bytes | None:
        """The newest head record's bytes, NOT verified (callers verify; ``pulseloco status`` may only show it).

        None when there is no record, when it is not bytes of at most ``MAX_ENVELOPE_BYTES`` (logged), or when
        the lookup does not finish within ``timeout`` s (logged).
        """
        future = self.dht.get(self.head_key, latest=True, return_future=True)
        try:
            found = future.result(timeout)
        except concurrent.futures.TimeoutError:
            logger.warning("DHT lookup timed out key=%s timeout=%.1f", self.head_key, timeout)
            return None
        if found is None:
            return None
        value = found.value
        if not isinstance(value, bytes) or len(value) > MAX_ENVELOPE_BYTES:
            logger.warning("ignoring malformed head record run=%s", self.run_id)
            return None
        return value

    def get_head(self, key: Ed25519PublicKey, *, timeout: float = 10.0) -> Envelope | None:
        """The newest head record that verifies under ``key``, or None. Forged records are logged, skipped."""
        value = self.get_head_record(timeout=timeout)
        if value is None:
            return None
        try:
            env = verify_envelope(key, value, run_id=self.run_id)
        except (UnauthorizedError, PayloadError) as exc:
            logger.warning("ignoring head record that fails verification run=%s error=%s", self.run_id, exc)
            return None
        return env if env.kind == "head" else None

    def announce_provider(
        self, versions: list[int], *, publisher: bool, ttl: float, timeout: float | None = None
    ) -> None:
        """Say in the DHT that this peer serves ``versions`` (hint only); wait up to ``timeout`` s if given."""
        # every version a publisher keeps (retention bounds them) so that late joiners find old anchors; deduplicated
        value = {"versions": sorted(set(versions))[-_MAX_ANNOUNCED_VERSIONS:], "publisher": publisher}
        future = self.dht.store(
            self.providers_key,
            value,
            expiration_time=get_dht_time() + ttl,
            subkey=self.peer_id.to_base58(),
            return_future=True,
        )
        if timeout is not None:
            try:
                future.result(timeout)
            except concurrent.futures.TimeoutError:
                logger.warning("DHT did not store the provider record within %.1f s", timeout)

    def get_providers(self, *, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
        """Peers announcing objects for this run: ``{peer_id_base58: {"versions": [...], "publisher": bool}}``."""
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
                out[subkey] = {"versions": value["versions"], "publisher": bool(value.get("publisher"))}
        return out

    # ---- payload transfer --------------------------------------------------------------------------------

    async def _fetch(self, peer: PeerID, request: FetchRequest, max_bytes: int, chunk_timeout: float) -> Provided:
        """Request ``request`` from ``peer`` and read the answer (see :func:`pulseloco.p2p.read_stream` for the
        errors; a header without a status or with a bad envelope raises :class:`PayloadError`)."""
        stub = SyncServicer.get_stub(self.p2p, peer, namespace=self.run_id)
        stream = await asyncio.wait_for(
            stub.rpc_fetch(runtime_pb2.ExpertRequest(metadata=request.encode(self.run_id))), chunk_timeout
        )
        try:
            head, payload = await read_stream(stream, max_bytes=max_bytes, timeout=chunk_timeout)
        except PayloadError as exc:
            raise type(exc)(f"provider {peer}: {exc}") from None
        try:
            status = str(head["status"])
            envelope = base64.b64decode(head.get("envelope", ""), validate=True)
        except (ValueError, KeyError, TypeError) as exc:
            raise PayloadError(f"malformed response header from {peer}: {exc!r}") from None
        if status == "error":
            raise PayloadError(f"provider {peer} refused the request: {head.get('error')}")
        if status != "ok":
            return Provided(status)
        return Provided("ok", envelope, payload)

    def fetch(
        self,
        peer: str | PeerID,
        request: FetchRequest,
        key: Ed25519PublicKey,
        *,
        max_bytes: int,
        timeout: float,
        chunk_timeout: float = 10.0,
    ) -> tuple[Envelope, bytes, bytes] | str:
        """Fetch an object from ``peer`` and authenticate it.

        Returns ``(envelope, signed envelope bytes, payload)``, or the provider's status string
        (``missing``/``busy``) when it did not serve. Raises :class:`UnauthorizedError` for a bad signature
        or a payload whose SHA-256 is not the signed one (corruption in transit or a malicious relay),
        :class:`PayloadError` for a malformed or oversized response, :class:`TimeoutError` when the provider
        stalls.
        """
        peer_id = peer if isinstance(peer, PeerID) else PeerID.from_base58(peer)
        provided = self._host.run(self._fetch(peer_id, request, max_bytes, chunk_timeout), timeout=timeout)
        if provided.status != "ok":
            return provided.status
        env = verify_envelope(key, provided.envelope, run_id=self.run_id)
        if (
            env.kind != request.kind
            or env.version != request.version
            or (request.kind == "squash" and env.base_version != request.base_version)
        ):
            raise UnauthorizedError(
                f"provider {peer_id} answered a request for {request.kind} v{request.base_version}->"
                f"v{request.version} with {env.kind} v{env.base_version}->v{env.version}"
            )
        if len(provided.payload) != env.size or hashlib.sha256(provided.payload).hexdigest() != env.sha256:
            raise UnauthorizedError(
                f"payload from {peer_id} does not match its signed SHA-256: corrupted in transit or forged"
            )
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


def now() -> float:
    """Wall-clock seconds, for envelopes."""
    return time.time()
