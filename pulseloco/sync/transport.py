"""PULSESync over hivemind: DHT records for discovery, libp2p streams for payloads.

DHT records (small, with expirations; never payloads):

- ``pulseloco:<run>:head``: the publisher's signed ``head`` envelope (newest version, its digest, newest
  anchor). Anyone on the swarm can write a record under that key, so readers verify the signature.
- ``pulseloco:<run>:providers``: one subkey per peer that serves objects, with the range of versions it holds
  and whether it is the publisher. Unsigned hints: a wrong hint costs a failed request, never wrong weights.

Payloads travel over a libp2p stream handler (``SyncServicer.rpc_fetch``, namespaced by run id): the first
message carries a status and the signed envelope, the following ones chunks of the payload. The client
bounds the total size, times out every chunk, and verifies the envelope and the payload's SHA-256 before
handing anything back.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import threading
import time
import typing
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time

from pulseloco.errors import PayloadError, PayloadSizeError, UnauthorizedError
from pulseloco.sync.signing import MAX_ENVELOPE_BYTES, Envelope, verify_envelope

logger = logging.getLogger(__name__)

__all__ = [
    "CHUNK_BYTES",
    "FetchRequest",
    "LoopThread",
    "Provided",
    "SwarmEndpoint",
    "SyncServicer",
]

T = TypeVar("T")
#: Payload chunk size on the stream, well below hivemind's 4 MiB message limit.
CHUNK_BYTES = 1 << 20
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


class LoopThread:
    """An asyncio event loop in a daemon thread, for hivemind's async P2P API from synchronous code."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it; raises :class:`TimeoutError` after ``timeout`` s."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        """Stop the loop and join the thread (bounded)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


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
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # hivemind needs typing's alias for streams
        try:
            run_id, req = FetchRequest.decode(request.metadata)
            if run_id != self.run_id:
                raise PayloadError(f"unknown run {run_id!r}")
            provided = await asyncio.get_running_loop().run_in_executor(None, self._provide, req)
        except PayloadError as exc:
            logger.warning("bad fetch request peer=%s error=%s", context.remote_id, exc)
            yield averaging_pb2.DownloadData(metadata=json.dumps({"status": "error", "error": str(exc)}).encode())
            return
        head = {"status": provided.status, "size": len(provided.payload)}
        if provided.status == "ok":
            head["envelope"] = base64.b64encode(provided.envelope).decode()
        yield averaging_pb2.DownloadData(metadata=json.dumps(head).encode())
        if provided.status != "ok":
            return
        self.num_uploads += 1
        view = memoryview(provided.payload)
        for start in range(0, len(view), CHUNK_BYTES):
            chunk = bytes(view[start : start + CHUNK_BYTES])
            self.bytes_uploaded += len(chunk)
            yield averaging_pb2.DownloadData(metadata=chunk)
        logger.debug("served kind=%s version=%d bytes=%d peer=%s", req.kind, req.version, len(view), context.remote_id)


async def _daemon_listen_maddr(_dht: hivemind.DHT, node: hivemind.DHTNode) -> Any:
    """Runs in the DHT process: where its P2P daemon listens for local clients."""
    return node.p2p.daemon_listen_maddr


class SwarmEndpoint:
    """One process's PULSESync presence on a hivemind swarm: a P2P replica of the DHT's daemon, an optional
    servicer, and helpers for the DHT records.

    Every remote operation takes a timeout and raises :class:`TimeoutError` or returns None when it passes.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, *, name: str = "pulsesync") -> None:
        self.dht = dht
        self.run_id = run_id
        self.head_key = f"pulseloco:{run_id}:head"
        self.providers_key = f"pulseloco:{run_id}:providers"
        self._loop = LoopThread(f"{name}-p2p")
        # A replica of our own, not dht.replicate_p2p(): that one is cached per DHT and bound to the loop that
        # made it, so a second endpoint on the same DHT (a publisher restarted in-process) would reuse a replica
        # the first one shut down.
        daemon_maddr = dht.run_coroutine(_daemon_listen_maddr)
        self.p2p: P2P = self._loop.run(P2P.replicate(daemon_maddr), timeout=30)
        self.peer_id: PeerID = self.p2p.peer_id
        self.servicer: SyncServicer | None = None

    def serve(self, provide: Callable[[FetchRequest], Provided]) -> SyncServicer:
        """Register the fetch handler on this process's P2P replica."""
        servicer = SyncServicer(self.run_id, provide)
        self._loop.run(servicer.add_p2p_handlers(self.p2p, namespace=self.run_id), timeout=30)
        self.servicer = servicer
        return servicer

    # ---- DHT records -------------------------------------------------------------------------------------

    def store_head(self, envelope: bytes, ttl: float) -> bool:
        """Announce a signed head envelope; returns whether the DHT accepted it."""
        return bool(self.dht.store(self.head_key, envelope, expiration_time=get_dht_time() + ttl))

    def get_head(self, key: Ed25519PublicKey, *, timeout: float = 10.0) -> Envelope | None:
        """The newest head record that verifies under ``key``, or None. Forged records are logged, skipped."""
        future = self.dht.get(self.head_key, latest=True, return_future=True)
        try:
            found = future.result(timeout)
        except TimeoutError:
            logger.warning("DHT lookup timed out key=%s timeout=%.1f", self.head_key, timeout)
            return None
        if found is None:
            return None
        value = found.value
        if not isinstance(value, bytes) or len(value) > MAX_ENVELOPE_BYTES:
            logger.warning("ignoring malformed head record run=%s", self.run_id)
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
            except TimeoutError:
                logger.warning("DHT did not store the provider record within %.1f s", timeout)

    def get_providers(self, *, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
        """Peers announcing objects for this run: ``{peer_id_base58: {"versions": [...], "publisher": bool}}``."""
        future = self.dht.get(self.providers_key, latest=True, return_future=True)
        try:
            found = future.result(timeout)
        except TimeoutError:
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
        stub = SyncServicer.get_stub(self.p2p, peer, namespace=self.run_id)
        stream = await asyncio.wait_for(
            stub.rpc_fetch(runtime_pb2.ExpertRequest(metadata=request.encode(self.run_id))), chunk_timeout
        )
        iterator = stream.__aiter__()
        try:
            first = await asyncio.wait_for(iterator.__anext__(), chunk_timeout)
        except StopAsyncIteration:
            raise PayloadError(f"provider {peer} closed the stream without answering") from None
        try:
            head = json.loads(first.metadata)
            status, size = str(head["status"]), int(head["size"])
            envelope = base64.b64decode(head.get("envelope", ""), validate=True)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise PayloadError(f"malformed response header from {peer}: {exc}") from None
        if status != "ok":
            return Provided(status)
        if size > max_bytes:
            raise PayloadSizeError(f"provider {peer} offers {size} bytes, above the limit of {max_bytes}")
        parts: list[bytes] = []
        received = 0
        while received < size:
            try:
                msg = await asyncio.wait_for(iterator.__anext__(), chunk_timeout)
            except StopAsyncIteration:
                raise PayloadSizeError(f"provider {peer} ended the stream after {received} of {size} bytes") from None
            received += len(msg.metadata)
            if received > size:
                raise PayloadSizeError(f"provider {peer} sent more than the {size} bytes it announced")
            parts.append(msg.metadata)
        return Provided("ok", envelope, b"".join(parts))

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
        provided = self._loop.run(self._fetch(peer_id, request, max_bytes, chunk_timeout), timeout=timeout)
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

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run a coroutine on this endpoint's loop."""
        return self._loop.run(coro, timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        """Remove handlers and stop the loop (bounded; errors are logged, not raised)."""
        try:
            if self.servicer is not None:
                self._loop.run(self.servicer.remove_p2p_handlers(self.p2p, namespace=self.run_id), timeout=5)
        except Exception as exc:  # shutting down: report, do not mask the caller's own exception
            logger.debug("error removing handlers: %s", exc)
        try:
            self._loop.run(self.p2p.shutdown(), timeout=5)
        except Exception as exc:
            logger.debug("error closing the P2P replica: %s", exc)
        self._loop.stop()


def now() -> float:
    """Wall-clock seconds, for envelopes."""
    return time.time()
