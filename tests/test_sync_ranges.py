"""A fetch reads an object as byte ranges over several libp2p streams at once (pulseloco.sync.transport): the ranges
it asks for, how a provider answers them, and what the asker refuses, over a real hivemind DHT."""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import threading
import time
import typing
from typing import Any

import pytest
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from sync_helpers import maddrs, start_dht

from pulseloco.errors import PayloadError, UnauthorizedError
from pulseloco.p2p import asker_closes, stream_messages
from pulseloco.sync.signing import Envelope, generate_key, sign_envelope
from pulseloco.sync.transport import (
    FETCH_STREAMS,
    RANGE_BYTES,
    FetchRequest,
    Provided,
    SwarmEndpoint,
    SyncServicer,
    plan_ranges,
    split_range,
)

pytestmark = pytest.mark.timeout(120)

RUN = "ranges-test"


def test_ranges_are_planned_from_the_last_size_of_the_kind_and_cover_everything() -> None:
    assert plan_ranges(None) == [(0, RANGE_BYTES)]  # no hint: the first window, then the rest once the size is known
    assert plan_ranges(1000) == [(0, None)]
    five = plan_ranges(5 * RANGE_BYTES)
    assert len(five) == 5 and five[0][0] == 0 and five[-1][1] is None
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(five) if a[1] is not None)
    assert len(plan_ranges(100 * RANGE_BYTES)) == FETCH_STREAMS
    rest = split_range(RANGE_BYTES, 50 * RANGE_BYTES)
    assert len(rest) == FETCH_STREAMS and rest[0][0] == RANGE_BYTES
    assert sum(length for _, length in rest) == 49 * RANGE_BYTES
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(rest))
    assert split_range(10, 20) == [(10, 10)] and split_range(5, 5) == []


def test_a_range_request_round_trips_and_a_whole_one_is_encoded_as_before() -> None:
    whole = FetchRequest("patch", 3)
    assert b"offset" not in whole.encode(RUN) and FetchRequest.decode(whole.encode(RUN)) == (RUN, whole)
    ranged = FetchRequest("squash", 9, 4, offset=1 << 20, length=RANGE_BYTES)
    assert FetchRequest.decode(ranged.encode(RUN)) == (RUN, ranged)
    for bad in ('"offset": -1', '"offset": true', '"offset": "7"', '"length": 0', '"offset": 1e300', '"length": [1]'):
        blob = ('{"run_id": "r", "kind": "patch", "version": 1, ' + bad + "}").encode()
        with pytest.raises(PayloadError, match="malformed fetch request"):
            FetchRequest.decode(blob)


class _Sink:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.ended: list[str] = []

    def chunk(self, data: bytes) -> None:
        self.chunks.append(bytes(data))

    def complete(self, payload: bytes) -> None:
        self.ended.append("complete")

    def fail(self, reason: str) -> None:
        self.ended.append("fail: " + reason)


@pytest.fixture
def pair() -> Any:
    """A provider and an asker over a real DHT: ``(provider endpoint, asker endpoint)``."""
    first = start_dht()
    second = start_dht(maddrs(first))
    server = SwarmEndpoint(first, RUN, name="provider")
    client = SwarmEndpoint(second, RUN, name="asker")
    try:
        yield server, client
    finally:
        client.close()
        server.close()
        second.shutdown()
        first.shutdown()


def _signed(key: Any, payload: bytes, version: int = 7) -> bytes:
    envelope = Envelope(
        RUN, "patch", version, version - 1, "d" * 32, "b" * 32, hashlib.sha256(payload).hexdigest(), len(payload)
    )
    return sign_envelope(key, envelope)


def test_an_object_arrives_whole_over_several_streams_in_order_and_the_next_fetch_cuts_by_its_size(pair) -> None:
    server, client = pair
    key = generate_key()
    payload = os.urandom(5 * RANGE_BYTES + 12345)  # a patch of the tests' 25M model is about this size
    envelope = _signed(key, payload)
    asked: list[tuple[int, int | None]] = []
    lock = threading.Lock()

    def provide(request: FetchRequest) -> Provided:
        with lock:
            asked.append((request.offset, request.length))
        return Provided("ok", envelope, payload)

    server.serve(provide)
    peer = server.peer_id.to_base58()
    sinks: list[_Sink] = []

    def on_start(env: Any, blob: bytes) -> _Sink:
        assert blob == envelope and env.size == len(payload)
        sinks.append(_Sink())
        return sinks[-1]

    fetched = client.fetch(
        peer, FetchRequest("patch", 7), key.public_key(), max_bytes=1 << 24, timeout=60, on_start=on_start
    )
    assert isinstance(fetched, tuple) and fetched[1] == envelope and fetched[2] == payload
    first = sorted(asked)
    # the first window, then once its header told the size the rest at once, in 4 ranges of at least a window
    assert first == [(0, RANGE_BYTES), *split_range(RANGE_BYTES, len(payload))] and len(first) == 5
    assert b"".join(sinks[0].chunks) == payload and sinks[0].ended == ["complete"]  # a relay gets it in order
    asked.clear()
    again = client.fetch(peer, FetchRequest("patch", 7), key.public_key(), max_bytes=1 << 24, timeout=60)
    assert isinstance(again, tuple) and again[2] == payload
    assert sorted(asked) == sorted(plan_ranges(len(payload))) and len(asked) == 6  # at once, by the last size


@pytest.mark.parametrize("fault", ["flipped", "other-envelope", "other-size", "busy-later", "shorter"])
def test_a_provider_whose_ranges_do_not_add_up_is_refused_and_the_relay_told(pair, fault: str) -> None:
    server, client = pair
    key = generate_key()
    payload = os.urandom(3 * RANGE_BYTES)
    envelope = _signed(key, payload)

    def provide(request: FetchRequest) -> Provided:
        if request.offset == 0:
            return Provided("ok", envelope, payload)
        if fault == "flipped":  # one bit of a later range: corruption in transit, or a relay lying
            data = bytearray(payload)
            data[request.offset + 5] ^= 1
            return Provided("ok", envelope, bytes(data))
        if fault == "other-envelope":
            return Provided("ok", _signed(key, payload, version=8), payload)
        if fault == "other-size":
            return Provided("ok", envelope, payload + b"x")
        if fault == "busy-later":
            return Provided("busy")
        return Provided("ok", envelope, payload[: request.offset])  # shorter: the later ranges disagree on the size

    server.serve(provide)
    peer = server.peer_id.to_base58()
    sinks: list[_Sink] = []

    def on_start(env: Any, blob: bytes) -> _Sink:
        sinks.append(_Sink())
        return sinks[-1]

    def fetch() -> Any:
        return client.fetch(
            peer, FetchRequest("patch", 7), key.public_key(), max_bytes=1 << 24, timeout=60, on_start=on_start
        )

    if fault == "busy-later":
        assert fetch() == "busy"
    else:
        expected = {
            "flipped": (UnauthorizedError, "signed SHA-256"),
            "other-envelope": (UnauthorizedError, "two different envelopes"),
            "other-size": (PayloadError, "declare"),
            "shorter": (PayloadError, "ranges of one object declare"),
        }[fault]
        with pytest.raises(expected[0], match=expected[1]):
            fetch()
    assert len(sinks) == 1 and len(sinks[0].ended) == 1 and sinks[0].ended[0].startswith("fail")


class _ShiftedServicer(SyncServicer):
    """A provider that answers every range but the first with the bytes one further on than asked for."""

    @asker_closes
    async def rpc_fetch(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        _, req = FetchRequest.decode(request.metadata)
        provided = self._provide(req)
        offset = req.offset + (1 if req.offset else 0)
        body = provided.payload[offset : None if req.length is None else offset + req.length]
        head = {
            "status": "ok",
            "envelope": base64.b64encode(provided.envelope).decode(),
            "total": len(provided.payload),
        }
        for message in stream_messages(runtime_pb2.ExpertResponse, {**head, "offset": offset}, [body]):
            yield message


_ShiftedServicer.__name__ = SyncServicer.__name__  # hivemind names a handler after its class: the asker's stub's


def test_a_range_other_than_the_one_asked_for_is_refused(pair) -> None:
    server, client = pair
    key = generate_key()
    payload = os.urandom(3 * RANGE_BYTES)
    envelope = _signed(key, payload)
    server._host.serve(_ShiftedServicer(RUN, lambda request: Provided("ok", envelope, payload)), RUN)
    with pytest.raises(PayloadError, match=r"answered bytes \d+\+\d+ of 786432 for the range asked at \d+"):
        client.fetch(
            server.peer_id.to_base58(), FetchRequest("patch", 7), key.public_key(), max_bytes=1 << 24, timeout=60
        )


def test_a_publisher_counts_one_upload_per_fetch_and_serves_its_ranges_from_one_read(tmp_path) -> None:
    """The budget (2 uploads of the newest version here) counts the range at offset 0 that every fetch asks for;
    the other ranges of those fetches are served, and the file is read and checked once for all of them."""
    import torch

    from pulseloco.sync.publisher import Publisher

    publisher = Publisher(None, RUN, generate_key(), tmp_path / "store", max_uploads_per_version=2)
    try:
        publisher.publish({"w": torch.zeros(64, dtype=torch.bfloat16)})
        assert publisher.flush(timeout=30) is not None  # else the next publish may replace this one still queued
        publisher.publish({"w": torch.ones(64, dtype=torch.bfloat16)})
        version = publisher.flush(timeout=30)
        assert version is not None
        reads: list[tuple[str, int]] = []
        read = publisher._read_verified
        publisher._read_verified = lambda kind, v: reads.append((kind, v)) or read(kind, v)  # type: ignore[method-assign]
        answers = [publisher._provide(FetchRequest("patch", version, offset=o)) for o in (0, 7, 0, 9, 11)]
        assert [a.status for a in answers] == ["ok"] * 5
        assert publisher._provide(FetchRequest("patch", version)).status == "busy"  # a third fetch: relays' turn
        assert publisher._provide(FetchRequest("patch", version, offset=7)).status == "ok"
        assert reads == [("patch", version)]
    finally:
        publisher.close()


def test_a_relay_serves_the_ranges_of_an_object_it_still_receives_and_counts_one_upload(pair) -> None:
    """Every range comes from the relay's object while it arrives (the later ones skip what comes before them);
    the relay's one upload slot is taken by the range at offset 0 only, the others are served beside it, and the
    slot is given back at the end."""
    from pulseloco.sync.relay import Relay
    from pulseloco.sync.signing import verify_envelope

    server, client = pair
    key = generate_key()
    payload = os.urandom(4 * RANGE_BYTES + 999)
    blob = _signed(key, payload)
    relay = Relay(max_uploads=1)
    sink = relay.begin(verify_envelope(key.public_key(), blob, run_id=RUN), blob)
    assert sink is not None
    half = 1000  # every range then waits for more, the first one holding the relay's one upload slot
    for start in range(0, half, 65536):
        sink.chunk(payload[start : min(start + 65536, half)])
    server.serve(relay.provide)
    client._size_hints["patch"] = len(payload)  # as after an earlier patch: every range at once
    out: dict[str, Any] = {}

    def fetch() -> None:
        out["got"] = client.fetch(
            server.peer_id.to_base58(), FetchRequest("patch", 7), key.public_key(), max_bytes=1 << 24, timeout=60
        )

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    obj = relay.get("patch", 7)
    assert obj is not None
    deadline = time.monotonic() + 30
    while relay.uploads != 1 or obj.readers != len(plan_ranges(len(payload))):
        assert time.monotonic() < deadline, (relay.uploads, obj.readers)
        time.sleep(0.02)
    for start in range(half, len(payload), 65536):
        sink.chunk(payload[start : start + 65536])
    sink.complete(payload)
    thread.join(60)
    assert isinstance(out.get("got"), tuple) and out["got"][2] == payload
    assert relay.uploads == 0


def test_a_small_object_comes_on_one_stream_before_and_after_the_size_is_known(pair) -> None:
    server, client = pair
    key = generate_key()
    payload = os.urandom(RANGE_BYTES // 3)
    envelope = _signed(key, payload)
    asked: list[tuple[int, int | None]] = []
    server.serve(lambda request: asked.append((request.offset, request.length)) or Provided("ok", envelope, payload))
    for _ in range(2):
        got = client.fetch(
            server.peer_id.to_base58(), FetchRequest("patch", 7), key.public_key(), max_bytes=1 << 20, timeout=30
        )
        assert isinstance(got, tuple) and got[2] == payload
    assert asked == [(0, RANGE_BYTES), (0, None)]
