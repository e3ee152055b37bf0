"""The PULSESync publisher: turns a trainer's successive weights into signed patches and anchors.

``publish`` takes a BF16 CPU snapshot of the model (the only synchronous cost: one cast-copy) and returns the
version number at once; a background thread makes the patch against the last *published* snapshot, writes
patch and, every ``anchor_every`` versions, an anchor to the version store, signs them, announces the new head
in the DHT and serves the objects over libp2p. A newer snapshot queued before the worker took the older one
supersedes it (version numbers then skip; each patch names its base version). A publish that fails (disk
full, ...) is rolled back and never becomes the base of the next patch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import hivemind
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulseloco.codec import peek_header
from pulseloco.digest import state_digest
from pulseloco.errors import ConfigError, PatchError, PayloadError, UnauthorizedError
from pulseloco.keys import check_run_id, training_run_id
from pulseloco.sync.anchor import anchor_bytes, load_anchor
from pulseloco.sync.patch import apply_patch, make_patch, squash
from pulseloco.sync.signing import Envelope, check_payload, sign_envelope, verify_envelope
from pulseloco.sync.store import VersionStore
from pulseloco.sync.transport import FetchRequest, Provided, SwarmEndpoint, stored_in_time

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ANCHOR_EVERY",
    "DEFAULT_MAX_UPLOADS_PER_VERSION",
    "PublishedVersion",
    "Publisher",
    "bf16_snapshot",
    "check_anchor_every",
]

DEFAULT_ANCHOR_EVERY = 10
"""A full BF16 anchor every this many versions (the default of every publisher: the library, callback, recipes)."""
DEFAULT_MAX_UPLOADS_PER_VERSION = 2
"""Uploads of a version's newest patch by the publisher itself before it leaves the rest to relays."""
SERVED_CACHE_BYTES = 256 << 20
"""Bound on the bytes of the verified objects a publisher keeps in memory to serve the ranges of a fetch."""


def check_anchor_every(anchor_every: int) -> int:
    """``anchor_every`` when it is at least 1; raises :class:`ConfigError` otherwise."""
    if anchor_every < 1:
        raise ConfigError(f"anchor_every must be >= 1, got {anchor_every}")
    return anchor_every


@dataclass(frozen=True)
class PublishedVersion:
    """A version the publisher stored, as its ``on_announced`` listeners see it."""

    version: int
    digest: str
    """State digest of the version."""
    patch_bytes: int
    """Size of its patch (0 for an anchor-only version: the first of a store)."""
    seconds: float
    """Wall time from :meth:`Publisher.publish` queueing the snapshot to the end of the announce that followed
    storing it: waiting for the previous version, encoding, signing, writing the store and announcing the head and
    provider records in the DHT (only the store for a publisher without a DHT). What a rollout worker waits, past
    the trainer's step, before it can find the version."""
    announced: bool
    """Whether the DHT accepted the head record (True without a DHT: there is nothing to announce)."""
    head_envelope: bytes = b""
    """The signed head record of this version (the bytes stored in the DHT), for a listener to pass on: a trainer
    pushes it to its rollout workers (:meth:`pulseloco.sync.subscriber.Subscriber.offer_head`)."""


def bf16_snapshot(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BF16 CPU copy of every floating tensor of a model's state dict (non-floating buffers are skipped)."""
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    return {
        name: t.detach().to("cpu", torch.bfloat16, copy=True)
        for name, t in state.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    }


def _envelope(
    run_id: str,
    kind: str,
    version: int,
    base: int | None,
    digest: str,
    base_digest: str,
    payload: bytes,
    anchor_version: int | None = None,
) -> Envelope:
    return Envelope(
        run_id=run_id,
        kind=kind,
        version=version,
        base_version=base,
        digest=digest,
        base_digest=base_digest,
        sha256=hashlib.sha256(payload).hexdigest() if payload else "",
        size=len(payload),
        anchor_version=anchor_version,
        time=time.time(),
    )


class Publisher:
    """Publish versions of a model to rollout workers.

    Args:
        dht: a running hivemind DHT, or None to only write the store (for deployments that share the
            directory or serve it over HTTP).
        run_id: names the run in the DHT and in every envelope (``<training run id>.policy`` for a training run);
            ConfigError if it or its training run id fails :func:`pulseloco.keys.check_run_id` (empty, too long,
            whitespace).
        signing_key: the publisher's Ed25519 key; subscribers trust its public half.
        store_dir: the version store; a publisher restarted on the same directory resumes its chain.
        anchor_every: a full BF16 anchor every this many versions (the first version is always one).
        keep_anchors: retention: newest anchors kept, with every patch after the oldest of them.
        values: patch value mode, ``absolute`` (default) or ``delta``.
        max_uploads_per_version: how often the publisher serves the newest patch (or anchor) before sending subscribers
            to relays (others that hold it); a subscriber that finds no relay asks again with ``force``.
        head_ttl: lifetime in seconds of the head record in the DHT.
        provider_ttl: lifetime in seconds of this publisher's provider record (short, so that subscribers soon
            stop asking a publisher that is gone); both records are re-announced every third of the shorter.
        on_published: called as ``on_published(version, digest, patch_bytes)`` from the publisher's thread once
            a version is in the store (``patch_bytes`` 0 for the first, anchor-only version); an exception it
            raises is logged and does not undo the version.
        on_announced: called as ``on_announced(PublishedVersion)`` from the publisher's thread once a stored
            version has been announced (or its announce failed: ``announced`` is then False); more listeners
            with :meth:`add_announce_listener`. An exception a listener raises is logged and changes nothing.
            :meth:`add_head_listener` adds listeners called earlier, as soon as a version's head is signed.

    Raises :class:`ConfigError` for bad arguments and when the store cannot be resumed (a chain that does
    not verify under this key, or a truncated or corrupt file: the message names it).

    Serving: every object is checked against its signed size and SHA-256 before it is served; one whose bytes
    on disk no longer match is refused (the asker tries another provider) and logged with its file name.
    """

    def __init__(
        self,
        dht: hivemind.DHT | None,
        run_id: str,
        signing_key: Ed25519PrivateKey,
        store_dir: str | os.PathLike[str],
        *,
        anchor_every: int = DEFAULT_ANCHOR_EVERY,
        keep_anchors: int = 3,
        values: str = "absolute",
        max_uploads_per_version: int = DEFAULT_MAX_UPLOADS_PER_VERSION,
        head_ttl: float = 600.0,
        provider_ttl: float = 30.0,
        on_published: Callable[[int, str, int], None] | None = None,
        on_announced: Callable[[PublishedVersion], None] | None = None,
    ) -> None:
        check_anchor_every(anchor_every)
        if keep_anchors < 1:
            raise ConfigError(f"keep_anchors must be >= 1, got {keep_anchors}")
        if values not in ("absolute", "delta"):
            raise ConfigError(f"values must be 'absolute' or 'delta', got {values!r}")
        check_run_id(training_run_id(run_id))  # a training run's id, or a plain sync run's
        self.run_id = run_id
        self.anchor_every = anchor_every
        self.keep_anchors = keep_anchors
        self.values = values
        self.max_uploads_per_version = max_uploads_per_version
        self.head_ttl = head_ttl
        self.provider_ttl = provider_ttl
        self._announce_every = min(head_ttl, provider_ttl) / 3
        self._on_published = on_published
        self._announce_listeners: list[Callable[[PublishedVersion], None]] = []
        self._head_listeners: list[Callable[[int, bytes], None]] = []
        if on_announced is not None:
            self._announce_listeners.append(on_announced)
        self._key = signing_key
        self._public_key = signing_key.public_key()
        self.store = VersionStore(store_dir)
        self._base: dict[str, torch.Tensor] | None = None
        self._version: int | None = None
        self._digest = ""
        self._anchor_version: int | None = None
        self._since_anchor = 0
        self._resume()
        self._next_version = self._version or 0
        self._cond = threading.Condition()
        self._pending: tuple[int, dict[str, torch.Tensor], float] | None = None  # version, snapshot, queued at
        self._busy = False
        self._closed = False
        # Serving runs in the transport's executor threads: the upload counts and the squash cache are shared
        # between them under this lock. Only the newest version's count matters (the budget applies to it), so
        # older counts are dropped as the head moves on.
        self._serve_lock = threading.Lock()
        self._uploads: dict[int, int] = {}
        self._squash_cache: OrderedDict[tuple[int, int], tuple[bytes, bytes]] = OrderedDict()
        # The objects served last, verified: a fetch asks for several ranges of one object at once, each a request
        # (pulseloco.sync.transport.plan_ranges); one reads and checks the file, the others are served from here.
        self._object_cache: OrderedDict[tuple[str, int], tuple[bytes, bytes]] = OrderedDict()
        self._read_lock = threading.Lock()
        self._head_envelope: bytes | None = None
        self._provider_stored = False  # whether a provider record of this publisher has landed in the DHT
        self.last_error: BaseException | None = None
        self.endpoint: SwarmEndpoint | None = None
        if dht is not None:
            self.endpoint = SwarmEndpoint(dht, run_id, name="publisher")
            self.endpoint.serve(self._provide)
            if self._version is not None:
                self._announce()
        self._worker = threading.Thread(target=self._run, name="pulsesync-publisher", daemon=True)
        self._worker.start()

    # ---- state -------------------------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The newest published version (None before the first publish)."""
        return self._version

    @property
    def digest(self) -> str:
        """State digest of the newest published version."""
        return self._digest

    @property
    def bytes_uploaded(self) -> int:
        """Payload bytes this publisher served over the swarm."""
        return self.endpoint.servicer.bytes_uploaded if self.endpoint and self.endpoint.servicer else 0

    def _resume(self) -> None:
        """Rebuild the last published snapshot from the store (anchor + patches), verifying every step."""
        latest = self.store.latest()
        if latest is None:
            return
        try:
            anchor, patches = self.store.chain_to(latest)
            env, _, blob = self._read_verified("anchor", anchor)
            state = load_anchor(blob, expected_digest=env.digest)
            for v in patches:
                _, _, blob = self._read_verified("patch", v)
                apply_patch(state, blob)
        except UnauthorizedError as exc:
            raise ConfigError(
                f"cannot resume the version store {self.store.path}: {exc}; use the key that wrote it, "
                "or a new --store directory"
            ) from None
        except (PayloadError, PatchError, FileNotFoundError) as exc:
            raise ConfigError(
                f"cannot resume the version store {self.store.path}: {exc}. The store is damaged (a file truncated "
                "or overwritten, e.g. by a full disk or a copy cut short): restore it from a good copy, or start "
                "a new --store directory"
            ) from None
        self._base, self._version, self._digest = state, latest, state_digest(state)
        self._anchor_version = anchor
        self._since_anchor = len(patches)
        logger.info("resumed store=%s version=%d anchor=%d", self.store.path, latest, anchor)

    def refresh(self) -> bool:
        """Pick up versions another process wrote to the store (``pulseloco sync serve``) and announce them.

        Returns whether the head changed. Only for a publisher that does not call :meth:`publish` itself.
        Raises :class:`ConfigError` if the new versions do not verify under this key.
        """
        latest = self.store.latest()
        if latest is None or (self._version is not None and latest <= self._version):
            return False
        with self._cond:
            self._resume()
            self._next_version = max(self._next_version, latest)
        self._announce()
        return True

    # ---- publishing --------------------------------------------------------------------------------------

    def publish(self, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
        """Queue a new version and return its number; encoding and upload happen in the background.

        Raises :class:`RuntimeError` after :meth:`close`. A queued, not yet started version is superseded by
        a newer call (logged); its number is then never published.
        """
        snapshot = bf16_snapshot(model_or_state)
        with self._cond:
            if self._closed:
                raise RuntimeError("publisher is closed")
            self._next_version += 1
            version = self._next_version
            if self._pending is not None:
                logger.info("superseded queued version=%d by version=%d", self._pending[0], version)
            self._pending = (version, snapshot, time.monotonic())
            self._cond.notify_all()
        return version

    def flush(self, timeout: float | None = None) -> int | None:
        """Wait until every queued version is published (or failed). Returns the newest published version.

        Raises :class:`TimeoutError` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"publisher did not finish within {timeout} s")
                self._cond.wait(remaining)
        return self._version

    def _run(self) -> None:
        last_announce = time.monotonic()
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait(timeout=max(1.0, self._announce_every))
                    if self._pending is None and time.monotonic() - last_announce > self._announce_every:
                        break
                if self._closed and self._pending is None:
                    return
                job, self._pending = self._pending, None
                self._busy = job is not None
            stored: tuple[int, str, int, float] | None = None  # (version, digest, patch_bytes, queued at)
            announced = False
            try:
                if job is not None:
                    version, state, queued_at = job
                    digest, patch_bytes = self._publish_one(version, state)
                    stored = (version, digest, patch_bytes, queued_at)
                if self._version is not None:
                    announced = self._announce(new=stored is not None)
                    last_announce = time.monotonic()
            except Exception as exc:  # keep serving; the failed version is not the base of the next one
                self.last_error = exc
                logger.error("publish failed version=%s error=%r", job[0] if job else None, exc)
            finally:
                if stored is not None:  # before flush() returns: a flushed version has been reported
                    self._report(stored, announced)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def add_announce_listener(self, listener: Callable[[PublishedVersion], None]) -> None:
        """Call ``listener(PublishedVersion)`` from the publisher's thread after each version stored from now on,
        once its announce is done or has failed. An exception it raises is logged and changes nothing."""
        self._announce_listeners.append(listener)

    def add_head_listener(self, listener: Callable[[int, bytes], None]) -> None:
        """Call ``listener(version, signed head record)`` from the publisher's thread for each version stored from
        now on, as soon as it can be served and its head record is signed: before the DHT stores the head and
        provider records (a round trip or more over a WAN), so that a trainer can push the head to its rollout
        workers meanwhile. The first version this publisher announces is the exception: its provider record is
        stored first (until one is, nobody could learn who serves a version from the DHT), then the listener is
        called, then its head is stored. An exception the listener raises is logged and changes nothing."""
        self._head_listeners.append(listener)

    def _tell_head(self, version: int, head: bytes) -> None:
        for listener in list(self._head_listeners):
            try:
                listener(version, head)
            except Exception:  # a hook must not stop the publisher
                logger.exception("head listener failed version=%d", version)

    def _report(self, stored: tuple[int, str, int, float], announced: bool) -> None:
        version, digest, patch_bytes, queued_at = stored
        record = PublishedVersion(
            version, digest, patch_bytes, time.monotonic() - queued_at, announced, self._head_envelope or b""
        )
        for listener in list(self._announce_listeners):
            try:
                listener(record)
            except Exception:  # a reporting hook must not stop the publisher
                logger.exception("on_announced listener failed version=%d", version)

    def _publish_one(self, version: int, state: dict[str, torch.Tensor]) -> tuple[str, int]:
        """Encode, sign and store one version; returns its ``(digest, patch_bytes)``. Raises what the store or
        the encoding raises (the version is then rolled back)."""
        started = time.perf_counter()
        objects: list[tuple[str, bytes, bytes]] = []
        if self._base is not None:
            if set(self._base) != set(state) or any(self._base[k].shape != state[k].shape for k in state):
                raise ConfigError("the model's tensor names or shapes changed between versions; use a new run_id")
            # make_patch hashes the new state in the same pass as the comparison; its header carries the digest.
            payload = make_patch(
                self._base,
                state,
                version=version,
                base_version=self._version,
                values=self.values,
                base_digest=self._digest,
            )
            digest = peek_header(payload).result_digest
            env = _envelope(self.run_id, "patch", version, self._version, digest, self._digest, payload)
            objects.append(("patch", payload, sign_envelope(self._key, env)))
        else:
            digest = state_digest(state)
        new_anchor = self._base is None or self._since_anchor + 1 >= self.anchor_every
        if new_anchor:
            payload = anchor_bytes(state, metadata={"run_id": self.run_id, "version": str(version)})
            env = _envelope(self.run_id, "anchor", version, None, digest, "", payload)
            objects.append(("anchor", payload, sign_envelope(self._key, env)))
        written: list[str] = []
        try:
            for kind, payload, env_blob in objects:
                self.store.write(kind, version, payload, env_blob)
                written.append(kind)
        except OSError:
            for kind in written:  # roll back: the store keeps the previous head
                path = self.store.object_path(kind, version)
                Path(str(path) + ".env").unlink(missing_ok=True)
                path.unlink(missing_ok=True)
            raise
        self._base, self._version, self._digest = state, version, digest
        self._since_anchor = 0 if new_anchor else self._since_anchor + 1
        if new_anchor:
            self._anchor_version = version
            self.store.prune(self.keep_anchors)
        num_changed = peek_header(objects[0][1]).num_changed if objects[0][0] == "patch" else -1
        patch_bytes = len(objects[0][1]) if objects[0][0] == "patch" else 0
        if self._on_published is not None:
            try:
                self._on_published(version, digest, patch_bytes)
            except Exception:  # a reporting hook must not fail a version that is already stored
                logger.exception("on_published hook failed version=%d", version)
        logger.info(
            "published version=%d patch_bytes=%d changed=%d anchor=%s seconds=%.3f",
            version,
            patch_bytes,
            num_changed,
            new_anchor,
            time.perf_counter() - started,
        )
        return digest, patch_bytes

    def _announce(self, *, new: bool = False) -> bool:
        """Sign and store the head record and re-announce the stored objects as provided; returns whether the DHT
        accepted the head record (True without a DHT). ``new``: a version stored since the last announce, whose
        head the head listeners get (:meth:`add_head_listener`)."""
        if self._version is None:
            return False
        env = _envelope(
            self.run_id,
            "head",
            self._version,
            None,
            self._digest,
            "",
            b"",
            anchor_version=self._anchor_version,
        )
        head = self._head_envelope = sign_envelope(self._key, env)
        told = False
        if new and (self.endpoint is None or self._provider_stored):
            self._tell_head(self._version, head)  # the version is in the store and served: no need to wait
            told = True
        if self.endpoint is not None:
            # The provider and head records are stored at once (one DHT round trip instead of two before the
            # push to the workers): a subscriber that reads the new head before the provider record lists it asks
            # the publishers named in the record it read (SwarmSource._providers). The first announce has no such
            # record to fall back on, so it stores the provider record first.
            held = self.store.list("patch") + self.store.list("anchor")
            provided = self.endpoint.announce_provider(held, publisher=True, ttl=self.provider_ttl)
            first = not self._provider_stored
            if first:
                self._provider_stored = stored_in_time(provided, 10.0, "the provider record")
            if new and not told:
                self._tell_head(self._version, head)
            accepted = self.endpoint.store_head(head, self.head_ttl)
            if not first:
                self._provider_stored = stored_in_time(provided, 10.0, "the provider record")
            if not accepted:
                logger.warning("DHT did not accept the head record version=%d", self._version)
                return False
        return True

    # ---- serving -----------------------------------------------------------------------------------------

    def _read_verified(self, kind: str, version: int) -> tuple[Envelope, bytes, bytes]:
        """``(envelope, envelope bytes, payload)`` of a stored object, checked against this publisher's key and
        the payload's signed size and SHA-256.

        Raises :class:`FileNotFoundError` if absent, :class:`UnauthorizedError` for an envelope this key did not
        sign, :class:`PayloadError` (naming the file) for a malformed envelope or a truncated or corrupt payload.
        """
        env_blob, payload = self.store.read(kind, version)
        path = self.store.object_path(kind, version)
        try:
            env = verify_envelope(self._public_key, env_blob, run_id=self.run_id)
        except UnauthorizedError as exc:
            raise UnauthorizedError(f"{path}.env: {exc}") from None
        except PayloadError as exc:
            raise PayloadError(f"{path}.env: {exc}") from None
        check_payload(env, payload, str(path))
        return env, env_blob, payload

    def _provide(self, request: FetchRequest) -> Provided:
        """Answer a fetch: patch and anchor objects from the store, squashed patches made and signed on demand.

        Called from the transport's executor threads. Never raises: an object that is absent, or whose bytes on
        disk no longer match its signed SHA-256 (logged as an error with the file name), is answered ``missing``;
        the newest version past its upload budget is answered ``busy`` unless the request says ``force``.
        """
        reserved = False
        try:
            if request.kind in ("patch", "anchor"):
                if not self.store.has(request.kind, request.version):
                    return Provided("missing")
                if request.version == self._version and not request.force and request.offset == 0:
                    if not self._reserve_upload(request.version):
                        return Provided("busy")
                    reserved = True
                env_blob, payload = self._served_object(request.kind, request.version)
                reserved = False
                return Provided("ok", env_blob, payload)
            if request.kind == "squash" and request.base_version is not None:
                return self._provide_squash(request.base_version, request.version)
        except PayloadError as exc:  # corrupt or foreign bytes in the store: never serve them
            logger.error("refusing to serve request=%s: %s", request, exc)
        except (OSError, PatchError) as exc:
            logger.warning("cannot serve request=%s error=%s", request, exc)
        finally:
            if reserved:  # nothing was served: give the upload back
                with self._serve_lock:
                    self._uploads[request.version] = max(0, self._uploads.get(request.version, 1) - 1)
        return Provided("missing")

    def _served_object(self, kind: str, version: int) -> tuple[bytes, bytes]:
        """``(envelope bytes, payload)`` of a stored object for serving: from the cache of the objects served last
        (at most :data:`SERVED_CACHE_BYTES` together; a larger object is read for each request), else read and
        checked by :meth:`_read_verified` (whose errors it raises), one object read at a time."""
        key = (kind, version)
        with self._read_lock:  # the ranges of one fetch come at once: one of them reads, the others find it here
            with self._serve_lock:
                cached = self._object_cache.get(key)
                if cached is not None:
                    self._object_cache.move_to_end(key)
                    return cached
            _, env_blob, payload = self._read_verified(kind, version)
        if len(payload) <= SERVED_CACHE_BYTES:
            with self._serve_lock:
                self._object_cache[key] = (env_blob, payload)
                while sum(len(p) for _, p in self._object_cache.values()) > SERVED_CACHE_BYTES:
                    self._object_cache.popitem(last=False)
        return env_blob, payload

    def _reserve_upload(self, version: int) -> bool:
        """Count one upload of ``version`` if it is within the budget; forget counts of older versions."""
        with self._serve_lock:
            served = self._uploads.get(version, 0)
            if served >= self.max_uploads_per_version:
                return False
            self._uploads[version] = served + 1
            for old in [v for v in self._uploads if v < version]:
                del self._uploads[old]
            return True

    def _provide_squash(self, base: int, version: int) -> Provided:
        key = (base, version)
        with self._serve_lock:
            cached = self._squash_cache.get(key)
        if cached is not None:
            return Provided("ok", *cached)
        chain: list[bytes] = []
        v = version
        while v != base:
            if not self.store.has("patch", v):
                return Provided("missing")
            env, _, payload = self._read_verified("patch", v)
            chain.append(payload)
            if env.base_version is None or env.base_version < base:
                return Provided("missing")
            v = env.base_version
        if len(chain) < 2:
            return Provided("missing")  # one patch: the subscriber asks for it directly
        payload = squash(chain[::-1])
        header = peek_header(payload)
        env = _envelope(self.run_id, "squash", version, base, header.result_digest, header.base_digest, payload)
        result = (sign_envelope(self._key, env), payload)
        with self._serve_lock:
            self._squash_cache[key] = result
            while len(self._squash_cache) > 8:
                self._squash_cache.popitem(last=False)
        return Provided("ok", *result)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued version (bounded by ``timeout``), stop the worker and leave the swarm."""
        try:
            self.flush(timeout)
        except TimeoutError:
            logger.warning("closing with a version still being published")
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout=10)
        if self.endpoint is not None:
            self.endpoint.close()
