"""The shared stream protocol of :mod:`pulseloco.p2p` without a swarm: a header and chunked payload round-trip,
and every violation (oversized declaration, extra or missing bytes, bad header, stalled sender) is refused with
its own error; the reader stops at the declared size and closes the stream. Then, on two real libp2p daemons: a
burst of streams reaching a stalled event loop (with hivemind's accept backlog some end without a header, the
daemon resets them; with :data:`LISTEN_BACKLOG` all are answered), and a handler under :func:`asker_closes` that
keeps its stream open after its reply until the asker closes it."""

from __future__ import annotations

import asyncio
import json
import threading
import typing
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable

import pytest
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

import pulseloco.p2p
from pulseloco.errors import PayloadError, PayloadSizeError, TruncatedPayloadError
from pulseloco.p2p import (
    LISTEN_BACKLOG,
    BackgroundLoop,
    asker_closes,
    listen_with_backlog,
    read_reply,
    read_stream,
    stream_messages,
)

pytestmark = pytest.mark.timeout(30)

Message = runtime_pb2.ExpertResponse


async def _feed(
    messages: Iterable[Message], stall: float = 0.0, closed: list[bool] | None = None
) -> AsyncIterator[Message]:
    try:
        for message in messages:
            yield message
        await asyncio.sleep(stall)  # a sender that keeps the stream open after its last message
    finally:
        if closed is not None:
            closed.append(True)


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
    header = next(stream_messages(Message, {}, [b"x" * 8]))
    with pytest.raises(PayloadSizeError, match="more than the 8 bytes"):
        _read([header, Message(metadata=b"x" * 4), Message(metadata=b"x" * 5)])


def test_the_reader_stops_at_the_declared_size_and_closes_the_stream() -> None:
    """The server keeps its stream open after the reply (asker_closes): the reader takes exactly the declared
    bytes, does not wait for the end and closes the stream; a message past them is never read."""
    closed: list[bool] = []
    messages = [*stream_messages(Message, {}, [b"x" * 8], chunk_bytes=4), Message(metadata=b"never read")]

    async def read() -> tuple:
        return await read_stream(_feed(messages, stall=30.0, closed=closed), max_bytes=8, timeout=5)

    assert asyncio.run(asyncio.wait_for(read(), 5)) == ({"size": 8}, b"x" * 8)
    assert closed == [True]


def test_the_stream_is_closed_when_reading_fails() -> None:
    closed: list[bool] = []
    with pytest.raises(PayloadSizeError):
        asyncio.run(read_stream(_feed(stream_messages(Message, {}, [b"x" * 9]), closed=closed), max_bytes=8, timeout=5))
    assert closed == [True]


def test_a_one_message_reply_is_read_and_the_stream_closed() -> None:
    closed: list[bool] = []
    reply = asyncio.run(read_reply(_feed([Message(metadata=b"{}")], stall=30.0, closed=closed), timeout=5))
    assert reply.metadata == b"{}" and closed == [True]
    with pytest.raises(TruncatedPayloadError, match="without a reply"):
        asyncio.run(read_reply(_feed([]), timeout=5))


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
    messages = list(stream_messages(Message, {}, [b"x" * 8], chunk_bytes=4))
    with pytest.raises(TimeoutError):
        _read(messages[:-1], stall=10.0, timeout=0.2)  # the last chunk never comes


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


class _Replier(ServicerBase):
    """One reply of 300 kB (more than a unix socket buffers), then the stream is the asker's to close."""

    @asker_closes
    async def rpc_reply(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:  # hivemind needs typing's alias
        for message in stream_messages(Message, {"ok": True}, [b"x" * 300_000], chunk_bytes=100_000):
            yield message


async def _ask(client: P2P, server: P2P, *, close_after_reply: bool) -> tuple[int, float]:
    """Read the reply raw; then close the stream at once, or wait for its end: ``(bytes, seconds waited for the
    end after the reply)``."""
    stub = _Replier.get_stub(client, server.peer_id, namespace="test")
    messages = (await stub.rpc_reply(runtime_pb2.ExpertRequest())).__aiter__()
    header = json.loads((await asyncio.wait_for(messages.__anext__(), 10)).metadata)
    received = 0
    while received < header["size"]:
        received += len((await asyncio.wait_for(messages.__anext__(), 10)).metadata)
    started = asyncio.get_running_loop().time()
    if close_after_reply:
        await pulseloco.p2p.close_stream(messages)
    else:
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(messages.__anext__(), 10)
    return received, asyncio.get_running_loop().time() - started


def test_a_handler_keeps_its_stream_open_until_the_asker_closes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server never ends a stream first (its daemon could then reset it and drop the reply's last bytes,
    pulseloco.p2p.STREAM_LINGER_S): after its reply the stream stays open; the asker's close ends the handler at
    once; an asker that never closes is let go after STREAM_LINGER_S."""
    monkeypatch.setattr(pulseloco.p2p, "STREAM_LINGER_S", 2.0)
    loop = BackgroundLoop("test-p2p-linger")

    async def serve() -> tuple[P2P, list]:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        listen_with_backlog(p2p)
        await _Replier().add_p2p_handlers(p2p, namespace="test")
        return p2p, await p2p.get_visible_maddrs()

    def server_tasks() -> int:
        return len(asyncio.all_tasks(loop.loop))

    async def ask_all(server: P2P, maddrs: list) -> None:
        client = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            await _ask(client, server, close_after_reply=True)  # connected, the handler known
            baseline = await _settled(server_tasks)
            received, _ = await _ask(client, server, close_after_reply=True)
            assert received == 300_000
            assert await _settled(server_tasks) == baseline  # the handler ended with the asker's close, well
            # before its linger of 2 s
            received, waited = await _ask(client, server, close_after_reply=False)
            assert received == 300_000 and 1.5 < waited < 5.0, waited  # held open, then let go
        finally:
            await client.shutdown()

    try:
        server, maddrs = loop.run(serve(), timeout=20)
        try:
            asyncio.run(ask_all(server, maddrs))
        finally:
            loop.run(server.shutdown(), timeout=10)
    finally:
        loop.shutdown()


async def _settled(count: Callable[[], int], within: float = 1.0) -> int:
    """``count()`` once it has not changed for 0.2 s (at most ``within`` s of polling)."""
    deadline = asyncio.get_running_loop().time() + within
    last = count()
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
        now = count()
        if now == last:
            return now
        last = now
    return last


def test_every_handler_of_the_project_streams_its_reply_and_lets_the_asker_close() -> None:
    """hivemind sees each handler as it is declared (the decorator keeps the request parameter's name and the
    annotations it reads), and every one answers on a stream held open for the asker (a unary answer would be
    closed by the server)."""
    from pulseloco.loco.averaging import SparseAverager
    from pulseloco.rollouts.worker import RolloutServicer
    from pulseloco.sync.transport import SyncServicer

    seen = {}
    for servicer in (SparseAverager, RolloutServicer, SyncServicer):
        servicer._collect_rpc_handlers()
        for handler in servicer._rpc_handlers:
            method = getattr(servicer, handler.method_name)
            seen[f"{servicer.__name__}.{handler.method_name}"] = (
                handler.stream_input,
                handler.stream_output,
                getattr(method, "__wrapped__", None) is not None,
            )
    assert seen == {
        "SparseAverager.rpc_download_state": (False, True, True),
        "SparseAverager.rpc_fetch": (False, True, True),
        "SparseAverager.rpc_ping": (False, True, True),
        "SparseAverager.rpc_push": (True, True, True),
        "RolloutServicer.rpc_generate": (False, True, True),
        "RolloutServicer.rpc_head": (False, True, True),
        "SyncServicer.rpc_fetch": (False, True, True),
    }
