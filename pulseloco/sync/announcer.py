"""A relaying subscriber's announcements: telling the swarm which objects its :class:`~pulseloco.sync.relay.Relay`
serves.

:class:`RelayAnnouncer` runs one thread that writes the relay's holdings (complete versions, and those still
arriving under ``partial``) to the providers record whenever they change and every third of ``provider_ttl``
so the record does not expire. It announces only while others can reach this peer
(:func:`pulseloco.swarm.is_reachable`: a server-mode peer, or one holding a relay address from
``use_auto_relay``): a client-mode worker behind NAT that announced itself would be tried first by every other
subscriber, fail ("routing: not found") and send them all back to the publisher.

Failure behaviour: nothing here raises; a DHT error is logged and the announcement is tried again at the next
change or period.
"""

from __future__ import annotations

import logging
import threading

import hivemind

from pulseloco.swarm import is_reachable
from pulseloco.sync.relay import Relay
from pulseloco.sync.transport import SwarmEndpoint

logger = logging.getLogger(__name__)

__all__ = ["RelayAnnouncer"]


class RelayAnnouncer:
    """Announce ``relay``'s objects through ``endpoint`` (see the module docstring) from :meth:`start` until
    :meth:`stop`; ``dht`` is asked whether this peer is reachable before every announcement.

    Args:
        endpoint: the subscriber's swarm endpoint, already serving ``relay``.
        relay: what this subscriber serves.
        dht: the running DHT (None: never reachable, nothing is announced).
        provider_ttl: the providers record's lifetime; it is written again every third of it.
    """

    def __init__(self, endpoint: SwarmEndpoint, relay: Relay, dht: hivemind.DHT | None, *, provider_ttl: float) -> None:
        self.endpoint = endpoint
        self.relay = relay
        self.provider_ttl = provider_ttl
        self._dht = dht
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._unreachable_logged = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the announcing thread (a daemon named ``pulsesync-announce``)."""
        self._thread = threading.Thread(target=self._loop, name="pulsesync-announce", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Ask for an announcement of the relay's holdings now (coalesced; returns at once)."""
        self._wanted.set()

    def stop(self) -> None:
        """Tell the thread to end (returns at once; :meth:`join` waits for it)."""
        self._stop.set()
        self._wanted.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end (after :meth:`stop`)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        """Announce the relay's objects (complete and arriving) whenever they change, and every third of
        ``provider_ttl`` so the record does not expire; until :meth:`stop`. DHT errors are logged, retried."""
        while not self._stop.is_set():
            self._wanted.wait(timeout=self.provider_ttl / 3)
            self._wanted.clear()
            if self._stop.is_set():
                return
            versions = self.relay.versions()
            if not versions or not self.reachable():
                continue
            try:
                self.endpoint.announce_provider(
                    versions, partial=self.relay.partial(), publisher=False, ttl=self.provider_ttl, timeout=10.0
                )
            except Exception as exc:  # the DHT process is gone or stuck: keep the relay serving, try again later
                logger.warning("announcing the relay failed error=%r", exc)

    def reachable(self) -> bool:
        """Whether other peers can reach this subscriber's relay (checked before every announcement: a relay
        address can arrive, or go, after start). The first refusal is logged with what to change."""
        reachable = self._dht is not None and is_reachable(self._dht)
        if not reachable and not self._unreachable_logged:
            self._unreachable_logged = True
            logger.info(
                "not announcing this subscriber as a relay: it is in client mode without a relay address, so "
                "nobody can reach it (client-mode peers reserve a relay slot on a public initial peer by default; "
                "see the log for 'no relay reservation', or set use_auto_relay true / relays)"
            )
        return reachable
