"""Sparse all-reduce of pseudo-gradients over hivemind: reduce-scatter of contiguous shards, then all-gather.

hivemind's ``DecentralizedAverager`` averages dense tensors of a fixed shape; PULSELoCo's contributions are
sparse and of a different size on every peer. :class:`SparseAverager` builds the sparse all-reduce from
hivemind's own parts: the DHT for matchmaking (:mod:`pulseloco.loco.matchmaking`), a ``ServicerBase`` with
``rpc_*`` handlers over libp2p streams on a :class:`pulseloco.p2p.P2PHost`, and the stream protocol of
:mod:`pulseloco.p2p` (a JSON header, then payload chunks of at most ``chunk_bytes``, in hivemind's
``ExpertRequest`` / ``ExpertResponse`` protobufs). State transfer (serving and downloading the global state)
is :mod:`pulseloco.loco.state`, mixed into :class:`SparseAverager`.

One round, for a group whose server-mode members ``S_0 < S_1 < ...`` (sorted peer ids) each own a contiguous
shard of the flat parameter space:

1. reduce-scatter: every member splits its selected entries by shard and pushes each part, encoded with the
   codec's FP32 mode, to the shard's owner (its own part stays local);
2. every owner waits for all members' parts (at most until the averaging deadline), decodes and validates
   them (frame, index range, finiteness, norm against the other contributions' median, or largest entry against
   the owner's own part's in a group of two), and sums the accepted ones in sorted peer-id order into a sparse sum;
3. all-gather: every member fetches every shard's sum, with the list of accepted contributors and their
   count, and divides by that count. Every peer divides the same sums by the same counts, so every peer
   computes bit-identical averages. A member refuses an average far larger than its own part of the shard
   (a poisoned owner) and treats the shard as unknown (below); it names that owner as *disputed*.

A member's traffic grows with its own payload plus the (sparse) sums, not with the number of peers times the
model. Client-mode members push and fetch but own no shard and serve nothing.

Byte accounting (:class:`Traffic`, :class:`AllReduceResult`, :class:`pulseloco.loco.metrics.RoundMetrics`). Every
protobuf message a peer sends or receives for a round is counted at its serialized size (``ByteSize()``, libp2p
framing not included) where it is sent or read (:meth:`SparseAverager._count`). Each message sent is split
exactly: the bytes of a contribution frame's index and value sections it carries (their offsets read from the
frame's header, :func:`pulseloco.codec.peek_header`), the same for a shard sum it serves, and the rest (the
stream's JSON header, the frame's prefix, JSON header and checksum, protobuf tags and lengths, push replies,
fetch requests and refusals). The parts add up to the bytes sent. :func:`payload_frame` gives the size of
the peer's whole selection as one frame (what the paper's all-gather through an object store uploads).

Exactly once (docs/design.md, "Exactly-once contributions"). What a round counted is decided by the owners
alone: shard ``j``'s sum contains exactly the contributions on its ``accepted`` list, fixed when the owner
aggregates and sent with the sum. A member therefore derives delivery from the lists it fetched, never from push
acknowledgements: its part of shard ``j`` is *counted* if and only if it fetched shard ``j`` and its id is on
the list. Every member that fetched a shard applies the same sum and the same list, so an accepted
contribution is in the theta of every peer that fetched that shard, and the sender keeps (returns to its
residual) exactly the parts it cannot show were counted. A fetch that fails is retried after the deadline (the
owner keeps its sums for ``_KEEP_ROUNDS`` rounds), which covers stalls and streams cut short. A shard that still
cannot be fetched is *unknown*: the round is incomplete (``complete`` False), the shard is not applied and this
peer's part of it is returned provisionally; the caller then repairs its theta from the swarm's majority and
reconciles its residual with the accepted lists that come with the downloaded state
(:meth:`pulseloco.loco.optimizer.PulseLoCo` keeps that ledger), so that a part the others counted is taken back
out of the residual.

Failure behaviour: every remote wait has a deadline (``averaging_timeout`` for the whole exchange,
``request_timeout`` per message, one more ``request_timeout`` per retry); the round never raises because of a
peer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

# hivemind's ServicerBase recognises streaming handlers by typing.AsyncIterator hints (their ``_name``); the
# collections.abc alias is not recognised and would silently register a unary handler.
from typing import Any, AsyncIterator, TypeVar  # noqa: UP035

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from pulseloco.codec import FrameHeader, peek_header
from pulseloco.errors import PayloadError, SwarmError
from pulseloco.loco.matchmaking import Group
from pulseloco.loco.state import StateSnapshot, StateTransfer
from pulseloco.loco.validation import decode_sparse, encode_sparse, screen_outliers
from pulseloco.p2p import CHUNK_BYTES, Message, P2PHost, header_message, parse_header, read_stream, stream_messages

logger = logging.getLogger(__name__)

__all__ = ["AllReduceResult", "SparseAverager", "Traffic", "payload_frame", "shard_bounds"]

M = TypeVar("M", bound=Message)

CONTRIBUTION_NAME = "pseudo_gradient"
AGGREGATE_NAME = "pseudo_gradient_sum"
#: Owner-side rounds kept for late fetches before they are pruned.
_KEEP_ROUNDS = 2
#: Fetches of a shard's sum after the first one failed (each bounded by ``request_timeout``).
_FETCH_RETRIES = 2
#: Element bound when reading the headers of this peer's own frames (the receivers' bound is ``numel``).
_NO_ELEMENT_LIMIT = 1 << 40


def shard_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges splitting ``numel`` entries into ``num_shards`` near-equal shards."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    base, extra = divmod(numel, num_shards)
    bounds, start = [], 0
    for j in range(num_shards):
        stop = start + base + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def payload_frame(
    numel: int, indices_K: torch.Tensor, values_K: torch.Tensor, *, round_index: int, value_dtype: str = "float32"
) -> FrameHeader:
    """The header (sizes of the whole frame and of its sections) of a peer's whole selection (sorted global
    ``indices_K`` into ``numel`` entries, FP32 ``values_K``) encoded as one contribution frame of the wire's codec
    and ``value_dtype``: what the paper's all-gather through an object store would upload. Encodes it: 3-10 ms
    of one core per 100k entries (0.06-0.16 s for 2M FP32 values).

    Raises :class:`ValueError` for unsorted or out-of-range indices or an unknown ``value_dtype``."""
    frame = encode_sparse(
        CONTRIBUTION_NAME, numel, indices_K, values_K, round_index=round_index, value_dtype=value_dtype
    )
    return peek_header(frame, max_elements=_NO_ELEMENT_LIMIT)


@dataclass
class Traffic:
    """Wire bytes of one round on one peer, counted by :meth:`SparseAverager._count`: whole protobuf messages
    (``ByteSize()``) and the frame bytes those messages carry.

    ``sent == sent_index + sent_value + sent_sum_index + sent_sum_value + sent_header`` exactly, message by
    message."""

    sent: int = 0
    """Every message sent: parts pushed, fetch requests, push replies and refusals, sums served."""
    received: int = 0
    """Every message received: parts pushed to this owner, push replies, sums fetched, refusals."""
    sent_index: int = 0
    """Bytes of the index sections of the contribution frames this peer pushed to other owners."""
    sent_value: int = 0
    """Bytes of the value sections of those frames."""
    sent_sum_index: int = 0
    """Bytes of the index sections of the shard sums this owner served to other members (the union of the
    group's indices in its shard), once per member served."""
    sent_sum_value: int = 0
    """Bytes of the value sections of those sums."""
    sent_header: int = 0
    """The rest of ``sent``: stream JSON headers, frame prefixes, JSON headers and checksums, protobuf tags and
    lengths, fetch requests, push replies and refusals."""
    num_pushed: int = 0
    """Entries of the contribution frames this peer sent to the end (its own shard's part stays local)."""
    num_sum_entries: int = 0
    """Entries of the shard sums this owner served to the end, once per member served."""


@dataclass(frozen=True)
class _FrameLayout:
    """Where a frame's index and value sections lie (byte offsets into the frame) and its number of entries."""

    index_start: int = 0
    value_start: int = 0
    value_stop: int = 0
    num_entries: int = 0

    @classmethod
    def of(cls, frame: bytes) -> _FrameLayout:
        """The layout of ``frame``; a frame that does not parse (never one this peer encoded) counts as all
        header and no entries."""
        try:
            header = peek_header(frame, max_elements=_NO_ELEMENT_LIMIT)
        except PayloadError:
            return cls()
        value_start = header.header_bytes + header.index_bytes
        return cls(header.header_bytes, value_start, value_start + header.value_bytes, header.num_changed)

    def split(self, start: int, stop: int) -> tuple[int, int]:
        """How many of the frame's bytes ``[start, stop)`` lie in its index section and in its value section."""
        index = max(0, min(stop, self.value_start) - max(start, self.index_start))
        value = max(0, min(stop, self.value_stop) - max(start, self.value_start))
        return index, value


def _peak(values_K: torch.Tensor) -> float:
    """The largest absolute entry (0 for none): the scale of a part that does not grow with its entry count."""
    return float(values_K.abs().max()) if values_K.numel() else 0.0


@dataclass(frozen=True)
class AllReduceResult:
    """What one round of averaging produced on this peer.

    ``indices_K`` / ``average_K``: the averaged pseudo-gradient (global flat indices, FP32 values); entries not
    listed are zero. ``accepted``: per shard (``bounds``), the contributors its sum counted, or ``None`` where
    the sum could not be fetched. ``returned_K``: one flag per entry this peer sent, True where its shard's list
    does not show it counted (the caller puts those back into its residual). ``complete`` is False if any
    shard's sum is missing, so this peer's theta may differ from the others' (the caller repairs and reconciles).

    Bytes (:class:`Traffic`, counted until this peer's exchange ended): ``bytes_sent`` / ``bytes_received`` every
    message; ``bytes_sent == sent_index_bytes + sent_value_bytes + sent_sum_index_bytes + sent_sum_value_bytes +
    sent_header_bytes``. ``payload_bytes``: this peer's whole selection as one frame (:func:`payload_frame`;
    ``payload_index_bytes`` / ``payload_value_bytes`` its sections).
    """

    group: Group
    indices_K: torch.Tensor
    average_K: torch.Tensor
    returned_K: torch.Tensor
    complete: bool
    live_peers: frozenset[str]
    num_rejected: int
    bytes_sent: int
    bytes_received: int
    accepted: tuple[tuple[str, ...] | None, ...] = ()
    bounds: tuple[tuple[int, int], ...] = ()
    payload_bytes: int = 0
    payload_index_bytes: int = 0
    payload_value_bytes: int = 0
    sent_index_bytes: int = 0
    sent_value_bytes: int = 0
    sent_sum_index_bytes: int = 0
    sent_sum_value_bytes: int = 0
    sent_header_bytes: int = 0
    num_pushed: int = 0
    num_sum_entries: int = 0

    @property
    def num_contributors(self) -> int:
        """Contributions actually aggregated: the peers counted in at least one shard this peer fetched."""
        return len({peer for shard in self.accepted if shard is not None for peer in shard})


@dataclass
class _OwnedShard:
    """Owner-side state of one shard in one round (created on the first push, fetch or local begin)."""

    round: int
    group_id: str
    expected: frozenset[str] | None = None
    numel: int | None = None
    contributions: dict[str, bytes] = field(default_factory=dict)
    closed: bool = False
    all_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    all_fetched: asyncio.Event = field(default_factory=asyncio.Event)
    fetched: set[str] = field(default_factory=set)
    awaiting: frozenset[str] | None = None
    header: dict[str, Any] | None = None
    payload: bytes = b""
    layout: _FrameLayout = field(default_factory=_FrameLayout)
    num_rejected: int = 0


def _refusal(reason: str) -> dict[str, Any]:
    """The header of the one message of a refused stream (:func:`pulseloco.p2p.read_stream` reads it): ``ok``
    False, the ``reason`` and no payload."""
    return {"ok": False, "reason": reason, "size": 0}


class SparseAverager(StateTransfer):
    """Sparse reduce-scatter / all-gather of one flat parameter space of ``numel`` entries over a hivemind DHT,
    and the state transfer of :class:`~pulseloco.loco.state.StateTransfer`.

    Runs its RPC handlers on a :class:`~pulseloco.p2p.P2PHost` (a private event loop in a background thread with
    a replica of the DHT's P2P). ``client_mode`` peers register no handlers: they neither own shards nor serve
    state. Construction raises :class:`SwarmError` if the P2P replica cannot be set up within
    ``max(30, request_timeout)`` seconds.
    """

    def __init__(
        self,
        dht: Any,
        *,
        run_id: str,
        numel: int,
        client_mode: bool,
        averaging_timeout: float,
        request_timeout: float,
        max_norm_ratio: float,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.dht = dht
        self.run_id = run_id
        self.numel = int(numel)
        self.client_mode = client_mode
        self.averaging_timeout = averaging_timeout
        self.request_timeout = request_timeout
        self.max_norm_ratio = max_norm_ratio
        self.chunk_bytes = chunk_bytes
        self.namespace = f"{run_id}_loco"
        self._owned: dict[tuple[int, str], _OwnedShard] = {}
        self._traffic: dict[int, Traffic] = {}
        # Encodes the whole selection (payload_bytes) while the exchange waits on the network.
        self._payload_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pulseloco-payload")
        self._aggregations: dict[tuple[int, str], asyncio.Task[None]] = {}
        self._current_round = 0
        self._snapshot: StateSnapshot | None = None
        self._snapshot_lock = threading.Lock()
        self.disputed: set[str] = set()
        """Owners whose average this peer refused as an outlier (:meth:`_screen_aggregate`); published with its
        state record, so that no peer repairs from them (:meth:`pulseloco.loco.optimizer.PulseLoCo._catch_up`)."""
        setup_timeout = max(30.0, request_timeout)
        self._host = P2PHost(dht, name="pulseloco-loco", timeout=setup_timeout)
        try:
            if not client_mode:
                self._host.serve(self, self.namespace, timeout=setup_timeout)
        except BaseException:
            self._host.close()
            raise
        self.p2p: P2P = self._host.p2p
        self.peer_id: str = self._host.peer_id.to_base58()

    def shutdown(self) -> None:
        """Remove the handlers, close the P2P replica and stop the background loop (the DHT itself is the
        caller's); never raises."""
        self._host.close(timeout=self.request_timeout)
        self._payload_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def max_payload_bytes(self) -> int:
        """Upper bound of one encoded part or sum: 12 bytes per entry (index and value, uncompressed) plus 1 MiB
        of framing; anything larger is refused while it streams in."""
        return 12 * self.numel + (1 << 20)

    def _prune(self, round_index: int) -> None:
        """Forget owner state and traffic counters of rounds older than ``_KEEP_ROUNDS`` (event-loop thread only:
        the handlers iterate these dictionaries there)."""
        for key in [k for k in self._owned if k[0] < round_index - _KEEP_ROUNDS]:
            del self._owned[key]
        for key in [k for k in self._aggregations if k[0] < round_index - _KEEP_ROUNDS]:
            del self._aggregations[key]
        for r in [r for r in self._traffic if r < round_index - _KEEP_ROUNDS]:
            del self._traffic[r]

    # -- owner side ---------------------------------------------------------------------------------------
    def _count(
        self,
        round_index: int,
        sent: int = 0,
        received: int = 0,
        *,
        index: int = 0,
        value: int = 0,
        is_sum: bool = False,
    ) -> None:
        """Add one message to the round's :class:`Traffic` (event-loop thread only): ``sent`` / ``received`` its
        serialized size, ``index`` / ``value`` the bytes of a contribution frame's (with ``is_sum``, a shard
        sum's) sections among the ``sent`` bytes; the rest of ``sent`` counts as header."""
        traffic = self._traffic.setdefault(round_index, Traffic())
        traffic.sent += sent
        traffic.received += received
        if is_sum:
            traffic.sent_sum_index += index
            traffic.sent_sum_value += value
        else:
            traffic.sent_index += index
            traffic.sent_value += value
        traffic.sent_header += sent - index - value

    def _counted(self, round_index: int, messages: Iterator[M], layout: _FrameLayout, *, is_sum: bool) -> Iterator[M]:
        """``messages`` (one :func:`~pulseloco.p2p.stream_messages` stream of a frame of ``layout``), each counted
        as sent and split into the frame's sections as it goes out; the frame's entries are counted once its last
        message went out."""
        offset = 0
        for i, message in enumerate(messages):
            index = value = 0
            if i:  # the first message is the stream's JSON header, the others carry the frame's bytes in order
                stop = offset + len(message.metadata)
                index, value = layout.split(offset, stop)
                offset = stop
            self._count(round_index, sent=message.ByteSize(), index=index, value=value, is_sum=is_sum)
            yield message
        traffic = self._traffic.setdefault(round_index, Traffic())
        if is_sum:
            traffic.num_sum_entries += layout.num_entries
        else:
            traffic.num_pushed += layout.num_entries

    def _reply(self, round_index: int, header: dict[str, Any]) -> runtime_pb2.ExpertResponse:
        """A one-message answer (push acknowledgement, refusal), counted as sent in ``round_index``."""
        message = header_message(runtime_pb2.ExpertResponse, header)
        self._count(round_index, sent=message.ByteSize())
        return message

    def _owned_shard(self, round_index: int, group_id: str) -> _OwnedShard | None:
        """The owner state for ``(round, group)``, created on demand for rounds near the current one."""
        key = (round_index, group_id)
        shard = self._owned.get(key)
        if shard is None:
            if not self._current_round - 1 <= round_index <= self._current_round + 2:
                return None
            if sum(1 for r, _ in self._owned if r == round_index) >= 4:
                return None  # bounded state per round: a flood of bogus group ids is refused
            shard = self._owned[key] = _OwnedShard(round_index, group_id)
        return shard

    def _add_contribution(self, shard: _OwnedShard, sender: str, payload: bytes) -> str | None:
        """Store a part; return a refusal reason or ``None``."""
        if shard.closed:
            return "late: the shard was already aggregated"
        if sender in shard.contributions:
            return "duplicate contribution"
        if shard.expected is not None and sender not in shard.expected:
            return "sender is not a member of this group"
        shard.contributions[sender] = payload
        if shard.expected is not None and shard.expected <= shard.contributions.keys():
            shard.all_arrived.set()
        return None

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """Receive one member's part of this owner's shard (header first, then chunks)."""
        sender = context.remote_id.to_base58()
        round_key = -1  # the round the stream's header names, once read (-1: none, not counted in any round)

        def count(header: dict[str, Any], message: runtime_pb2.ExpertRequest) -> None:
            nonlocal round_key
            round_key = header["round"] if isinstance(header.get("round"), int) else -1
            self._count(round_key, received=message.ByteSize())

        try:
            header, payload = await read_stream(
                requests, max_bytes=self.max_payload_bytes, timeout=self.request_timeout, on_message=count
            )
        except (TimeoutError, PayloadError) as exc:
            logger.warning("push refused sender=%s error=%r", sender, exc)
            return self._reply(round_key, {"ok": False, "reason": repr(exc)})
        if not isinstance(header.get("round"), int) or not isinstance(header.get("group"), str):
            return self._reply(round_key, {"ok": False, "reason": "missing round or group"})
        shard = self._owned_shard(header["round"], header["group"])
        reason = "round out of range" if shard is None else self._add_contribution(shard, sender, payload)
        if reason is not None:
            logger.info("push refused sender=%s round=%s reason=%s", sender, header["round"], reason)
        return self._reply(header["round"], {"ok": reason is None, "reason": reason})

    async def rpc_fetch(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream this owner's summed shard for ``(round, group)`` once it is aggregated."""
        requester = context.remote_id.to_base58()
        try:
            header = parse_header(request.metadata)
        except PayloadError as exc:
            self._count(-1, received=request.ByteSize())
            yield self._reply(-1, _refusal(str(exc)))
            return
        round_index, group_id = header.get("round"), header.get("group")
        round_key = round_index if isinstance(round_index, int) else -1
        self._count(round_key, received=request.ByteSize())
        shard = None
        if isinstance(round_index, int) and isinstance(group_id, str):
            shard = self._owned_shard(round_index, group_id)
        if shard is None:
            yield self._reply(round_key, _refusal("unknown round or group"))
            return
        try:
            await asyncio.wait_for(shard.done.wait(), timeout=self.averaging_timeout + self.request_timeout)
        except TimeoutError:
            yield self._reply(round_key, _refusal("aggregation did not finish"))
            return
        if shard.expected is None or requester not in shard.expected or shard.header is None:
            yield self._reply(round_key, _refusal("not a member of this group"))
            return
        messages = stream_messages(
            runtime_pb2.ExpertResponse, shard.header, [shard.payload], chunk_bytes=self.chunk_bytes
        )
        for message in self._counted(shard.round, messages, shard.layout, is_sum=True):
            yield message
        shard.fetched.add(requester)
        if shard.awaiting is not None and shard.awaiting <= shard.fetched:
            shard.all_fetched.set()

    async def _aggregate(self, shard: _OwnedShard, deadline: float) -> None:
        """Wait for the members' parts (until ``deadline``, loop time), validate and sum them."""
        try:
            await asyncio.wait_for(shard.all_arrived.wait(), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            missing = sorted((shard.expected or frozenset()) - shard.contributions.keys())
            logger.warning(
                "averaging timeout: aggregating without parts round=%d missing=%s (raise averaging_timeout if "
                "peers are slow rather than gone)",
                shard.round,
                missing,
            )
        shard.closed = True
        contributions = dict(shard.contributions)
        loop = asyncio.get_running_loop()
        header, payload, num_rejected = await loop.run_in_executor(
            None, self._sum_contributions, shard.round, shard.numel or 0, contributions
        )
        shard.layout = await loop.run_in_executor(None, _FrameLayout.of, payload)
        shard.header, shard.payload, shard.num_rejected = header, payload, num_rejected
        shard.done.set()

    def _sum_contributions(
        self, round_index: int, numel: int, contributions: dict[str, bytes]
    ) -> tuple[dict[str, Any], bytes, int]:
        """Validate and sum in sorted peer-id order (CPU work, run off the event loop)."""
        valid: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        rejected: dict[str, str] = {}
        for peer in sorted(contributions):
            try:
                valid[peer] = decode_sparse(contributions[peer], CONTRIBUTION_NAME, numel)
            except PayloadError as exc:
                rejected[peer] = f"{type(exc).__name__}: {exc}"
        if len(valid) >= 3:  # L2 norms against the leave-one-out median
            norms = {peer: float(torch.linalg.vector_norm(values_K)) for peer, (_, values_K) in valid.items()}
            reference = None
        else:  # no majority: largest entries against this owner's own (the part it can trust)
            norms = {peer: _peak(values_K) for peer, (_, values_K) in valid.items()}
            reference = norms.get(self.peer_id)
        for peer, reason in screen_outliers(norms, self.max_norm_ratio, reference=reference).items():
            rejected[peer] = f"OutlierPayloadError: {reason}"
            del valid[peer]
        for peer, reason in rejected.items():
            logger.warning("contribution rejected round=%d peer=%s reason=%s", round_index, peer, reason)
        sum_N = torch.zeros(numel, dtype=torch.float32)
        touched_N = torch.zeros(numel, dtype=torch.bool)
        for peer in sorted(valid):
            indices_K, values_K = valid[peer]
            sum_N[indices_K] += values_K
            touched_N[indices_K] = True
        indices_K = torch.nonzero(touched_N, as_tuple=False).reshape(-1)
        payload = encode_sparse(AGGREGATE_NAME, numel, indices_K, sum_N[indices_K], round_index=round_index)
        header = {"ok": True, "accepted": sorted(valid), "rejected": sorted(rejected), "size": len(payload)}
        return header, payload, len(rejected)

    # -- member side ----------------------------------------------------------------------------------------
    async def _push(self, owner: str, header: dict[str, Any], payload: bytes, deadline: float) -> bool:
        round_index = header["round"]
        layout = _FrameLayout.of(payload)

        async def _requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            messages = stream_messages(runtime_pb2.ExpertRequest, header, [payload], chunk_bytes=self.chunk_bytes)
            for message in self._counted(round_index, messages, layout, is_sum=False):
                yield message

        try:
            stub = self.get_stub(self.p2p, PeerID.from_base58(owner), namespace=self.namespace)
            response = await asyncio.wait_for(stub.rpc_push(_requests()), timeout=max(0.1, deadline - time.monotonic()))
            self._count(round_index, received=response.ByteSize())
            reply = parse_header(response.metadata)
        except Exception as exc:  # a vanished peer surfaces as daemon, handler or timeout errors
            logger.warning("push failed round=%d owner=%s error=%r", round_index, owner, exc)
            return False
        if not reply.get("ok"):
            logger.warning("push refused round=%d owner=%s reason=%s", round_index, owner, reply.get("reason"))
        return bool(reply.get("ok"))

    async def _fetch(self, owner: str, header: dict[str, Any], deadline: float) -> tuple[dict[str, Any], bytes] | None:
        round_index = header["round"]
        request = header_message(runtime_pb2.ExpertRequest, header)
        self._count(round_index, sent=request.ByteSize())

        def count(_header: dict[str, Any], message: runtime_pb2.ExpertResponse) -> None:
            self._count(round_index, received=message.ByteSize())

        try:
            stub = self.get_stub(self.p2p, PeerID.from_base58(owner), namespace=self.namespace)
            stream = await asyncio.wait_for(stub.rpc_fetch(request), timeout=self.request_timeout)
            # The owner answers only after aggregating, so the first message may take until the deadline; every
            # later message gets as long (a stalled owner resuming mid-stream is not cut off sooner).
            first_timeout = max(0.1, deadline - time.monotonic()) + self.request_timeout
            reply, payload = await read_stream(
                stream, max_bytes=self.max_payload_bytes, timeout=first_timeout, on_message=count
            )
            if not reply.get("ok"):
                raise SwarmError(f"owner refused: {reply.get('reason')}")
        except Exception as exc:  # refusal, cut or oversized stream, vanished owner, timeout: retried by _collect
            logger.warning("fetch failed round=%d owner=%s error=%r", round_index, owner, exc)
            return None
        return reply, payload

    async def _exchange(
        self, group: Group, parts: list[bytes], deadline: float
    ) -> tuple[list[tuple[dict[str, Any], bytes] | None], int, Traffic]:
        """Push ``parts`` (one per shard), aggregate the own shard, fetch every shard's sum (retrying failed
        fetches). Returns the sums (``None`` where none could be fetched), the own shard's rejections and a copy
        of this round's traffic so far."""
        self._prune(group.round)
        base = {"round": group.round, "group": group.group_id}
        own_index = group.servers.index(self.peer_id) if self.peer_id in group.servers else None
        owned: _OwnedShard | None = None
        if own_index is not None:
            owned = self._owned_shard(group.round, group.group_id)
            if owned is None:  # cannot happen: the current round is always in range
                raise SwarmError(f"cannot own a shard of round {group.round}")
            owned.expected = frozenset(group.members)
            start, stop = shard_bounds(self.numel, len(group.servers))[own_index]
            owned.numel = stop - start
            for sender in list(owned.contributions):
                if sender not in owned.expected:
                    logger.warning("dropping part from non-member round=%d peer=%s", group.round, sender)
                    del owned.contributions[sender]
            reason = self._add_contribution(owned, self.peer_id, parts[own_index])
            if reason is not None:
                logger.warning("own part refused round=%d reason=%s", group.round, reason)
            if owned.expected <= owned.contributions.keys():
                owned.all_arrived.set()
            # Its own task, not cancelled with this exchange: the other members fetch this sum even when this
            # peer's wait is cut short (a stalled process resumes past its deadline).
            self._aggregations[(group.round, group.group_id)] = asyncio.create_task(self._aggregate(owned, deadline))

        pushes = [
            self._push(owner, {**base, "shard": j}, parts[j], deadline)
            for j, owner in enumerate(group.servers)
            if j != own_index
        ]
        await asyncio.gather(*pushes)  # delivery is read from the sums' accepted lists, not from these replies
        results = await self._collect(group, [None] * len(group.servers), deadline)
        num_rejected = 0
        if owned is not None:
            num_rejected = owned.num_rejected
            # Keep serving until every member that contributed has fetched (bounded by the deadline), so that a
            # peer finishing first does not leave the others without its shard; later fetches are still served.
            owned.awaiting = frozenset(owned.contributions) | {self.peer_id}
            if owned.awaiting <= owned.fetched:
                owned.all_fetched.set()
            try:
                await asyncio.wait_for(owned.all_fetched.wait(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                logger.info(
                    "not every member fetched round=%d missing=%s",
                    group.round,
                    sorted(owned.awaiting - owned.fetched),
                )
        return results, num_rejected, await self._traffic_copy(group.round)

    async def _traffic_copy(self, round_index: int) -> Traffic:
        """A copy of the round's :class:`Traffic` (a coroutine: the counters are only touched on the loop)."""
        return replace(self._traffic.get(round_index, Traffic()))

    async def _collect(
        self, group: Group, results: list[tuple[dict[str, Any], bytes] | None], deadline: float
    ) -> list[tuple[dict[str, Any], bytes] | None]:
        """Fill in the missing sums of ``results``: the own shard from its aggregation, the others by fetching,
        once by ``deadline`` and up to ``_FETCH_RETRIES`` more times, each with a fresh ``request_timeout``."""
        base = {"round": group.round, "group": group.group_id}

        async def _one(j: int, owner: str) -> tuple[dict[str, Any], bytes] | None:
            if owner == self.peer_id:
                task = self._aggregations.get((group.round, group.group_id))
                owned = self._owned.get((group.round, group.group_id))
                if task is None or owned is None:
                    return None
                try:
                    await asyncio.wait_for(
                        asyncio.shield(task), timeout=max(self.request_timeout, deadline - time.monotonic())
                    )
                except TimeoutError:
                    logger.warning("own aggregation did not finish round=%d", group.round)
                    return None
                owned.fetched.add(self.peer_id)
                return (owned.header or {}), owned.payload
            result = await self._fetch(owner, {**base, "shard": j}, deadline)
            # Retries share one window of request_timeout after the deadline (or after now, for a peer that
            # resumes from a stall past it): a dead owner costs at most that, a late fetcher gets the kept sum.
            window_end = max(deadline, time.monotonic()) + self.request_timeout
            for attempt in range(_FETCH_RETRIES):
                remaining = window_end - time.monotonic()
                if result is not None or remaining <= 0:
                    break
                logger.info("retrying fetch round=%d owner=%s attempt=%d", group.round, owner, attempt + 2)
                try:
                    result = await asyncio.wait_for(
                        self._fetch(owner, {**base, "shard": j}, time.monotonic()), timeout=remaining
                    )
                except TimeoutError:
                    logger.warning("fetch retry timed out round=%d owner=%s", group.round, owner)
                if result is None:
                    await asyncio.sleep(min(0.5, max(0.0, window_end - time.monotonic())))
            return result

        missing = [j for j, result in enumerate(results) if result is None]
        fetched = await asyncio.gather(*(_one(j, group.servers[j]) for j in missing))
        filled = list(results)
        for j, result in zip(missing, fetched):
            filled[j] = result
        return filled

    def _screen_aggregate(self, owner: str, average_K: torch.Tensor, own_peak: float) -> None:
        """Refuse a shard's average whose largest entry exceeds ``max_norm_ratio`` times the largest entry of this
        peer's own part in it (no entry of an average of honest parts is larger than the largest of theirs):
        raises :class:`PayloadError` and adds ``owner`` to :attr:`disputed`. A poisoned owner, or a poisoned
        contribution an owner let through, is caught here; with no part of its own in the shard this peer has
        no bar and accepts."""
        peak = _peak(average_K)
        if own_peak > 0.0 and peak > self.max_norm_ratio * own_peak:
            self.disputed.add(owner)
            raise PayloadError(
                f"average's largest entry {peak:.3e} exceeds {self.max_norm_ratio:g}x this peer's own {own_peak:.3e}"
            )

    def _run_exchange(
        self, group: Group, parts: list[bytes]
    ) -> tuple[list[tuple[dict[str, Any], bytes] | None], int, Traffic]:
        """Push ``parts`` to their owners and fetch the shard sums (:meth:`_exchange`), waiting at most
        ``averaging_timeout`` plus twice ``request_timeout``; a wait cut short collects the sums once more (one
        ``request_timeout`` plus a second) and reads what the traffic counters hold. Never raises: a shard whose
        sum did not arrive is None in the results."""
        deadline = time.monotonic() + self.averaging_timeout
        results: list[tuple[dict[str, Any], bytes] | None] = [None] * len(parts)
        num_rejected, traffic = 0, Traffic()
        try:
            results, num_rejected, traffic = self._host.run(
                self._exchange(group, parts, deadline), timeout=self.averaging_timeout + 2 * self.request_timeout
            )
        except (SwarmError, TimeoutError) as exc:  # this wait's timeout, or one the exchange let through
            logger.warning("averaging cut short round=%d error=%s; collecting the sums again", group.round, exc)
            try:
                results = self._host.run(
                    self._collect(group, results, time.monotonic()), timeout=self.request_timeout + 1.0
                )
            except (SwarmError, TimeoutError) as again:
                logger.warning("collecting the sums failed round=%d error=%s", group.round, again)
            try:  # what was counted until now, read on the loop that counts
                traffic = self._host.run(self._traffic_copy(group.round), timeout=self.request_timeout)
            except (SwarmError, TimeoutError) as error:
                logger.warning("reading the traffic counters failed round=%d error=%s", group.round, error)
        return results, num_rejected, traffic

    def all_reduce(
        self, group: Group, indices_K: torch.Tensor, values_K: torch.Tensor, value_dtype: str = "float32"
    ) -> AllReduceResult:
        """Average this peer's sparse entries (sorted global ``indices_K``, FP32 ``values_K``) with ``group``; the
        parts travel in ``value_dtype`` (``"bfloat16"`` only for values exact in BF16: the pulse rule's option).

        Never raises because of another peer: entries of shards whose fetched accepted list does not show this
        peer (or whose sum could not be fetched) are flagged in ``returned_K``. Waits at most
        ``averaging_timeout`` plus twice ``request_timeout``, and one more ``request_timeout`` plus a second
        to collect the sums again when that wait was cut short (a stalled process resuming past its deadline).
        Encodes the whole selection once more for ``payload_bytes`` (:func:`payload_frame`) on another thread
        during the exchange when the group has more than one shard owner.
        """
        self._current_round = group.round
        bounds = shard_bounds(self.numel, len(group.servers))
        stops = torch.tensor([stop for _, stop in bounds], dtype=torch.int64)
        cut = torch.searchsorted(indices_K, stops).tolist()
        offsets = [0, *cut]
        parts = [
            encode_sparse(
                CONTRIBUTION_NAME,
                stop - start,
                indices_K[offsets[j] : offsets[j + 1]] - start,
                values_K[offsets[j] : offsets[j + 1]],
                round_index=group.round,
                value_dtype=value_dtype,
            )
            for j, (start, stop) in enumerate(bounds)
        ]
        # The whole selection as one frame (payload_bytes): the one part when there is one shard, else encoded on
        # another thread while the exchange waits on the network.
        whole_frame: Future[FrameHeader] | None = None
        if len(parts) > 1:
            whole_frame = self._payload_pool.submit(
                payload_frame, self.numel, indices_K, values_K, round_index=group.round, value_dtype=value_dtype
            )
        results, num_rejected, traffic = self._run_exchange(group, parts)
        whole = peek_header(parts[0], max_elements=_NO_ELEMENT_LIMIT) if whole_frame is None else whole_frame.result()
        returned_K = torch.zeros(indices_K.numel(), dtype=torch.bool)
        own_peaks = [_peak(values_K[offsets[j] : offsets[j + 1]]) for j in range(len(bounds))]
        all_indices, all_average = [], []
        accepted_lists: list[tuple[str, ...] | None] = []
        live_peers: set[str] = {self.peer_id}
        for j, (start, stop) in enumerate(bounds):
            result = results[j]
            accepted: tuple[str, ...] | None = None
            if result is not None:
                reply, payload = result
                names = reply.get("accepted")
                try:
                    if not isinstance(names, list) or not all(isinstance(p, str) for p in names):
                        raise PayloadError("aggregate header lacks its accepted contributors")
                    if not set(names) <= set(group.members):
                        raise PayloadError("aggregate counts peers outside the group")
                    sum_indices_K, sum_K = decode_sparse(payload, AGGREGATE_NAME, stop - start)
                    if not names and sum_K.numel():
                        raise PayloadError("aggregate has values but no accepted contributors")
                    if names:
                        self._screen_aggregate(group.servers[j], sum_K / float(len(names)), own_peaks[j])
                except PayloadError as exc:
                    logger.warning("aggregate rejected round=%d owner=%s error=%s", group.round, group.servers[j], exc)
                else:
                    accepted = tuple(sorted(names))
                    if accepted:  # every part refused: nothing counted in this shard
                        all_indices.append(sum_indices_K + start)
                        all_average.append(sum_K / float(len(accepted)))
                    live_peers.update(accepted)
                    live_peers.add(group.servers[j])
            accepted_lists.append(accepted)
            if accepted is None or self.peer_id not in accepted:
                returned_K[offsets[j] : offsets[j + 1]] = True
        return AllReduceResult(
            group=group,
            indices_K=torch.cat(all_indices) if all_indices else torch.zeros(0, dtype=torch.int64),
            average_K=torch.cat(all_average) if all_average else torch.zeros(0, dtype=torch.float32),
            returned_K=returned_K,
            complete=all(a is not None for a in accepted_lists),
            live_peers=frozenset(live_peers),
            num_rejected=num_rejected,
            bytes_sent=traffic.sent,
            bytes_received=traffic.received,
            accepted=tuple(accepted_lists),
            bounds=tuple(bounds),
            payload_bytes=whole.total_bytes,
            payload_index_bytes=whole.index_bytes,
            payload_value_bytes=whole.value_bytes,
            sent_index_bytes=traffic.sent_index,
            sent_value_bytes=traffic.sent_value,
            sent_sum_index_bytes=traffic.sent_sum_index,
            sent_sum_value_bytes=traffic.sent_sum_value,
            sent_header_bytes=traffic.sent_header,
            num_pushed=traffic.num_pushed,
            num_sum_entries=traffic.num_sum_entries,
        )
