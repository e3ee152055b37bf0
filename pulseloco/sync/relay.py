"""The relay a PULSESync subscriber runs: the objects it holds or is still receiving, served to other subscribers.

An object is registered as soon as its signed envelope verified and served while its payload arrives (a pipelined
relay tree); downstreams verify the SHA-256 themselves, and a download that fails ends their streams with an error
(they try another provider). :class:`Relay` talks to its owner through callables only: the transport's ``on_start``
hook (:meth:`Relay.begin`), ``serve(relay.provide)`` and ``on_change`` (the owner re-announces what it holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from pulseloco.errors import PayloadError
from pulseloco.sync.signing import Envelope
from pulseloco.sync.transport import FetchRequest, Provided

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RELAY_MAX_BYTES", "DEFAULT_RELAY_UPLOADS", "Relay", "RelayObject"]

#: Default bound on the bytes a relay holds (objects complete and in progress, anchors included): 1 GiB, a few
#: anchors of a ~100M-parameter model or about a hundred patches of a 1B one.
DEFAULT_RELAY_MAX_BYTES = 1 << 30
#: Default number of downloads a relay serves at once (its uplink is shared between them); more are told busy.
DEFAULT_RELAY_UPLOADS = 2


class RelayObject:
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

    def __init__(self, relay: Relay, obj: RelayObject, stall_timeout: float) -> None:
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

    def __init__(self, relay: Relay, obj: RelayObject) -> None:
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


class Relay:
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
        self.objects: OrderedDict[tuple[str, int], RelayObject] = OrderedDict()
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

        def evictable(o: RelayObject) -> bool:
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
            obj = RelayObject(envelope.kind, envelope.version, envelope.base_version, blob, envelope.size)
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
            obj = RelayObject(kind, version, base_version, envelope, len(payload), done=True)
            obj.chunks, obj.received = [payload], len(payload)
            self.objects[(kind, version)] = obj

    def provide(self, request: FetchRequest) -> Provided:
        """Answer a fetch: ``missing`` for what is not held (or a squash from another base), ``busy`` past
        ``max_uploads`` downloads at once (counted by the range at offset 0 that every fetch asks for), else the
        envelope and a reader of the payload (complete or arriving)."""
        with self.lock:
            obj = self.objects.get((request.kind, request.version))
            other_base = obj is not None and request.kind == "squash" and obj.base_version != request.base_version
            if obj is None or obj.error is not None or other_base:
                return Provided("missing")  # a squash from another base is no use to the asker
            counted = request.offset == 0  # the further ranges of a fetch this relay already counted
            if counted and self.uploads >= self.max_uploads:
                return Provided("busy")
            self.uploads += int(counted)
            obj.readers += 1

        def done() -> None:
            with self.lock:
                self.uploads -= int(counted)
                obj.readers -= 1

        return Provided("ok", obj.envelope, source=_RelayReader(self, obj, self.stall_timeout), on_done=done)

    def get(self, kind: str, version: int) -> RelayObject | None:
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
