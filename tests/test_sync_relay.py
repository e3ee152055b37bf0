"""Pipelined relays: a subscriber serves an object while it still receives it, drops it when its download fails,
and holds at most ``max_bytes``.

The network tests use real hivemind DHTs and libp2p daemons on 127.0.0.1. The slow upstream is a gated provider:
a real endpoint that serves the publisher's genuine signed object, sends the first half of the payload, then
waits for the test to open its gate. While the gate is closed the relay cannot have completed its download, so
anything a downstream received by then was forwarded while the relay was still receiving (no timing involved).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sync_helpers import Trainer, bf16_digest, maddrs, start_dht, tiny_model, wait_for, wait_until_provider_lists

from pulseloco.errors import PayloadError
from pulseloco.sync.publisher import Publisher
from pulseloco.sync.relay import Relay
from pulseloco.sync.signing import Envelope, generate_key
from pulseloco.sync.subscriber import Subscriber
from pulseloco.sync.transport import FetchRequest, Provided, SwarmEndpoint

RUN = "relay-test"
PIECE = 4096


@pytest.fixture(scope="module")
def bootstrap():
    dht = start_dht()
    yield dht
    dht.shutdown()


class GatedSource:
    """The payload in pieces of ``PIECE`` bytes: the first half at once, the rest after ``gate`` opens (bounded
    wait); with ``corrupt`` one byte of the second half is flipped (the SHA-256 then fails downstream)."""

    def __init__(self, payload: bytes, gate: threading.Event, corrupt: bool) -> None:
        self.payload = bytearray(payload)
        if corrupt:
            self.payload[len(payload) * 3 // 4] ^= 0x01
        self.size = len(payload)
        self.gate = gate
        self.half_sent = threading.Event()

    async def chunks(self) -> AsyncIterator[bytes]:
        half = self.size // 2
        for start in range(0, half, PIECE):
            yield bytes(self.payload[start : min(start + PIECE, half)])
        self.half_sent.set()
        deadline = time.monotonic() + 30
        while not self.gate.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never opened the gate")
            await asyncio.sleep(0.01)
        for start in range(half, self.size, PIECE):
            yield bytes(self.payload[start : start + PIECE])


class GatedUpstream:
    """A provider announcing itself as a relay that holds the anchor: it serves the first request through a
    :class:`GatedSource` and answers every later one ``busy`` (so downstreams must look elsewhere)."""

    def __init__(self, dht: Any, run: str, env_blob: bytes, payload: bytes, *, corrupt: bool = False) -> None:
        self.gate = threading.Event()
        self.source = GatedSource(payload, self.gate, corrupt)
        self.env_blob = env_blob
        self.served = 0
        self.endpoint = SwarmEndpoint(dht, run, name="gated")
        self.endpoint.serve(self.provide)

    def provide(self, request: FetchRequest) -> Provided:
        if request.kind != "anchor" or request.version != 1:
            return Provided("missing")
        self.served += 1
        if self.served > 1:
            return Provided("busy")
        return Provided("ok", self.env_blob, source=self.source)


def publish_anchor(tmp_path: Path, key: Any, dht: Any, run: str) -> tuple[Publisher, str]:
    """Version 1 (an anchor) of a tiny model; the publisher is on the swarm when ``dht`` is given."""
    trainer = Trainer()
    pub = Publisher(dht, run, key, tmp_path / "store", max_uploads_per_version=2)
    pub.publish(trainer.model)
    assert pub.flush(timeout=60) == 1
    return pub, trainer.digest()


def update_in_thread(sub: Subscriber, model: torch.nn.Module) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["version"] = sub.update(model)
        except Exception as exc:  # reported to the test below
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.timeout(120)
def test_a_relay_serves_an_object_while_it_still_receives_it(bootstrap, tmp_path: Path) -> None:
    key = generate_key()
    run = RUN + "-pipeline"
    peers = maddrs(bootstrap)
    pub, expected = publish_anchor(tmp_path, key, None, run)  # not on the swarm: only the gated peer serves
    env_blob, payload = pub.store.read("anchor", 1)
    dhts = [start_dht(peers) for _ in range(3)]
    upstream = GatedUpstream(dhts[0], run, env_blob, payload)
    relay = Subscriber(dhts[1], run, key.public_key(), timeout=60)
    down = Subscriber(dhts[2], run, key.public_key(), relay=False, timeout=60)
    try:
        assert pub._head_envelope is not None
        upstream.endpoint.store_head(pub._head_envelope, ttl=120)
        upstream.endpoint.announce_provider([1], publisher=False, ttl=120, timeout=10)
        relay_model, down_model = tiny_model(seed=5, dtype=torch.bfloat16), tiny_model(seed=6, dtype=torch.bfloat16)

        relay_thread, relay_out = update_in_thread(relay, relay_model)
        assert upstream.source.half_sent.wait(30)
        obj = wait_for(lambda: relay.relay.get("anchor", 1), 30, "the relay to register the anchor")
        wait_for(lambda: obj.received >= len(payload) // 2, 30, "the relay to receive the first half")
        me = relay.endpoint.peer_id.to_base58()
        wait_until_provider_lists(upstream.endpoint, me, 1, timeout=20)
        assert upstream.endpoint.get_providers()[me]["partial"] == [1]  # announced while still arriving

        down_thread, down_out = update_in_thread(down, down_model)
        wait_for(lambda: obj.bytes_served_early >= len(payload) // 2, 30, "the downstream to get the first half")
        # the gate is still closed: the relay holds half of the object, and has already forwarded that half
        assert not obj.done and obj.completed_at is None and obj.received < len(payload)
        assert relay_thread.is_alive() and down_thread.is_alive()

        upstream.gate.set()
        relay_thread.join(60)
        down_thread.join(60)
        assert relay_out == {"version": 1} and down_out == {"version": 1}, (relay_out, down_out)
        assert bf16_digest(relay_model) == expected and bf16_digest(down_model) == expected
        assert obj.done and obj.first_served_at is not None and obj.completed_at is not None
        assert obj.first_served_at < obj.completed_at
        assert [peer for _, _, peer in down.source.served_by] == [me]  # the downstream got it from the relay
        assert upstream.served == 2  # the relay, then the downstream told busy
    finally:
        down.close()
        relay.close()
        upstream.endpoint.close()
        for dht in dhts:
            dht.shutdown()
        pub.close()


@pytest.mark.timeout(120)
def test_a_corrupted_upstream_ends_the_downstream_stream_and_it_recovers_elsewhere(bootstrap, tmp_path: Path) -> None:
    """The relay's upstream flips a byte in the second half: the relay's SHA-256 check fails, it drops the
    object and ends the downstream's stream with an error; both then get the genuine anchor from the publisher."""
    key = generate_key()
    run = RUN + "-corrupt"
    peers = maddrs(bootstrap)
    pub_dht = start_dht(peers)
    pub, expected = publish_anchor(tmp_path, key, pub_dht, run)
    env_blob, payload = pub.store.read("anchor", 1)
    dhts = [start_dht(peers) for _ in range(3)]
    upstream = GatedUpstream(dhts[0], run, env_blob, payload, corrupt=True)
    relay = Subscriber(dhts[1], run, key.public_key(), timeout=60)
    down = Subscriber(dhts[2], run, key.public_key(), relay=False, timeout=60)
    try:
        upstream.endpoint.announce_provider([1], publisher=False, ttl=120, timeout=10)
        wait_until_provider_lists(relay.endpoint, upstream.endpoint.peer_id.to_base58(), 1, timeout=20)
        relay_model, down_model = tiny_model(seed=5, dtype=torch.bfloat16), tiny_model(seed=6, dtype=torch.bfloat16)

        relay_thread, relay_out = update_in_thread(relay, relay_model)  # a complete relay is asked first: upstream
        assert upstream.source.half_sent.wait(30)
        obj = wait_for(lambda: relay.relay.get("anchor", 1), 30, "the relay to register the anchor")
        me = relay.endpoint.peer_id.to_base58()
        wait_until_provider_lists(down.endpoint, me, 1, timeout=20)
        down_thread, down_out = update_in_thread(down, down_model)
        wait_for(lambda: obj.bytes_served_early > 0, 30, "the downstream to start receiving from the relay")

        upstream.gate.set()  # the corrupted second half arrives
        relay_thread.join(60)
        down_thread.join(60)
        assert relay_out == {"version": 1} and down_out == {"version": 1}, (relay_out, down_out)
        assert bf16_digest(relay_model) == expected and bf16_digest(down_model) == expected
        assert obj.error is not None and "SHA-256" in obj.error  # the failed attempt, dropped from the relay
        held = relay.relay.get("anchor", 1)
        assert held is not None and held is not obj and held.done  # the genuine copy from the publisher
        pub_id = pub.endpoint.peer_id.to_base58()
        assert [peer for _, _, peer in down.source.served_by] == [pub_id]  # the relay failed it once: not again
        assert pub.endpoint.servicer.num_uploads <= 2
    finally:
        down.close()
        relay.close()
        upstream.endpoint.close()
        for dht in dhts:
            dht.shutdown()
        pub.close()
        pub_dht.shutdown()


# ---- the relay's bounds and readers, without a network --------------------------------------------------------


def envelope(kind: str, version: int, size: int) -> Envelope:
    return Envelope("r", kind, version, None if kind == "anchor" else version - 1, "d", "b", "0" * 64, size)


def test_the_relay_is_bounded_in_bytes_and_never_evicts_what_arrives_or_is_served() -> None:
    relay = Relay(capacity=16, max_bytes=1000)
    for v in (1, 2, 3):
        relay.add("patch", v, b"env", bytes(300), v - 1)
    assert relay.versions() == [1, 2, 3] and relay.bytes_held == 900
    relay.add("patch", 4, b"env", bytes(300), 3)  # evicts the oldest
    assert relay.versions() == [2, 3, 4] and relay.bytes_held == 900
    relay.add("anchor", 5, b"env", bytes(2000))
    assert relay.get("anchor", 5) is None and relay.versions() == [2, 3, 4]  # larger than the bound: not relayed

    served = relay.provide(FetchRequest("patch", 2))  # a download in flight pins version 2
    assert served.status == "ok" and served.on_done is not None
    sink = relay.begin(envelope("patch", 6, 400), b"env")  # in progress: counted at its signed size
    assert sink is not None
    assert relay.versions() == [2, 4, 6] and relay.partial() == [6] and relay.bytes_held == 1000
    assert relay.begin(envelope("patch", 7, 400), b"env") is None  # 2 served, 6 arriving, 4 alone is not enough
    assert relay.versions() == [2, 4, 6]
    served.on_done()
    sink.chunk(bytes(400))
    sink.complete(bytes(400))
    assert relay.begin(envelope("patch", 7, 400), b"env") is not None  # now 2 and 4 may go, oldest first
    assert relay.versions() == [6, 7] and relay.bytes_held == 800

    relay.add("anchor", 8, b"env", bytes(200))  # anchors count too; one anchor at most
    relay.add("anchor", 9, b"env", bytes(100))
    assert relay.get("anchor", 8) is None and relay.get("anchor", 9) is not None
    assert relay.bytes_held == 900


def test_relay_uploads_are_limited_and_released() -> None:
    relay = Relay(max_uploads=1)
    relay.add("patch", 1, b"env", b"x" * 10, 0)
    first = relay.provide(FetchRequest("patch", 1))
    assert first.status == "ok" and relay.provide(FetchRequest("patch", 1)).status == "busy"
    assert first.on_done is not None
    first.on_done()
    assert relay.provide(FetchRequest("patch", 1)).status == "ok"
    assert relay.provide(FetchRequest("squash", 1, 0)).status == "missing"  # a patch is not a squash


async def _read_all(source: Any) -> bytes:
    return b"".join([bytes(piece) async for piece in source.chunks()])


def test_relay_readers_follow_the_download_and_end_with_an_error_when_it_fails_or_stalls() -> None:
    relay = Relay(max_uploads=10, stall_timeout=0.3)

    async def scenario() -> None:
        sink = relay.begin(envelope("patch", 1, 6), b"env")
        assert sink is not None
        reader = relay.provide(FetchRequest("patch", 1)).source
        task = asyncio.create_task(_read_all(reader))
        sink.chunk(b"abc")
        await asyncio.sleep(0.05)
        assert not task.done()  # waiting for the rest
        sink.chunk(b"def")
        sink.complete(b"abcdef")
        assert await asyncio.wait_for(task, 5) == b"abcdef"

        sink = relay.begin(envelope("patch", 2, 6), b"env")
        assert sink is not None
        task = asyncio.create_task(_read_all(relay.provide(FetchRequest("patch", 2)).source))
        sink.chunk(b"abc")
        await asyncio.sleep(0.05)
        sink.fail("SHA-256 mismatch")
        with pytest.raises(PayloadError, match="SHA-256 mismatch"):
            await asyncio.wait_for(task, 5)
        assert relay.get("patch", 2) is None and relay.provide(FetchRequest("patch", 2)).status == "missing"

        sink = relay.begin(envelope("patch", 3, 6), b"env")
        assert sink is not None
        with pytest.raises(TimeoutError, match="stalled"):
            await asyncio.wait_for(_read_all(relay.provide(FetchRequest("patch", 3)).source), 5)

    asyncio.run(scenario())


def test_a_provider_answering_an_unknown_status_is_refused_and_busy_is_passed_on() -> None:
    """The stream header's status comes from a stranger: only ok, missing, busy (and error) are accepted."""
    first = start_dht()
    second = start_dht(maddrs(first))
    strange: Any = "weird"  # a stranger's status, outside ProvidedStatus
    answers = iter([Provided(strange), Provided("busy")])
    server = SwarmEndpoint(first, RUN, name="strange")
    client = SwarmEndpoint(second, RUN, name="asker")
    try:
        server.serve(lambda request: next(answers))
        peer = server.peer_id.to_base58()
        key = generate_key().public_key()
        with pytest.raises(PayloadError, match="unknown status 'weird'"):
            client.fetch(peer, FetchRequest("patch", 1), key, max_bytes=1 << 20, timeout=30, chunk_timeout=10)
        assert (
            client.fetch(peer, FetchRequest("patch", 1), key, max_bytes=1 << 20, timeout=30, chunk_timeout=10) == "busy"
        )
    finally:
        client.close()
        server.close()
        second.shutdown()
        first.shutdown()
