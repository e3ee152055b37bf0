"""The published versions' weights a trainer holds to check rollouts with the version each lease claims."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["VersionStates"]


class VersionStates:
    """The published BF16 weights of the newest ``keep`` versions, for checking each lease with its own version.

    A thread follows the PULSESync run ``run_id`` (a :class:`pulseloco.sync.subscriber.Subscriber` that does not
    relay, so a trainer uploads nothing for it) on a BF16 copy of ``template`` (the trainer's state dict: the names
    and shapes the publisher signs) and keeps a copy of the state at each version it reaches. With ``dht=None``
    nothing is followed: the publisher's own process hands each version it publishes to :meth:`add` (it cannot
    fetch from itself). It reaches the head
    every ``poll`` seconds, so a version published and superseded between two looks is not held; a lease of such a
    version is unverifiable (generated again). Memory: ``keep + 1`` BF16 copies of the weights, more while the
    publisher's announcements lag behind the versions handed to :meth:`add` (:meth:`hold_from`), at most
    ``4 * keep``.

    Failure behaviour: a version that cannot be fetched or verified is logged and retried at the next look; never
    raises into the trainer. :meth:`close` stops the thread (bounded).
    """

    def __init__(
        self,
        dht: Any | None,
        run_id: str,
        public_key: Any,
        template: dict[str, torch.Tensor],
        *,
        keep: int = 3,
        poll: float = 0.2,
    ) -> None:
        self.keep = max(1, keep)
        self.max_held = 4 * self.keep
        self.poll = poll
        self.floor: int | None = None
        """Versions at or above it are held beyond ``keep`` (up to ``max_held``): set by :meth:`hold_from`."""
        self._held: dict[int, dict[str, torch.Tensor]] = {}
        self._dropped: set[int] = set()  # versions held once and let go (ints: a run's worth is small)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.subscriber: Any = None
        self._thread: threading.Thread | None = None
        if dht is not None:
            from pulseloco.sync.subscriber import Subscriber

            self.state = {n: t.detach().to(device="cpu", dtype=torch.bfloat16).clone() for n, t in template.items()}
            self.subscriber = Subscriber(dht, run_id, public_key, relay=False)
            self._thread = threading.Thread(target=self._follow, name="verify-versions", daemon=True)
            self._thread.start()

    def add(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Hold ``state`` as ``version`` (a publisher's own versions: :attr:`PulseSyncCallback.version_listeners
        <pulseloco.integrations.pulsesync.PulseSyncCallback.version_listeners>`); the oldest beyond ``keep`` go."""
        with self._lock:
            self._held[version] = state
            self._evict()

    def hold_from(self, version: int) -> None:
        """Keep every version from ``version`` on, even beyond ``keep`` (the oldest a lease may still claim: the
        newest version the workers can find, announced, less ``max_lag``). A publisher hands :meth:`add` each
        version when it queues it, before it is announced, so while announcing falls behind (a slow DHT), the
        ``keep`` newest versions added can all be newer than what honest workers serve. Held beyond ``keep`` up to
        ``max_held`` versions; past that the oldest go, with a warning."""
        with self._lock:
            self.floor = version if self.floor is None else max(self.floor, version)
            self._evict()

    def dropped(self, version: int) -> bool:
        """Whether ``version`` was held and let go (not: never held, as a version a follower skipped)."""
        with self._lock:
            return version in self._dropped and version not in self._held

    def _evict(self) -> None:
        """Drop the oldest versions beyond ``keep`` that are below the floor, then any beyond ``max_held``."""
        versions = sorted(self._held)
        for old in versions[: -self.keep]:
            if self.floor is None or old < self.floor:
                del self._held[old]
                self._dropped.add(old)
        versions = sorted(self._held)
        if len(versions) > self.max_held:
            logger.warning(
                "holding %d versions to check leases with (announced versions lag behind the published ones); "
                "dropping versions %s: leases of them are generated again",
                len(versions),
                versions[: -self.max_held],
            )
            for old in versions[: -self.max_held]:
                del self._held[old]
                self._dropped.add(old)

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        """The BF16 state of ``version`` (None when not held)."""
        with self._lock:
            return self._held.get(version)

    def wait(self, version: int, timeout: float) -> dict[str, torch.Tensor] | None:
        """The state of ``version``, waiting up to ``timeout`` s for it (a version just published is fetched within
        a poll or two); None at once for a version older than every one held."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                state = self._held.get(version)
                older = bool(self._held) and version < min(self._held)
            if state is not None or older or time.monotonic() >= deadline or self._stop.is_set():
                return state
            time.sleep(0.05)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                report = self.subscriber.update_report(self.state)
            except Exception as exc:  # a provider gone or a bad object: the subscriber kept its version; retry
                logger.warning("verification could not follow the published versions: %r", exc)
                report = None
            if report is not None:
                self.add(report.version, {name: t.clone() for name, t in self.state.items()})
            self._stop.wait(self.poll)

    def close(self) -> None:
        """Stop following (bounded; never raises)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.subscriber is not None:
            self.subscriber.close()
