"""What PULSELoCo and PULSESync share about hivemind's libp2p layer.

- :class:`BackgroundLoop`: an asyncio event loop in a daemon thread, so that synchronous code (the training
  loop, a publisher's worker, a subscriber) runs hivemind's async P2P calls with a timeout on every wait;
- :class:`P2PHost`: that loop plus a P2P client ("replica") of the DHT's daemon bound to it, and the
  ``ServicerBase`` handlers served on it; its :meth:`P2PHost.close` removes the handlers, closes the replica
  and stops the loop, so a component restarted in-process on the same DHT starts clean;
- :func:`listen_with_backlog`: the replica takes the daemon's connections for incoming streams with an accept
  backlog of :data:`LISTEN_BACKLOG` instead of asyncio's 100 (a burst that found the backlog full was reset
  with nothing sent: "the stream ended without a header");
- :func:`stream_messages` / :func:`read_stream`: the one stream protocol of both paths (docs/design.md
  section 3.4): a first message whose ``metadata`` is a JSON object header carrying the payload's ``size``,
  then the payload in chunks of at most :data:`CHUNK_BYTES`, one per message ``metadata``. The reader bounds
  the declared and the received size, times out every message, reads exactly the declared bytes and then
  closes the stream;
- :func:`asker_closes`: the asker, not the server, ends every stream. A server that closes its end first can
  make its daemon reset the stream and discard the reply's last bytes before the asker's daemon delivered them
  (:data:`STREAM_LINGER_S`); so a stream handler keeps its stream open after its last message until the asker
  closes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase

from pulseloco.errors import PayloadError, PayloadSizeError, SwarmError, TruncatedPayloadError

logger = logging.getLogger(__name__)

__all__ = [
    "CHUNK_BYTES",
    "LISTEN_BACKLOG",
    "STREAM_LINGER_S",
    "BackgroundLoop",
    "P2PHost",
    "SwarmTimeoutError",
    "asker_closes",
    "close_stream",
    "daemon_listen_maddr",
    "header_message",
    "listen_with_backlog",
    "parse_header",
    "read_payload",
    "read_reply",
    "read_stream",
    "replicate_p2p",
    "stream_messages",
]

T = TypeVar("T")
#: Largest payload chunk per protobuf message (the daemon's 4 MiB limit is on its persistent connection, for unary
#: calls; a stream passed a 9 MB message on loopback, but small messages keep every buffer on the way small).
CHUNK_BYTES = 1 << 20
#: Accept backlog of the socket on which a replica takes its daemon's connections, one per incoming stream (the
#: kernel caps it at ``net.core.somaxconn``). hivemind 1.1.12 listens with asyncio's default of 100
#: (``p2p_daemon_bindings/control.py:161``): while the replica's event loop is stalled (CPU load, a long
#: GIL-holding step), the 102nd waiting connection is refused with EAGAIN, the daemon resets the stream
#: (go-libp2p-daemon ``stream.go:50-55``, logged at debug level only) and the caller's iterator ends with no
#: message (``p2p_daemon.py:502``). A deeper backlog makes such a burst wait for the loop instead.
LISTEN_BACKLOG = 4096
#: How long a stream handler keeps its stream open after its last message for the asker to close it
#: (:func:`asker_closes`). hivemind 1.1.12 closes the serving replica's socket when the handler ends; its daemon
#: (go-libp2p-daemon ``stream.go``, ``doStreamPipe``) then calls ``Close`` on the libp2p stream, whose read half
#: closing wakes the daemon's other pipe goroutine with ``ErrStreamReset``, which resets the stream. When that
#: reset wins the race with the write half's FIN (go-yamux v4 ``Stream.Close`` = ``CloseRead`` then ``CloseWrite``,
#: the lock released in between; lost when the thread is descheduled there, as under CPU load), the asker's yamux
#: marks the stream reset and drops whatever it had buffered but not yet handed to the asker: the reply ends
#: early ("after 0 of N bytes", or before its header). When the asker closes first, the same race on its side
#: can only drop bytes it no longer reads.
STREAM_LINGER_S = 60.0


class SwarmTimeoutError(SwarmError, TimeoutError):
    """A wait on the swarm ran past its timeout; the coroutine waited for was cancelled.

    Both a :class:`SwarmError` (PULSELoCo's averaging catches those) and a :class:`TimeoutError` (PULSESync's
    callers catch those), so each path keeps its own handling of a stalled peer.
    """


class BackgroundLoop:
    """An asyncio event loop running in a daemon thread until :meth:`shutdown`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait at most ``timeout`` seconds for its result.

        When this wait runs out, the coroutine is cancelled and :class:`SwarmTimeoutError` is raised; whatever
        the coroutine raises itself (an ``asyncio`` timeout of its own included) propagates unchanged.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own timeout, not this wait's
                raise
            future.cancel()
            raise SwarmTimeoutError(f"swarm operation did not finish within {timeout:.1f}s") from None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel the loop's tasks, stop it and join its thread (each step bounded by ``timeout`` seconds).

        Never raises: tasks that do not stop in time are logged and left to the daemon thread.
        """
        if not self.loop.is_running():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout=timeout)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            logger.warning("background loop tasks did not stop cleanly error=%r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)


async def _daemon_listen_maddr(_dht: Any, node: Any) -> Any:
    """Runs in the DHT process: where its P2P daemon listens for local clients."""
    return node.p2p.daemon_listen_maddr


def daemon_listen_maddr(dht: Any) -> Any:
    """The multiaddr on which ``dht``'s P2P daemon listens for clients (a blocking call into the DHT process).

    Raises whatever ``hivemind.DHT.run_coroutine`` raises when the DHT is not running.
    """
    return dht.run_coroutine(_daemon_listen_maddr)


def listen_with_backlog(p2p: P2P, backlog: int = LISTEN_BACKLOG) -> None:
    """Make ``p2p`` accept its daemon's connections for incoming streams with an accept backlog of ``backlog``.

    Call it before the first stream handler is added (that starts the listening); raises :class:`RuntimeError`
    after. A replica listening on anything but a unix socket (hivemind always uses one) is left as it is. This
    replaces hivemind's ``ControlClient.listen`` (1.1.12) on this one instance: the same server and the same
    connection callback, only the backlog differs.
    """
    if getattr(p2p, "_listen_task", None) is not None:
        raise RuntimeError("the replica already listens for incoming streams")
    control = p2p._client.control
    maddr = control.listen_maddr
    if "unix" not in [proto.name for proto in maddr.protocols()]:
        return
    path = maddr.value_for_protocol("unix")

    @asynccontextmanager
    async def listen() -> AsyncIterator[Any]:
        server = await asyncio.start_unix_server(control._handler, path=path, backlog=backlog)
        async with server:
            yield control

    control.listen = listen


async def replicate_p2p(dht: Any) -> P2P:
    """A new P2P client of ``dht``'s daemon, bound to the running event loop, listening for incoming streams
    with a backlog of :data:`LISTEN_BACKLOG` (:func:`listen_with_backlog`).

    Not ``dht.replicate_p2p()``: that one is cached per DHT and bound to the loop that made it, so a second
    component on the same DHT (a PulseLoCo or publisher restarted in-process) would inherit a replica whose
    loop the first one stopped. Call it on the loop that will use the replica; :class:`P2PHost` closes it.
    """
    p2p = await P2P.replicate(daemon_listen_maddr(dht))
    listen_with_backlog(p2p)
    return p2p


class P2PHost:
    """A :class:`BackgroundLoop` with a replica of ``dht``'s P2P daemon on it, and the handlers it serves.

    Construction raises :class:`SwarmTimeoutError` when the replica is not up within ``timeout`` seconds (the
    loop is stopped again), or whatever the DHT raises when it is not running. The DHT itself is the
    caller's; :meth:`close` ends only what this host started.
    """

    def __init__(self, dht: Any, *, name: str, timeout: float = 30.0) -> None:
        self.loop = BackgroundLoop(name)
        try:
            self.p2p: P2P = self.loop.run(replicate_p2p(dht), timeout=timeout)
        except BaseException:
            self.loop.shutdown()
            raise
        self.peer_id: PeerID = self.p2p.peer_id
        self._served: list[tuple[ServicerBase, str]] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """:meth:`BackgroundLoop.run` on this host's loop (the replica's)."""
        return self.loop.run(coro, timeout)

    def serve(self, servicer: ServicerBase, namespace: str, *, timeout: float = 30.0) -> None:
        """Register ``servicer``'s ``rpc_*`` handlers under ``namespace`` on the replica.

        Raises :class:`SwarmTimeoutError` after ``timeout`` seconds, or the daemon's error.
        """
        self.run(servicer.add_p2p_handlers(self.p2p, namespace=namespace), timeout=timeout)
        self._served.append((servicer, namespace))

    def close(self, timeout: float = 5.0) -> None:
        """Remove the served handlers, close the replica and stop the loop, each bounded by ``timeout``.

        Never raises (the daemon may already be gone with the DHT): failures are logged at debug level.
        """
        for servicer, namespace in self._served:
            try:
                self.run(servicer.remove_p2p_handlers(self.p2p, namespace=namespace), timeout=timeout)
            except Exception as exc:  # shutting down: report, do not mask the caller's own exception
                logger.debug("error removing handlers namespace=%s error=%r", namespace, exc)
        self._served.clear()
        try:
            self.run(self.p2p.shutdown(), timeout=timeout)
        except Exception as exc:
            logger.debug("error closing the P2P replica error=%r", exc)
        self.loop.shutdown(timeout)


class Message(Protocol):
    """A hivemind protobuf message with a ``metadata`` bytes field (``ExpertRequest``, ``ExpertResponse``)."""

    metadata: bytes

    def ByteSize(self) -> int: ...  # protobuf's name


M = TypeVar("M", bound=Message)
S = TypeVar("S")
R = TypeVar("R")


def asker_closes(
    handler: Callable[[S, R, P2PContext], AsyncIterator[M]],
) -> Callable[[S, R, P2PContext], AsyncIterator[M]]:
    """Decorate a servicer's stream-output ``rpc_*`` method: after its last message the stream stays open until
    the asker closes it, or for at most :data:`STREAM_LINGER_S` seconds (an asker that never closes).

    hivemind cancels the handler when the asker's end closes, which ends the wait. The asker must close the
    stream once it has read the reply (:func:`read_stream` does; a one-message reply is read with
    :func:`read_reply`); it then never waits for the server to end it. Why: see :data:`STREAM_LINGER_S`. The
    handler's own exceptions propagate unchanged (hivemind sends them to the asker as an error)."""

    @functools.wraps(handler)  # keeps the annotations hivemind reads to tell stream handlers from unary ones
    async def held_open(self: S, request: R, context: P2PContext) -> AsyncIterator[M]:
        messages = handler(self, request, context)
        try:
            async for message in messages:
                yield message
        finally:  # cancelled mid-reply (the asker hung up): the handler's own cleanup runs now, not at collection
            await close_stream(messages)
        await asyncio.sleep(STREAM_LINGER_S)

    # hivemind reads the request parameter's name from the signature and its type from the annotations
    held_open.__signature__ = inspect.signature(handler)  # type: ignore[attr-defined]
    return held_open


async def close_stream(messages: AsyncIterator[Any]) -> None:
    """Close an async iterator with its ``aclose`` (a hivemind stream's iterator then closes its connection to the
    daemon, which ends the stream; a handler's generator runs its cleanup); iterators without one are left
    alone. Never raises: a stream that cannot be closed cleanly is already broken (logged at debug level)."""
    aclose = getattr(messages, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception as exc:  # a broken connection: nothing left to close
        logger.debug("error closing a stream error=%r", exc)


async def read_reply(messages: AsyncIterator[M], *, timeout: float) -> M:
    """The first message of ``messages`` (a one-message reply), waited for at most ``timeout`` seconds; then the
    stream is closed (:func:`close_stream`), also when this raises :class:`TimeoutError`, or
    :class:`TruncatedPayloadError` for a stream that ends without a message."""
    iterator = messages.__aiter__()
    try:
        return await asyncio.wait_for(iterator.__anext__(), timeout)
    except StopAsyncIteration:
        raise TruncatedPayloadError("the stream ended without a reply") from None
    finally:
        await close_stream(iterator)


def parse_header(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object header; raises :class:`PayloadError` when it is not one (empty bytes give ``{}``)."""
    try:
        header = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PayloadError(f"message header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise PayloadError("message header must be a JSON object")
    return header


def header_message(message_type: Callable[..., M], header: dict[str, Any]) -> M:
    """One message of ``message_type`` whose ``metadata`` is ``header`` as compact JSON (no spaces: a peer of a
    group of R sends some 4R headers a round), a unary request or reply."""
    return message_type(metadata=json.dumps(header, separators=(",", ":")).encode())


def stream_messages(
    message_type: Callable[..., M],
    header: dict[str, Any],
    payload: Sequence[bytes | memoryview] = (),
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[M]:
    """The messages that send ``header`` and the concatenation of ``payload``'s buffers: first the header with
    ``size`` set to the payload's total length, then chunks of at most ``chunk_bytes`` (buffers are not
    joined; a chunk never spans two). Read them with :func:`read_stream`."""
    size = sum(len(buffer) for buffer in payload)
    yield header_message(message_type, {**header, "size": size})
    for buffer in payload:
        view = memoryview(buffer).cast("B")
        for start in range(0, len(view), chunk_bytes):
            yield message_type(metadata=bytes(view[start : start + chunk_bytes]))


async def read_stream(
    messages: AsyncIterator[M],
    *,
    max_bytes: int,
    timeout: float,
    first_timeout: float | None = None,
    on_message: Callable[[dict[str, Any], M], None] | None = None,
) -> tuple[dict[str, Any], bytes]:
    """Read one :func:`stream_messages` stream: ``(header, payload)``, then close it (:func:`close_stream`).

    Waits at most ``first_timeout`` (default ``timeout``) seconds for the header and ``timeout`` seconds for
    every later message; reads exactly the ``size`` bytes the header declares and does not wait for the server
    to end the stream (it waits for the asker: :func:`asker_closes`). ``on_message(header, message)`` sees every
    message once the header is known (for traffic counters). Raises :class:`TimeoutError` when a wait runs out,
    :class:`TruncatedPayloadError` when the stream is empty or ends early, :class:`PayloadError` when its header
    is not a JSON object with an integer ``size``, :class:`PayloadSizeError` when ``size`` exceeds ``max_bytes``
    (before any chunk is read) or a message carries bytes past the declared size. The stream is closed in every
    case.
    """
    iterator = messages.__aiter__()
    try:
        try:
            first = await asyncio.wait_for(iterator.__anext__(), timeout if first_timeout is None else first_timeout)
        except StopAsyncIteration:  # the sender died or hung up before answering
            raise TruncatedPayloadError("the stream ended without a header") from None
        header = parse_header(first.metadata)
        if on_message is not None:
            on_message(header, first)
        size = header.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise PayloadError(f"stream header has no valid size: {size!r}")
        if size > max_bytes:
            raise PayloadSizeError(f"stream declares {size} bytes, above the limit of {max_bytes}")
        on_chunk = None if on_message is None else functools.partial(on_message, header)
        return header, await read_payload(iterator, size, timeout=timeout, on_chunk=on_chunk)
    finally:
        await close_stream(iterator)


async def read_payload(
    messages: AsyncIterator[M],
    size: int,
    *,
    timeout: float,
    on_chunk: Callable[[M], None] | None = None,
    collect: bool = True,
) -> bytes:
    """The ``size`` payload bytes that follow a stream's header: the next messages' ``metadata``, each waited for at
    most ``timeout`` seconds and passed to ``on_chunk`` as it arrives (with ``collect`` False only there: the result
    is then empty). Reads no message past them (the asker closes the stream: :func:`asker_closes`). Raises
    :class:`TimeoutError` when a wait runs out, :class:`TruncatedPayloadError` when the stream ends early,
    :class:`PayloadSizeError` when a message carries bytes past ``size``."""
    parts: list[bytes] = []
    received = 0
    while received < size:
        try:
            message = await asyncio.wait_for(messages.__anext__(), timeout)
        except StopAsyncIteration:
            raise TruncatedPayloadError(f"stream ended after {received} of {size} bytes") from None
        if on_chunk is not None:
            on_chunk(message)
        received += len(message.metadata)
        if received > size:
            raise PayloadSizeError(f"stream carries more than the {size} bytes its header declares")
        if collect:
            parts.append(message.metadata)
    return b"".join(parts)
