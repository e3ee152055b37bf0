"""The shared stream protocol of :mod:`pulseloco.p2p` without a swarm: a header and chunked payload round-trip,
and every violation (oversized declaration, extra or missing bytes, bad header, stalled sender) is refused with
its own error. Then, on two real libp2p daemons, a burst of streams reaching a stalled event loop: with hivemind's
accept backlog some end without a header (the daemon resets them), with :data:`LISTEN_BACKLOG` all are answered."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterable

import pytest
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from pulseloco.errors import PayloadError, PayloadSizeError, TruncatedPayloadError
from pulseloco.p2p import LISTEN_BACKLOG, BackgroundLoop, listen_with_backlog, read_stream, stream_messages

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


_BURST = 160  # more than hivemind's backlog of 100 (the kernel queues backlog + 1 connections)


async def _answer(request: runtime_pb2.ExpertRequest, context: P2PContext) -> AsyncIterator[Message]:
    for message in stream_messages(Message, {"ok": True}):
        yield message


async def _serve(backlog: int | None) -> tuple[P2P, list]:
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if backlog is not None:
        listen_with_backlog(p2p, backlog)
    await p2p.add_protobuf_handler("test.rpc_answer", _answer, runtime_pb2.ExpertRequest, stream_output=True)
    return p2p, await p2p.get_visible_maddrs()


async def _burst_at_stalled_server(server: P2P, maddrs: list, server_loop: asyncio.AbstractEventLoop) -> Counter:
    """Open :data:`_BURST` streams while the server's event loop is blocked (as by a long GIL-holding step), then
    let it run and read every stream: ``Counter`` of ``"ok"`` and the errors' class names."""
    client = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    release, opened = threading.Event(), asyncio.Event()
    opened.set()

    async def one() -> str:
        try:
            stream = await client.iterate_protobuf_handler(
                server.peer_id, "test.rpc_answer", runtime_pb2.ExpertRequest(metadata=b"{}"), Message
            )
            await opened.wait()
            await read_stream(stream, max_bytes=0, timeout=20)
        except Exception as exc:  # an empty stream, or the reset as hivemind's writing task saw it
            return type(exc).__name__
        return "ok"

    try:
        assert await one() == "ok"  # connected, the handler known
        opened.clear()
        server_loop.call_soon_threadsafe(release.wait, 20)  # blocks the server's loop (not the GIL)
        tasks = [asyncio.create_task(one()) for _ in range(_BURST)]
        await asyncio.sleep(1.5)  # every stream open and its request sent; the server's daemon dials the handler
        release.set()
        opened.set()
        return Counter(await asyncio.gather(*tasks))
    finally:
        release.set()
        await client.shutdown()


@pytest.mark.parametrize("backlog", [None, LISTEN_BACKLOG], ids=["hivemind-backlog", "LISTEN_BACKLOG"])
def test_a_burst_at_a_stalled_loop_is_queued_not_reset(backlog: int | None) -> None:
    loop = BackgroundLoop("test-p2p-server")
    try:
        server, maddrs = loop.run(_serve(backlog), timeout=20)
        try:
            outcome = asyncio.run(_burst_at_stalled_server(server, maddrs, loop.loop))
        finally:
            loop.run(server.shutdown(), timeout=10)
    finally:
        loop.shutdown()
    if backlog is None:  # the cause: streams past the backlog were reset by the daemon with nothing sent; the
        # reader saw "the stream ended without a header", or hivemind's writing task the reset first
        resets = {"TruncatedPayloadError", "ConnectionResetError", "BrokenPipeError"}
        assert outcome["ok"] < _BURST and set(outcome) <= {"ok", *resets}, outcome
    else:
        assert outcome == Counter(ok=_BURST), outcome
