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
(:class:`pulseloco.sync.announcer.RelayAnnouncer`). The ways from the version held to the head, and fetching their
objects, are :mod:`pulseloco.sync.catchup`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

import hivemind
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulseloco.digest import state_digest
from pulseloco.errors import (
    DigestMismatchError,
    PatchError,
    PayloadError,
    StalePatchError,
    UnauthorizedError,
)
from pulseloco.keys import POLICY_SUFFIX
from pulseloco.sync.announcer import RelayAnnouncer
from pulseloco.sync.catchup import Prefetch, catch_up_paths, fetch_path, prefetch, walk_back
from pulseloco.sync.model_state import copy_to_model, float_state, load_anchor_into, union_indices
from pulseloco.sync.patch import apply_patch
from pulseloco.sync.relay import DEFAULT_RELAY_MAX_BYTES, DEFAULT_RELAY_UPLOADS, Relay
from pulseloco.sync.signing import check_payload, public_key_fingerprint, verify_envelope
from pulseloco.sync.sources import DEFAULT_MAX_PAYLOAD_BYTES, DirectorySource, Fetched, Head, Source, SwarmSource
from pulseloco.sync.store import VersionStore
from pulseloco.sync.transport import FetchRequest, SwarmEndpoint

logger = logging.getLogger(__name__)

__all__ = ["Subscriber", "UpdateReport"]


@dataclass(frozen=True)
class UpdateReport:
    """One completed :meth:`Subscriber.update`: what moved and how long it took.

    ``version``: the version the model holds now (the head read when the update started); ``previous``: the one it
    held before (None for none). ``num_changed`` elements changed, ``bytes_received`` payload bytes fetched over
    ``seconds`` (fetching and applying, not the wait for :attr:`Subscriber.lock`). ``digest``: the state digest
    now held. ``lag``: how many versions the newest head, read again once the update finished, is ahead of
    ``version`` (versions published while the update ran; 0 when it is current or no head is readable then). It is
    read when first asked for, not before the report is handed on: on a swarm that read is a DHT lookup (a round
    trip or more over a WAN), which a rollout worker, which never asks, would otherwise spend between holding a
    version and serving it.
    ``path``: how it got there (patch, squash, chain or anchor; local: the model already was the head, nothing
    fetched). ``published``: when the publisher signed this version's head (its clock; 0.0 when unknown).
    ``changed``: the flat indices (int64, sorted, unique) that changed per tensor since ``previous``; None when every
    element may have changed (an anchor was applied, or the first version was the model's own).
    """

    version: int
    previous: int | None
    num_changed: int
    bytes_received: int
    seconds: float
    digest: str
    path: str
    published: float = 0.0
    changed: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    #: wall-clock time (seconds since the epoch) at which the model held ``version``
    held_at: float = 0.0
    #: reads the newest head's version lead for :attr:`lag` (None: 0)
    read_lag: Callable[[], int] | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def lag(self) -> int:
        """Versions the newest head is ahead of ``version``, read at the first access (see the class)."""
        return self.read_lag() if self.read_lag is not None else 0


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
        self._announcer: RelayAnnouncer | None = None
        self.relay = Relay(
            max_bytes=relay_max_bytes if serving else 0,
            max_uploads=relay_uploads,
            stall_timeout=chunk_timeout,
            on_change=self._request_announce,
        )
        self._shadow: dict[str, torch.Tensor] | None = None
        self._initial_digest: str | None = None  # the state digest of the model before any version
        self._changed: dict[str, list[torch.Tensor]] | None = {}  # indices written by the update in progress
        self.endpoint: SwarmEndpoint | None = None
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
                on_start=self.relay.begin if relay else None,
            )
        self.source = source
        self.full_checkpoints = full_checkpoints
        self.mirror = VersionStore(mirror_dir) if mirror_dir is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pushed: Head | None = None  # a newer head a peer pushed (offer_head), for the next update
        self._pushed_lock = threading.Lock()
        self._wake = threading.Event()  # set by offer_head: the follow loop checks now, not at its next poll
        #: heads pushed by peers and taken (verified, newer than any seen)
        self.num_pushed = 0
        if self.endpoint is not None and relay:
            self.endpoint.serve(self.relay.provide)
            self._announcer = RelayAnnouncer(self.endpoint, self.relay, dht, provider_ttl=provider_ttl)
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
        state = float_state(model)
        if all(t.dtype == torch.bfloat16 for t in state.values()):
            if isinstance(model, MutableMapping) and len(state) == len(model):
                return model  # the caller's own dict, so that an empty one adopts the publisher's tensors
            return state
        if self._shadow is None or set(self._shadow) != set(state):
            self._shadow = {k: v.detach().to("cpu", torch.bfloat16, copy=True) for k, v in state.items()}
        return self._shadow

    def _holds_already(self, target: MutableMapping[str, torch.Tensor], head: Head) -> bool:
        """Whether ``target`` (the state of a model that holds no version yet) is the head's state bit for bit:
        its digest is the signed one. Not for a mirroring subscriber (its mirror needs the anchor) or without the
        head's signed bytes. The digest of a state that is not the head's is computed once."""
        if self.mirror is not None or not head.envelope_blob or not target:
            return False
        if self._initial_digest is None:
            self._initial_digest = state_digest(target)
        return self._initial_digest == head.digest

    def _keep(self, obj: Fetched) -> None:
        """Remember an applied object: served to other subscribers, and kept in the mirror directory."""
        self.relay.add(obj.kind, obj.envelope.version, obj.envelope_blob, obj.payload, obj.envelope.base_version)
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
            copy_to_model(model, target)
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

        A head older than the version held is ignored (None): the DHT is eventually consistent, and a head the
        publisher pushed arrives before the DHT stores it, so a lookup may still find the previous record; a
        subscriber never goes back (a run started again from version 1 needs a new run id).

        Raises :class:`pulseloco.errors.PatchError` when no provider brings the model to the head; errors reading
        the head propagate (e.g. :class:`pulseloco.errors.UnauthorizedError` for one the publisher did not sign).
        Either way the model still holds its previous complete version.
        """
        head = self._take_pushed() or self.source.head()
        if head is None:
            self._note_no_head()
            return None
        if self.version is not None and head.version < self.version:
            # a record older than the version held: a DHT node's stale copy, or the DHT not yet holding the head
            # the publisher pushed to this worker; following it would fetch an anchor to go back
            logger.debug("head version=%d is older than the version held=%d: ignored", head.version, self.version)
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
            elif self.version is None and self._holds_already(target, head):
                # the model already is the head (a run's first version is the checkpoint everyone starts from):
                # nothing to download; the head's signed bytes vouch for it to whoever this worker answers
                self.version, self.digest, self.envelope, path = head.version, head.digest, head.envelope_blob, "local"
                self._changed = None
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
            copy_to_model(model, target)
            seconds, digest, held_at = time.perf_counter() - started - waited, self.digest, time.time()
        report = UpdateReport(
            version=head.version,
            previous=previous,
            num_changed=changed,
            bytes_received=received,
            seconds=seconds,
            digest=digest,
            path=path,
            published=head.time,
            held_at=held_at,
            changed=union_indices(self._changed) if self._changed is not None else None,
            read_lag=functools.partial(self._lag, head.version),
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

    def offer_head(self, blob: bytes) -> bool:
        """A head record a peer pushes (the publishing trainer, when it publishes: no DHT read, no poll wait). Taken
        when it verifies under the publisher's key for this run and names a version newer than this subscriber
        holds and than any head pushed before: the next :meth:`update_report` goes to it, and :meth:`run` checks at
        once. Returns whether it was taken. Never raises: a forged, malformed or oversized record is logged and
        refused, an old one ignored; nothing changes either way. A pushed head only says sooner what the DHT's
        head record says (the same signed bytes); every object is still fetched and verified as always."""
        try:
            env = verify_envelope(self.key, blob, run_id=self.run_id)
        except (UnauthorizedError, PayloadError) as exc:
            logger.warning("refused a pushed head record run=%s error=%s", self.run_id, exc)
            return False
        if env.kind != "head":
            logger.warning("refused a pushed record run=%s: a %s envelope, not a head", self.run_id, env.kind)
            return False
        with self._pushed_lock:
            newest = max(self.version if self.version is not None else -1, self._pushed.version if self._pushed else -1)
            if env.version <= newest:
                return False
            self._pushed = Head(env.version, env.digest, env.anchor_version, env.time, bytes(blob))
            self.num_pushed += 1
        self._wake.set()
        return True

    def _take_pushed(self) -> Head | None:
        """The head last pushed (:meth:`offer_head`), once, if it is newer than the version held; else None."""
        with self._pushed_lock:
            head, self._pushed = self._pushed, None
        return head if head is not None and (self.version is None or head.version > self.version) else None

    def _pause(self, stopped: threading.Event, seconds: float) -> None:
        """Wait ``seconds``, or less: until ``stopped`` or :meth:`close`, or a head pushed (:meth:`offer_head`)."""
        deadline = time.monotonic() + seconds
        while not (stopped.is_set() or self._stop.is_set()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if self._wake.wait(min(remaining, 0.1)):
                self._wake.clear()
                return

    def _request_announce(self) -> None:
        """Ask the announcer thread to publish the relay's holdings (coalesced; returns at once; nothing when this
        subscriber does not announce)."""
        if self._announcer is not None:
            self._announcer.request()

    @property
    def announced(self) -> bool:
        """Whether this subscriber announces itself as a relay (it relays and is reachable now)."""
        return (
            self.endpoint is not None
            and self.endpoint.servicer is not None
            and self._announcer is not None
            and self._announcer.reachable()
        )

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
        hint = "" if self.run_id.endswith(POLICY_SUFFIX) else f" (the recipes publish under '<run_id>{POLICY_SUFFIX}')"
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
                self.relay.add(obj.kind, env.version, obj.envelope_blob, obj.payload, env.base_version)
        return changed

    def _prefetch(self, head: Head) -> Prefetch | None:
        """Fetch, without :attr:`lock`, the objects of the first catch-up path that serves them
        (:func:`pulseloco.sync.catchup.prefetch`); None when there is no catch-up to prepare (no version held,
        already at or past the head, or full checkpoints).

        Touches neither the model nor the version (a rollout may be generating with them); relies on a single
        updating thread, so that the version read here is still the one held when the lock is taken (checked
        again by :meth:`_catch_up`). Errors other than those of a failing path (logged) propagate, with the
        model untouched."""
        current = self.version
        if self.full_checkpoints or current is None or head.version <= current:
            return None
        return prefetch(self.source, head, current)

    def _catch_up(
        self, target: MutableMapping[str, torch.Tensor], head: Head, prefetched: Prefetch | None = None
    ) -> tuple[int, int, str] | None:
        """From the current version by one patch, a squash, or the patch chain; None on failure (the state then
        holds the last version applied completely). Call with :attr:`lock` held.

        ``prefetched``: objects :meth:`_prefetch` fetched for this base and head; they are applied first, the
        paths that failed to fetch are not tried again, and the later paths are fetched here if they fail to
        apply. Objects fetched for another base or head are discarded."""
        current = self.version
        if current is None or head.version <= current:
            return None
        paths = catch_up_paths(self.source, head, current)
        first: list[Fetched] | None = None
        if prefetched is not None:
            if (prefetched.base, prefetched.head) == (current, head.version):
                paths, first = paths[prefetched.index :], prefetched.objects
            else:
                logger.debug(
                    "discarding objects fetched for v%d->v%d: now at v%s", prefetched.base, prefetched.head, current
                )
        for index, (name, get) in enumerate(paths):
            objects = first if index == 0 and first else fetch_path(name, get)
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
            load_anchor_into(target, anchor.envelope, anchor.payload)
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
            chain = [] if head.version == version else walk_back(self.source, head.version, version)
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

    def run(
        self,
        model: torch.nn.Module | MutableMapping[str, torch.Tensor],
        on_update: Callable[[UpdateReport], None] | None = None,
        *,
        interval: float = 1.0,
        stop: threading.Event | None = None,
        until_version: int | None = None,
        max_seconds: float | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> bool:
        """Keep ``model`` current in this thread: the follow loop of ``pulseloco sync follow``, the rollout worker
        and :meth:`follow`.

        Every ``interval`` seconds (at once when a peer pushes a newer head, :meth:`offer_head`) it calls
        :meth:`update_report` and hands a report to ``on_update`` (a check that
        brought nothing calls ``on_idle``), until ``stop`` is set (a signal handler's event, say) or :meth:`close`
        is called, the model holds ``until_version`` or later (also when it already did, restored from a mirror),
        or ``max_seconds`` passed. Returns True when it ended at ``until_version``, False otherwise.

        A :class:`pulseloco.errors.PatchError` (no provider could bring the model to a verified version) is logged
        and retried at the next check: the model keeps its last complete version. Any other exception, including
        one raised by ``on_update`` or ``on_idle``, propagates.
        """
        stopped = stop if stop is not None else self._stop
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        while not (stopped.is_set() or self._stop.is_set()):
            try:
                report = self.update_report(model)
            except PatchError as exc:  # a follower keeps its last complete version; the next check retries
                logger.warning("update failed, retrying in %.1f s: %s", interval, exc)
                report = None
            if report is None:
                if on_idle is not None:
                    on_idle()
            elif on_update is not None:
                on_update(report)
            if until_version is not None and self.version is not None and self.version >= until_version:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._pause(stopped, interval)
        return False

    def follow(
        self,
        model: torch.nn.Module | MutableMapping[str, torch.Tensor],
        on_update: Callable[[UpdateReport], None] | None = None,
        *,
        interval: float = 1.0,
    ) -> threading.Thread:
        """Keep ``model`` current in a background thread (:meth:`run` until :meth:`close`); every error, including
        one of ``on_update``, is logged and the loop goes on after ``interval`` seconds.

        Hold :attr:`lock` while generating so an update never lands mid-generation; the next version downloads
        meanwhile and is applied once the lock is released. While it follows, do not call :meth:`update` from
        another thread: updates assume one updating thread.
        """

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.run(model, on_update, interval=interval)
                except Exception as exc:  # a follower keeps serving its last complete version
                    logger.warning("follow failed error=%r; retrying in %.1f s", exc, interval)
                    self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="pulsesync-follow", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop following and leave the swarm (bounded)."""
        self._stop.set()
        self._wake.set()
        if self._announcer is not None:
            self._announcer.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._announcer is not None:
            self._announcer.join(timeout=15)
        if self.endpoint is not None:
            self.endpoint.close()
