"""The PULSESync subscriber: keeps a rollout worker's model at the newest published version.

``update(model)`` brings the model to the head: the next patch when one behind, one squashed patch (made and
signed by the publisher) or the chain of patches when further behind, and an anchor plus patches when it has
nothing usable. Every object is authenticated (Ed25519 envelope over the payload's SHA-256) before use and
every step is verified by state digest; a digest mismatch falls back to an anchor. Each step is applied
atomically under a lock, so a reader holding :attr:`Subscriber.lock` never sees half-applied weights.

A subscriber on the swarm is also a relay: it serves the objects it holds and says so in the DHT, so the
publisher's upload does not grow with the number of workers. It says so only while others can reach it
(:func:`pulseloco.swarm.is_reachable`: a server-mode peer, or one holding a relay address from
``use_auto_relay``): a client-mode worker behind NAT that announced itself would be tried first by every other
subscriber, fail ("routing: not found") and send them all back to the publisher.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
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
from pulseloco.sync.transport import FetchRequest, Provided, SwarmEndpoint

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
    ``seconds``. ``digest``: the state digest now held. ``lag``: how many versions the newest head, read again once
    the update finished, is ahead of ``version`` (versions published while the update ran; 0 when it is current
    or no head is readable then). ``path``: how it got there (patch, squash, chain or anchor). ``published``: when
    the publisher signed this version's head (its clock; 0.0 when unknown). ``changed``: the flat indices
    (int64, sorted, unique) that changed per tensor since ``previous``; None when every element may have changed
    (an anchor was applied).
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
    """Objects from providers on a hivemind swarm: relays first (random order), the publisher last.

    Every request has a timeout; a provider that stalls, answers garbage or fails authentication is logged
    and the next one is tried. When only the publisher holds an object and it is over its upload budget,
    the source polls up to ``relay_wait`` seconds for a relay to appear, then asks relays first and the
    publisher with ``force``. Polling makes a long ``relay_wait`` cheap when relays appear; it must exceed the
    time the first relays need to download the object, or the publisher ends up serving everyone.
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
    ) -> None:
        self.endpoint = endpoint
        self.key = public_key
        self.max_payload_bytes = max_payload_bytes
        self.timeout = timeout
        self.chunk_timeout = chunk_timeout
        self.relay_wait = relay_wait

    def head(self) -> Head | None:
        env = self.endpoint.get_head(self.key)
        return None if env is None else Head(env.version, env.digest, env.anchor_version, env.time)

    def fetch(self, request: FetchRequest) -> Fetched | None:
        deadline = time.monotonic() + self.timeout
        me = self.endpoint.peer_id.to_base58()
        waited_for_relay = False
        while time.monotonic() < deadline:
            providers = self.endpoint.get_providers(timeout=min(10.0, self.timeout))
            holders = [
                (peer, info["publisher"])
                for peer, info in providers.items()
                if peer != me and (request.kind == "squash" or request.version in info["versions"])
            ]
            relays = [p for p, is_pub in holders if not is_pub]
            publishers = [p for p, is_pub in holders if is_pub]
            random.shuffle(relays)
            busy = False
            for peer in relays + publishers:
                force = waited_for_relay and peer in publishers
                req = FetchRequest(request.kind, request.version, request.base_version, force)
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
                    )
                except Exception as exc:  # any failure of a stranger's provider: log it and try the next one
                    logger.warning("fetch failed peer=%s request=%s error=%r", peer, request, exc)
                    continue
                if isinstance(result, tuple):
                    return Fetched(result[0], result[1], result[2], request.kind)
                busy |= result == "busy"
                if result == "missing" and request.kind == "squash":
                    continue
            if not busy:
                return None
            if waited_for_relay:
                time.sleep(0.2)
            else:  # poll for a relay that holds it (the first subscribers announce within a second or so)
                relay_deadline = min(deadline, time.monotonic() + self.relay_wait)
                while time.monotonic() < relay_deadline and not self._new_relay(request, set(relays), me):
                    time.sleep(0.2)
            waited_for_relay = True
        logger.warning("no provider served request=%s within %.1f s", request, self.timeout)
        return None

    def _new_relay(self, request: FetchRequest, known: set[str], me: str) -> bool:
        """Whether a relay other than ``known`` now announces the requested version."""
        for peer, info in self.endpoint.get_providers(timeout=min(5.0, self.timeout)).items():
            if peer in known or peer == me or info["publisher"]:
                continue
            if request.kind == "squash" or request.version in info["versions"]:
                return True
        return False


class _Relay:
    """Objects this subscriber holds, served to other subscribers: the recent patches in memory and at most one
    anchor (a full BF16 copy)."""

    def __init__(self, capacity: int = 16) -> None:
        self.objects: OrderedDict[tuple[str, int], tuple[bytes, bytes, int | None]] = OrderedDict()
        self.capacity = capacity
        self.lock = threading.Lock()

    def add(self, kind: str, version: int, envelope: bytes, payload: bytes, base_version: int | None = None) -> None:
        with self.lock:
            if kind == "anchor":  # a full copy of the model: keep only the newest one in memory
                for key in [k for k in self.objects if k[0] == "anchor"]:
                    del self.objects[key]
            self.objects[(kind, version)] = (envelope, payload, base_version)
            while len(self.objects) > self.capacity:
                self.objects.popitem(last=False)

    def provide(self, request: FetchRequest) -> Provided:
        with self.lock:
            found = self.objects.get((request.kind, request.version))
        if found is None or (request.kind == "squash" and found[2] != request.base_version):
            return Provided("missing")  # a squash from another base is no use to the asker
        return Provided("ok", found[0], found[1])

    def versions(self) -> list[int]:
        with self.lock:
            return sorted({v for _, v in self.objects})


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
    ) -> None:
        self.run_id = run_id
        self.no_head_warning_after = no_head_warning_after
        self._no_head_since: float | None = None
        self._no_head_warned = False
        self.key = public_key
        self.lock = threading.RLock()
        self.version: int | None = None
        self.digest = ""
        self.provider_ttl = provider_ttl
        self._relay = _Relay()
        self._shadow: dict[str, torch.Tensor] | None = None
        self._changed: dict[str, list[torch.Tensor]] | None = {}  # indices written by the update in progress
        self.endpoint: SwarmEndpoint | None = None
        self._dht = dht
        self._unreachable_logged = False
        if source is None:
            if dht is None:
                raise ValueError("give a DHT or a source")
            self.endpoint = SwarmEndpoint(dht, run_id, name="subscriber")
            if relay:
                self.endpoint.serve(self._relay.provide)
            source = SwarmSource(self.endpoint, public_key, max_payload_bytes=max_payload_bytes, timeout=timeout)
        self.source = source
        self.full_checkpoints = full_checkpoints
        self.mirror = VersionStore(mirror_dir) if mirror_dir is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
                t.copy_(target[name].to(t.device, t.dtype))

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
        published yet)."""
        head = self.source.head()
        if head is None:
            self._note_no_head()
            return None
        self._no_head_since, self._no_head_warned = None, False
        with self.lock:
            if self.version == head.version and self.digest == head.digest:
                return None
            started = time.perf_counter()
            previous = self.version
            target = self._target_state(model)
            received, changed, path = 0, 0, ""
            self._changed = {}
            if self.full_checkpoints:  # baseline: a full BF16 copy per version (publisher anchors every version)
                head = Head(head.version, head.digest, head.version, head.time)
            elif self.version is not None:
                # apply_patch checks the state's digest against each patch's base (a state changed behind our
                # back is refused there and recovered from an anchor), so no extra full-state digest here
                result = self._catch_up(target, head)
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
            seconds, digest = time.perf_counter() - started, self.digest
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
            changed=_union_indices(self._changed) if self._changed is not None else None,
        )
        if self.endpoint is not None and self.endpoint.servicer is not None and self._reachable():
            self.endpoint.announce_provider(self._relay.versions(), publisher=False, ttl=self.provider_ttl)
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

    def _reachable(self) -> bool:
        """Whether other peers can reach this subscriber's relay (checked before every announcement: a relay
        address can arrive, or go, after start). The first refusal is logged with what to change."""
        reachable = self._dht is not None and is_reachable(self._dht)
        if not reachable and not self._unreachable_logged:
            self._unreachable_logged = True
            logger.info(
                "not announcing this subscriber as a relay: it is in client mode without a relay address, so "
                "nobody can reach it (join with use_auto_relay to relay through the initial peers)"
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
            self.version, self.digest = obj.envelope.version, info.digest
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

    def _catch_up(self, target: MutableMapping[str, torch.Tensor], head: Head) -> tuple[int, int, str] | None:
        """From the current version by one patch, a squash, or the patch chain; None on failure."""
        current = self.version
        if current is None or head.version <= current:
            return None

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
        for name, get in paths:
            try:
                objects = get()
                if not objects:
                    continue
                changed = self._apply_chain(target, objects)
                return sum(len(o.payload) for o in objects), changed, name
            except (StalePatchError, DigestMismatchError, PayloadError) as exc:
                logger.warning("catch-up by %s failed error=%s; trying the next path", name, exc)
        return None

    def _apply_objects(
        self, target: MutableMapping[str, torch.Tensor], anchor: Fetched, chain: list[Fetched], *, keep: bool = True
    ) -> int | None:
        """Anchor then patches, all or nothing: on failure the previous tensors and version are restored."""
        backup = {k: v.clone() for k, v in target.items()}
        previous = (self.version, self.digest)
        adopted = not target
        try:
            self._apply_anchor(target, anchor.envelope, anchor.payload)
            self.version, self.digest = anchor.envelope.version, anchor.envelope.digest
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
            self.version, self.digest = previous
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

        Hold :attr:`lock` while generating so an update never lands mid-generation.
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
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.endpoint is not None:
            self.endpoint.close()
