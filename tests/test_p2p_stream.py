"""The shared stream protocol of :mod:`pulseloco.p2p` without a swarm: a header and chunked payload round-trip,
and every violation (oversized declaration, extra or missing bytes, bad header, stalled sender) is refused with
its own error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable

import pytest
from hivemind.proto import runtime_pb2

from pulseloco.errors import PayloadError, PayloadSizeError, TruncatedPayloadError
from pulseloco.p2p import read_stream, stream_messages

pytestmark = pytest.mark.timeout(30)

Message = runtime_pb2.ExpertResponse


async def _feed(messages: Iterable[Message], stall: float = 0.0) -> AsyncIterator[Message]:
    for message in messages:
        yield message
    await asyncio.sleep(stall)  # a sender that keeps the stream open after its last message


def _read(messages: Iterable[Message], *, max_bytes: int = 1 << 20, stall: float = 0.0, timeout: float = 5.0) -> tuple:
    return asyncio.run(read_stream(_feed(messages, stall), max_bytes=max_bytes, timeout=timeout))


def test_round_trip_in_chunks_over_several_buffers() -> None:
    buffers = [b"a" * 10, memoryview(b"b" * 7), b""]
    messages = list(stream_messages(Message, {"ok": True}, buffers, chunk_bytes=4))
    assert [len(m.metadata) for m in messages[1:]] == [4, 4, 2, 4, 3]  # a chunk never spans two buffers
    seen: list[int] = []
    header, payload = asyncio.run(
        read_stream(_feed(messages), max_bytes=17, timeout=5, on_message=lambda h, m: seen.append(h["size"]))
    )
    assert header == {"ok": True, "size": 17} and payload == b"a" * 10 + b"b" * 7
    assert seen == [17] * len(messages)


def test_header_only_stream() -> None:
    assert _read(stream_messages(Message, {"status": "missing"}), max_bytes=0) == (
        {"status": "missing", "size": 0},
        b"",
    )


def test_declared_size_above_the_bound_is_refused_before_the_payload() -> None:
    with pytest.raises(PayloadSizeError, match="above the limit of 99"):
        _read(stream_messages(Message, {}, [b"x" * 100]), max_bytes=99)


def test_more_bytes_than_declared_are_refused() -> None:
    messages = list(stream_messages(Message, {}, [b"x" * 8]))
    with pytest.raises(PayloadSizeError, match="more than the 8 bytes"):
        _read([*messages, Message(metadata=b"extra")])


def test_a_stream_cut_short_is_truncated() -> None:
    messages = list(stream_messages(Message, {}, [b"x" * 8], chunk_bytes=4))
    with pytest.raises(TruncatedPayloadError, match="after 4 of 8 bytes"):
        _read(messages[:-1])


@pytest.mark.parametrize(
    "first",
    [b"not json", json.dumps([1, 2]).encode(), json.dumps({"size": "8"}).encode(), json.dumps({"size": -1}).encode()],
)
def test_malformed_headers_are_refused(first: bytes) -> None:
    with pytest.raises(PayloadError):
        _read([Message(metadata=first)])


def test_an_empty_stream_has_no_header() -> None:
    with pytest.raises(PayloadError, match="without a header"):
        _read([])


def test_every_message_is_timed_out() -> None:
    messages = list(stream_messages(Message, {}, [b"x" * 8]))
    with pytest.raises(TimeoutError):
        _read(messages, stall=10.0, timeout=0.2)  # all bytes arrived, but the stream never ends
