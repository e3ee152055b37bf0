"""PULSESync transport timeouts without a swarm: every DHT wait of :class:`SwarmEndpoint` is bounded (a stand-in
DHT hands back futures that never finish), and :class:`pulseloco.p2p.BackgroundLoop` cancels a coroutine it stops
waiting for."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pulseloco.errors import SwarmError
from pulseloco.p2p import BackgroundLoop
from pulseloco.sync.publisher import Publisher
from pulseloco.sync.signing import generate_key
from pulseloco.sync.transport import SwarmEndpoint

pytestmark = pytest.mark.timeout(30)

RUN = "transport-test"


class _StalledDHT:
    """A DHT whose every call returns a future that never finishes (a DHT process that stopped answering)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def store(self, key: str, value: Any, expiration_time: float, **kwargs: Any) -> Any:
        self.calls.append(("store", key))
        if not kwargs.get("return_future"):
            raise AssertionError("a blocking DHT store has no timeout: use return_future=True")
        return concurrent.futures.Future()

    def get(self, key: str, latest: bool = False, **kwargs: Any) -> Any:
        self.calls.append(("get", key))
        if not kwargs.get("return_future"):
            raise AssertionError("a blocking DHT get has no timeout: use return_future=True")
        return concurrent.futures.Future()


class _OrderedDHT:
    """A DHT whose provider-record stores land ``delay`` s after the call and head stores at once; ``events``
    lists the calls and landings in order."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.events: list[tuple[str, str]] = []

    def store(self, key: str, value: Any, expiration_time: float, **kwargs: Any) -> Any:
        name = key.rsplit(":", 1)[-1]
        self.events.append(("store", name))
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()

        def land() -> None:
            self.events.append(("landed", name))
            future.set_result(True)

        if name == "providers":
            threading.Timer(self.delay, land).start()
        else:
            land()
        return future


def _endpoint(dht: _StalledDHT | _OrderedDHT) -> SwarmEndpoint:
    """A SwarmEndpoint's DHT-record half, without the P2P replica __init__ would start."""
    endpoint = object.__new__(SwarmEndpoint)
    endpoint.dht = dht  # type: ignore[assignment]
    endpoint.run_id = RUN
    endpoint.head_key = f"pulseloco:{RUN}:head"
    endpoint.providers_key = f"pulseloco:{RUN}:providers"
    endpoint.peer_id = SimpleNamespace(to_base58=lambda: "stand-in-peer")  # type: ignore[assignment]
    return endpoint


def test_dht_record_calls_give_up_after_their_timeout(caplog: pytest.LogCaptureFixture) -> None:
    dht = _StalledDHT()
    endpoint = _endpoint(dht)
    caplog.set_level(logging.WARNING, logger="pulseloco.sync.transport")

    started = time.monotonic()
    assert endpoint.store_head(b"{}", ttl=60, timeout=0.2) is False
    assert endpoint.get_head(generate_key().public_key(), timeout=0.2) is None
    assert endpoint.get_providers(timeout=0.2) == {}
    endpoint.announce_provider([1, 2], publisher=True, ttl=30, timeout=0.2)
    assert time.monotonic() - started < 5

    assert [c[0] for c in dht.calls] == ["store", "get", "get", "store"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("did not store the head record within 0.2 s" in m for m in messages), messages
    assert sum("DHT lookup timed out" in m for m in messages) == 2, messages
    assert any("did not store the provider record" in m for m in messages), messages


def test_the_publisher_stores_its_provider_and_head_records_at_once_after_the_first(tmp_path: Any) -> None:
    """The first announce stores the provider record before the head (a subscriber reading that head must find
    the publisher); later ones store both at once, one DHT round trip, and wait for both. A new version's head
    goes to the head listeners (the trainer's push to its workers) before the DHT is asked to store it, except
    for the first, once its provider record is stored; a re-announce of the same version tells them nothing."""
    dht = _OrderedDHT(delay=0.3)
    pub = Publisher(None, RUN, generate_key(), tmp_path / "store")
    pub.add_head_listener(lambda version, head: dht.events.append(("told", str(version))))
    try:
        pub.publish({"w": torch.zeros(4, dtype=torch.bfloat16)})
        pub.flush(timeout=10)
        dht.events.clear()  # without a DHT the head is told at signing
        pub.endpoint = _endpoint(dht)
        assert pub._announce(new=True)
        assert dht.events == [
            ("store", "providers"),
            ("landed", "providers"),
            ("told", "1"),
            ("store", "head"),
            ("landed", "head"),
        ]
        dht.events.clear()
        assert pub._announce()
        assert dht.events == [("store", "providers"), ("store", "head"), ("landed", "head"), ("landed", "providers")]
        dht.events.clear()
        pub.publish({"w": torch.ones(4, dtype=torch.bfloat16)})
        pub.flush(timeout=10)
        assert dht.events == [
            ("told", "2"),
            ("store", "providers"),
            ("store", "head"),
            ("landed", "head"),
            ("landed", "providers"),
        ]
    finally:
        pub.endpoint = None
        pub.close()


def test_background_loop_cancels_a_coroutine_it_stops_waiting_for() -> None:
    loop = BackgroundLoop("transport-test")
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def own_timeout() -> None:
        await asyncio.wait_for(asyncio.sleep(3600), 0.01)

    try:
        with pytest.raises(concurrent.futures.TimeoutError) as raised:
            loop.run(forever(), timeout=0.1)
        assert isinstance(raised.value, SwarmError)  # what PULSELoCo's averaging catches
        assert cancelled.wait(5), "the abandoned coroutine was not cancelled"
        # a timeout raised inside the coroutine comes through as the coroutine's own error
        with pytest.raises(TimeoutError) as own:
            loop.run(own_timeout(), timeout=10)
        assert not isinstance(own.value, SwarmError)
        assert loop.run(asyncio.sleep(0, result=42), timeout=5) == 42
    finally:
        loop.shutdown()


def test_a_publisher_whose_record_predates_a_version_is_asked_for_it_beside_the_relays() -> None:
    """A pushed head reaches workers before the publisher's provider record lists the version, while relays the
    publisher served already list it as arriving: the lookup names the publisher too, not the busy relays alone
    (an 8-worker run without limits fell back to full anchors twice). A version the publisher's entry lists is
    asked as before; one older than its newest listed and not listed (pruned) is not asked of it."""
    from pulseloco.sync.sources import SwarmSource
    from pulseloco.sync.transport import FetchRequest

    records = {
        "pub": {"versions": [1, 10], "partial": [], "publisher": True},
        "relay": {"versions": [10, 11], "partial": [11], "publisher": False},
        "me": {"versions": [10], "partial": [], "publisher": False},
    }
    endpoint = SimpleNamespace(get_providers=lambda timeout: records, peer_id=SimpleNamespace(to_base58=lambda: "me"))
    source = SwarmSource(endpoint, generate_key().public_key())  # type: ignore[arg-type]
    deadline = time.monotonic() + 10

    assert source._providers(FetchRequest("patch", 11), "me", set(), deadline) == ([], ["relay"], ["pub"])
    assert source._providers(FetchRequest("patch", 12), "me", set(), deadline) == ([], [], ["pub"])
    assert source._providers(FetchRequest("patch", 10), "me", set(), deadline) == (["relay"], [], ["pub"])
    assert source._providers(FetchRequest("patch", 5), "me", set(), deadline) == ([], [], [])
    assert source._providers(FetchRequest("patch", 11), "me", {"pub"}, deadline) == ([], ["relay"], [])
