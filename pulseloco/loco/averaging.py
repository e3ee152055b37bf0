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
   the owner's own part's in a group of two), clips each accepted part to the group's median norm and sums the
   clipped parts in sorted peer-id order into a sparse sum (:mod:`pulseloco.loco.robust`: the rule, what it
   bounds, and the exclusion of peers that keep sending outliers);
3. all-gather: every member fetches every shard's sum, with the list of accepted contributors, each one's clip
   scale and their count, and divides by that count. Every peer divides the same sums by the same counts, so
   every peer computes bit-identical averages. A member refuses an average far larger than its own part of the shard
   (a poisoned owner) and treats the shard as unknown (below); it names that owner as *disputed*.

A member's traffic grows with its own payload plus the (sparse) sums, not with the number of peers times the
model. Client-mode members push and fetch but own no shard and serve nothing.

The owner's side (receiving, validating and summing the parts, serving the sums) is
:mod:`pulseloco.loco.shard_owner`; the byte accounting (every message counted at its serialized size and split
into the frames' index and value sections and the rest) is :mod:`pulseloco.loco.traffic`.
:func:`payload_frame` gives the size of the peer's whole selection as one frame (what the paper's all-gather
through an object store uploads).

Exactly once (docs/design.md, "Exactly-once contributions"). What a round counted is decided by the owners
alone: shard ``j``'s sum contains exactly the contributions on its ``accepted`` list, each scaled by its clip
scale, fixed when the owner aggregates and sent with the sum. A member therefore derives delivery from the lists
it fetched, never from push acknowledgements: its part of shard ``j`` is *counted* if and only if it fetched
shard ``j`` and its id is on the list, and then counted at the scale listed beside it (what the scale clipped off,
:func:`pulseloco.loco.robust.clip_split`, goes back to its residual exactly as an uncounted part does). Every
member that fetched a shard applies the same sum and the same list, so an accepted contribution is in the theta
of every peer that fetched that shard, and the sender keeps (returns to its residual) exactly the parts it cannot
show were counted. A fetch that fails is retried after the deadline (the
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
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from pulseloco.codec import FrameHeader, peek_header
from pulseloco.errors import PayloadError, SwarmError
from pulseloco.loco.config import EXCHANGES, MEAN_OVER
from pulseloco.loco.matchmaking import Group
from pulseloco.loco.reduce import ReduceSpec, check_budget, combine_parts
from pulseloco.loco.robust import (
    DEFAULT_DISPUTE_NORM_RATIO,
    DEFAULT_DISPUTE_ROUNDS,
    RepeatOutliers,
    clip_scale,
    part_norm,
)
from pulseloco.loco.shard_owner import (
    AGGREGATE_NAME,
    CONTRIBUTION_NAME,
    DUPLICATE,
    OwnedShard,
    ShardOwner,
    accepted_names,
    peak,
    served_bar,
)
from pulseloco.loco.state import StateSnapshot, StateTransfer
from pulseloco.loco.traffic import NO_ELEMENT_LIMIT, FrameLayout, Traffic
from pulseloco.loco.validation import decode_sparse, encode_parts, encode_sparse
from pulseloco.p2p import (
    CHUNK_BYTES,
    P2PHost,
    header_message,
    parse_header,
    read_reply,
    read_stream,
    stream_messages,
)

logger = logging.getLogger(__name__)

__all__ = ["AllReduceResult", "SparseAverager", "delivery", "payload_frame", "shard_bounds"]

#: Owner-side rounds kept for late fetches before they are pruned.
_KEEP_ROUNDS = 2
#: Fetches of a shard's sum after the first one failed (each bounded by ``request_timeout``).
_FETCH_RETRIES = 2
#: Pushes of a part after the first one failed on the network (the owner still answering pings), before the
#: member gives up on that owner for the round and tells it so when pinged.
_PUSH_RETRIES = 2


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
    numel: int,
    indices_K: torch.Tensor,
    values_K: torch.Tensor,
    *,
    round_index: int,
    value_dtype: str = "float32",
    group_starts: torch.Tensor | None = None,
) -> FrameHeader:
    """The header (sizes of the whole frame and of its sections) of a peer's whole selection (sorted global
    ``indices_K`` into ``numel`` entries, FP32 ``values_K``) encoded as one contribution frame of the wire's codec
    and ``value_dtype``: what the paper's all-gather through an object store would upload. Encodes it: 3-10 ms
    of one core per 100k entries (0.06-0.16 s for 2M FP32 values).

    Raises :class:`ValueError` for unsorted or out-of-range indices or an unknown ``value_dtype``."""
    frame = encode_sparse(
        CONTRIBUTION_NAME,
        numel,
        indices_K,
        values_K,
        round_index=round_index,
        value_dtype=value_dtype,
        group_starts=group_starts,
    )
    return peek_header(frame, max_elements=NO_ELEMENT_LIMIT)


def delivery(
    peer_id: str,
    indices_K: torch.Tensor,
    offsets: list[int],
    bounds: list[tuple[int, int]],
    accepted: list[tuple[str, ...] | None],
    kept: list[torch.Tensor | None],
    *,
    topk_expected: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Which of ``peer_id``'s sent entries (sorted global ``indices_K``, cut at ``offsets`` into the shards
    ``bounds``) a round counted, from the shards' ``accepted`` lists (None: not fetched) and, for ``topk`` shards,
    the owners' ``kept`` local indices: returns ``returned_K`` (True where not counted: the caller adds the value
    back to its residual), ``dropped_K`` (True where a ``topk`` owner counted the part but did not keep the entry:
    returned for good) and the shards not fetched that ``topk_expected`` says were reduced (which entries were kept
    there is unknown)."""
    returned_K = torch.zeros(indices_K.numel(), dtype=torch.bool)
    dropped_K = torch.zeros(indices_K.numel(), dtype=torch.bool)
    kept_unknown: list[int] = []
    for j, names in enumerate(accepted):
        lo, hi = offsets[j], offsets[j + 1]
        if names is None or peer_id not in names:
            returned_K[lo:hi] = True
            if names is None and topk_expected and hi > lo:
                kept_unknown.append(j)
        elif (kept_j := kept[j]) is not None:  # counted where the owner kept the entry; the rest comes back
            dropped = ~torch.isin(indices_K[lo:hi] - bounds[j][0], kept_j)
            returned_K[lo:hi] = dropped
            dropped_K[lo:hi] = dropped
    return returned_K, dropped_K, kept_unknown


@dataclass(frozen=True)
class AllReduceResult:
    """What one round of averaging produced on this peer.

    ``indices_K`` / ``average_K``: the averaged pseudo-gradient (global flat indices, FP32 values); entries not
    listed are zero. ``accepted``: per shard (``bounds``), the contributors its sum counted, or ``None`` where
    the sum could not be fetched; ``bars``: beside each list, the clip bar its owner reported (``None``: nothing
    clipped; :mod:`pulseloco.loco.robust`); ``own_scales``: per shard, the scale this peer's part was counted at
    (derived from the bar and ``own_norms``, its part's :func:`~pulseloco.loco.robust.part_norm`), ``None`` where
    it was not counted. ``returned_K``: one flag per entry this peer sent, True where its shard's list does not
    show it counted (the caller puts those back into its residual; entries counted at a scale below 1 give back
    what the scale clipped off). ``complete`` is False if any
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
    bars: tuple[float | None, ...] = ()
    own_scales: tuple[float | None, ...] = ()
    own_norms: tuple[float, ...] = ()
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
    largest_norm_ratio: float = 0.0
    """The largest ratio of an accepted part's norm to the clip bar in this peer's own shard (0: none or no bar)."""
    dropped_K: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    """One flag per entry this peer sent (or none at all): True where a ``topk`` owner counted this peer's part
    but did not keep that entry (also flagged in ``returned_K``; returned for good, since no lineage counted it)."""
    kept_unknown: tuple[int, ...] = ()
    """Shards served with the ``topk`` exchange whose aggregate this peer could not fetch: it does not know which
    of its entries there were kept (:meth:`pulseloco.loco.ledger.Ledger.reconcile` cannot correct them)."""
    absorbed_indices_K: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    """Global indices of this owner's rounding error of its ``topk`` aggregate (``absorbed_K``): the caller adds it
    to its residual (:mod:`pulseloco.loco.reduce`)."""
    absorbed_K: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))
    absorbed_shard: int | None = None
    """The shard whose error this peer absorbed (its own), or None."""
    absorbed_counted: bool = True
    """Whether this peer applied its own shard's aggregate, so that the error goes into its residual now; when it
    did not (its own wait cut short) the error is kept aside in the ledger, for a repair to a theta that applied
    that shard (:meth:`pulseloco.loco.ledger.Ledger.reconcile`)."""
    kept: tuple[torch.Tensor | None, ...] = ()
    """Per shard served with the ``topk`` exchange and fetched, the global indices its owner kept (for the
    ledger, :class:`pulseloco.loco.ledger.LedgerEntry`); None elsewhere."""
    num_union: int = 0
    """With the ``topk`` exchange in this peer's own shard: the size of the parts' union there (the kept entries
    are ``num_sum_entries``)."""
    parts: tuple[bytes, ...] = ()
    """The contribution frames this peer pushed, one per shard (:func:`~pulseloco.loco.validation.encode_parts`):
    what the ledger keeps of its contribution (:class:`~pulseloco.loco.ledger.Pending`)."""

    @property
    def num_contributors(self) -> int:
        """Contributions actually aggregated: the peers counted in at least one shard this peer fetched."""
        return len({peer for shard in self.accepted if shard is not None for peer in shard})


class SparseAverager(ShardOwner, StateTransfer):
    """Sparse reduce-scatter / all-gather of one flat parameter space of ``numel`` entries over a hivemind DHT:
    the member side here, the owner side of :class:`~pulseloco.loco.shard_owner.ShardOwner` and the state transfer
    of :class:`~pulseloco.loco.state.StateTransfer`.

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
        clip_to_median: bool = True,
        dispute_norm_ratio: float = DEFAULT_DISPUTE_NORM_RATIO,
        dispute_rounds: int = DEFAULT_DISPUTE_ROUNDS,
        chunk_bytes: int = CHUNK_BYTES,
        exchange: str = "sums",
        mean_over: str = "peers",
        reduce_spec: ReduceSpec | None = None,
    ) -> None:
        if exchange not in EXCHANGES or mean_over not in MEAN_OVER:
            raise ValueError(f"exchange must be one of {EXCHANGES} and mean_over one of {MEAN_OVER}")
        if exchange == "topk" and reduce_spec is None:
            raise ValueError("the topk exchange needs a reduce_spec (the parameters' tiles and the budget)")
        self.dht = dht
        self.run_id = run_id
        self.numel = int(numel)
        self.client_mode = client_mode
        self.averaging_timeout = averaging_timeout
        self.request_timeout = request_timeout
        self.max_norm_ratio = max_norm_ratio
        self.clip_to_median = clip_to_median
        self.dispute_norm_ratio = dispute_norm_ratio
        self.repeat_outliers = RepeatOutliers(dispute_rounds)
        self.chunk_bytes = chunk_bytes
        self.exchange = exchange
        self.mean_over = mean_over
        self.reduce_spec = reduce_spec
        self.namespace = f"{run_id}_loco"
        self._owned: dict[tuple[int, str], OwnedShard] = {}
        self._traffic: dict[int, Traffic] = {}
        # Encodes the whole selection (payload_bytes) while the exchange waits on the network.
        self._payload_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pulseloco-payload")
        self._aggregations: dict[tuple[int, str], asyncio.Task[None]] = {}
        self._gave_up: set[tuple[int, str, str]] = set()
        self._finished: set[tuple[int, str]] = set()
        self._current_round = 0
        self._snapshot: StateSnapshot | None = None
        self._snapshot_lock = threading.Lock()
        self.disputed: set[str] = set()
        """Owners whose average this peer refused as an outlier (:meth:`_screen_aggregate`); published with its
        state record, with the peers its own shard excluded (:meth:`distrusted_peers`), so that no peer repairs from
        them (:meth:`pulseloco.loco.optimizer.PulseLoCo._catch_up`)."""
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

    def distrusted_peers(self) -> tuple[str, ...]:
        """The peers this peer names as disputed in its state record: owners whose average it refused
        (:attr:`disputed`) and contributors its shard excluded for repeated outliers (:mod:`pulseloco.loco.robust`),
        sorted."""
        return tuple(sorted(self.disputed | set(self.repeat_outliers.excluded())))

    def shutdown(self) -> None:
        """Remove the handlers, close the P2P replica and stop the background loop (the DHT itself is the
        caller's); never raises."""
        self._host.close(timeout=self.request_timeout)
        self._payload_pool.shutdown(wait=False, cancel_futures=True)

    def _prune(self, round_index: int) -> None:
        """Forget owner state and traffic counters of rounds older than ``_KEEP_ROUNDS`` (event-loop thread only:
        the handlers iterate these dictionaries there)."""
        for key in [k for k in self._owned if k[0] < round_index - _KEEP_ROUNDS]:
            del self._owned[key]
        for key in [k for k in self._aggregations if k[0] < round_index - _KEEP_ROUNDS]:
            del self._aggregations[key]
        for r in [r for r in self._traffic if r < round_index - _KEEP_ROUNDS]:
            del self._traffic[r]
        self._gave_up = {key for key in self._gave_up if key[0] >= round_index - _KEEP_ROUNDS}
        self._finished = {key for key in self._finished if key[0] >= round_index - _KEEP_ROUNDS}

    async def _probe(self, peer: str, about: dict[str, Any]) -> dict[str, Any] | None:
        """Ping ``peer`` (:meth:`~pulseloco.loco.shard_owner.ShardOwner.rpc_ping`) about ``about`` (a round and
        group, or nothing) and return its answer, ``None`` when it does not answer within ``request_timeout``
        (never raises: a refused connection, a dead daemon, a timeout or an unreadable answer is ``None``)."""
        try:
            stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
            started = time.monotonic()
            request = header_message(runtime_pb2.ExpertRequest, about)
            stream = await asyncio.wait_for(stub.rpc_ping(request), timeout=self.request_timeout)
            reply = await read_reply(stream, timeout=max(0.1, self.request_timeout - (time.monotonic() - started)))
            return parse_header(reply.metadata)
        except Exception as exc:
            logger.info("ping failed peer=%s error=%r", peer, exc)
            return None

    async def _connected(self) -> set[str] | None:
        """The peers the daemon holds a connection to (``P2P.list_peers``), ``None`` when the daemon does not
        answer within ``request_timeout`` (never raises)."""
        try:
            peers = await asyncio.wait_for(self.p2p.list_peers(), timeout=self.request_timeout)
        except Exception as exc:
            logger.info("listing connected peers failed error=%r", exc)
            return None
        return {info.peer_id.to_base58() for info in peers}

    # -- member side ----------------------------------------------------------------------------------------
    async def _push(self, owner: str, header: dict[str, Any], payload: bytes, deadline: float) -> bool:
        """Push one part to ``owner`` (:meth:`_push_once`); after a failure on the network (not a refusal), retry
        up to :data:`_PUSH_RETRIES` times while the deadline leaves time and the owner answers pings (a ping opens
        a connection the retry can use: a push can fail with libp2p's "routing: not found" while the owner's pings
        to this peer get through). A member that gives up records it, so that the owner, pinging this member while
        it waits for the part, stops waiting (:meth:`~pulseloco.loco.shard_owner.ShardOwner.rpc_ping`). Returns
        whether the owner took the part; never raises."""
        round_index, group_id = header["round"], header["group"]
        try:
            for attempt in range(_PUSH_RETRIES + 1):
                outcome = await self._push_once(owner, header, payload, deadline)
                if outcome is not None:
                    return outcome
                if attempt == _PUSH_RETRIES or deadline - time.monotonic() < self.request_timeout / 4:
                    break
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                if not await self._alive(owner):
                    break
                logger.info("retrying push round=%d owner=%s attempt=%d", round_index, owner, attempt + 2)
            logger.warning("gave up pushing round=%d owner=%s: the part stays in the residual", round_index, owner)
            self._gave_up.add((round_index, group_id, owner))
            return False
        except asyncio.CancelledError:
            self._gave_up.add((round_index, group_id, owner))
            raise

    async def _push_once(self, owner: str, header: dict[str, Any], payload: bytes, deadline: float) -> bool | None:
        """One push of a part: ``True`` when the owner took it (or already had it), ``False`` when it refused it,
        ``None`` when it failed on the way (a vanished owner, a cut stream, a timeout); never raises."""
        round_index = header["round"]
        layout = FrameLayout.of(payload)

        async def _requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            messages = stream_messages(runtime_pb2.ExpertRequest, header, [payload], chunk_bytes=self.chunk_bytes)
            for message in self._counted(round_index, messages, layout, is_sum=False):
                yield message

        try:
            stub = self.get_stub(self.p2p, PeerID.from_base58(owner), namespace=self.namespace)
            # the owner answers once the whole part arrived: one message, then this side closes the stream
            stream = await asyncio.wait_for(stub.rpc_push(_requests()), timeout=max(0.1, deadline - time.monotonic()))
            response = await read_reply(stream, timeout=max(0.1, deadline - time.monotonic()))
            self._count(round_index, received=response.ByteSize())
            reply = parse_header(response.metadata)
        except Exception as exc:  # a vanished peer surfaces as daemon, handler or timeout errors
            logger.warning("push failed round=%d owner=%s error=%r", round_index, owner, exc)
            return None
        if reply.get("reason") == DUPLICATE:  # a retry after a push whose answer was lost: the owner has the part
            return True
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
    ) -> tuple[list[tuple[dict[str, Any], bytes] | None], OwnedShard | None, Traffic]:
        """Push ``parts`` (one per shard), aggregate the own shard, fetch every shard's sum (retrying failed
        fetches). Returns the sums (``None`` where none could be fetched), the own shard's state (``None`` for a
        client) and a copy of this round's traffic so far."""
        self._prune(group.round)
        base = {"round": group.round, "group": group.group_id}
        own_index = group.servers.index(self.peer_id) if self.peer_id in group.servers else None
        owned: OwnedShard | None = None
        if own_index is not None:
            start, stop = shard_bounds(self.numel, len(group.servers))[own_index]
            owned = self._open_own_shard(group, start, stop - start, parts[own_index], deadline)
        pushes = [
            self._push(owner, {**base, "shard": j}, parts[j], deadline)
            for j, owner in enumerate(group.servers)
            if j != own_index
        ]
        try:
            await asyncio.gather(*pushes)  # delivery is read from the sums' accepted lists, not from these replies
            results = await self._collect(group, [None] * len(group.servers), deadline)
        finally:  # from here on this member fetches nothing more this round: an owner that pings it stops waiting
            self._finished.add((group.round, group.group_id))
        if owned is not None:
            await self._serve_until_fetched(owned, deadline)
        return results, owned, await self._traffic_copy(group.round)

    async def _collect(
        self, group: Group, results: list[tuple[dict[str, Any], bytes] | None], deadline: float
    ) -> list[tuple[dict[str, Any], bytes] | None]:
        """Fill in the missing sums of ``results``: the own shard from its aggregation, the others by fetching,
        once by ``deadline`` and up to ``_FETCH_RETRIES`` more times, each with a fresh ``request_timeout``."""
        base = {"round": group.round, "group": group.group_id}

        async def _one(j: int, owner: str) -> tuple[dict[str, Any], bytes] | None:
            if owner == self.peer_id:
                return await self._own_sum(group, deadline)
            result = await self._fetch(owner, {**base, "shard": j}, deadline)
            # Retries share one window of request_timeout after the deadline (or after now, for a peer that
            # resumes from a stall past it): a dead owner costs at most that, a late fetcher gets the kept sum.
            window_end = max(deadline, time.monotonic()) + self.request_timeout
            for attempt in range(_FETCH_RETRIES):
                remaining = window_end - time.monotonic()
                if result is not None or remaining <= 0:
                    break
                if not await self._alive(owner):  # a dead owner: no sum to wait for (the digest check repairs)
                    logger.warning("owner gone round=%d owner=%s: its shard is missing this round", group.round, owner)
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
        largest = peak(average_K)
        if own_peak > 0.0 and largest > self.max_norm_ratio * own_peak:
            self.disputed.add(owner)
            raise PayloadError(
                f"average's largest entry {largest:.3e} exceeds {self.max_norm_ratio:g}x this peer's own {own_peak:.3e}"
            )

    def _run_exchange(
        self, group: Group, parts: list[bytes]
    ) -> tuple[list[tuple[dict[str, Any], bytes] | None], OwnedShard | None, Traffic]:
        """Push ``parts`` to their owners and fetch the shard sums (:meth:`_exchange`), waiting at most
        ``averaging_timeout`` plus twice ``request_timeout``; a wait cut short collects the sums once more (one
        ``request_timeout`` plus a second) and reads what the traffic counters hold. Never raises: a shard whose
        sum did not arrive is None in the results."""
        deadline = time.monotonic() + self.averaging_timeout
        results: list[tuple[dict[str, Any], bytes] | None] = [None] * len(parts)
        owned: OwnedShard | None = None
        traffic = Traffic()
        try:
            results, owned, traffic = self._host.run(
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
        return results, owned, traffic

    def _average_shards(
        self,
        group: Group,
        bounds: list[tuple[int, int]],
        results: list[tuple[dict[str, Any], bytes] | None],
        own_peaks: list[float],
        own_parts: list[bytes],
        own_norms: list[float],
    ) -> tuple[
        list[torch.Tensor],
        list[torch.Tensor],
        list[tuple[str, ...] | None],
        list[float | None],
        list[float | None],
        set[str],
        list[torch.Tensor | None],
    ]:
        """Check and average every fetched shard of ``results`` (``bounds`` the shards, ``own_peaks`` the largest
        entry of this peer's part of each, ``own_parts`` its encoded parts, ``own_norms`` their
        :func:`~pulseloco.loco.robust.part_norm`; :meth:`_shard_average`): the accepted list must name members
        only, once each, the clip bar must be valid (:func:`~pulseloco.loco.shard_owner.served_bar`) and leave
        every counted part a scale above 0, a sum with values must name contributors, and the average must pass
        :meth:`_screen_aggregate`. Returns the averages' global indices and values (shards with contributors
        only), the accepted list per shard (sorted; None where the sum is missing or fails a check, logged as a
        warning: then nothing of that shard is applied), the clip bar beside each list, the scale this peer's part
        was counted at (None: not counted), the live peers (this one, the owners whose sums were accepted and
        their contributors), and per shard the kept local indices of a ``topk`` aggregate (None for the other
        exchanges and for shards not applied). Never raises."""
        all_indices, all_average = [], []
        kept_lists: list[torch.Tensor | None] = []
        accepted_lists: list[tuple[str, ...] | None] = []
        bar_lists: list[float | None] = []
        own_scale_list: list[float | None] = []
        live_peers: set[str] = {self.peer_id}
        for j, (start, stop) in enumerate(bounds):
            result = results[j]
            accepted: tuple[str, ...] | None = None
            bar: float | None = None
            own_scale: float | None = None
            kept: torch.Tensor | None = None
            if result is not None:
                reply, payload = result
                try:
                    names = accepted_names(reply, group.members)
                    if not isinstance(names, list) or not all(isinstance(p, str) for p in names):
                        raise PayloadError("aggregate header lacks its accepted contributors")
                    if not set(names) <= set(group.members):
                        raise PayloadError("aggregate counts peers outside the group")
                    if len(set(names)) != len(names):
                        raise PayloadError("aggregate counts a peer twice")
                    bar = served_bar(reply)
                    if self.peer_id in names:
                        own_scale = clip_scale(own_norms[j], bar)
                        if own_scale == 0.0:
                            raise PayloadError(f"aggregate counts this peer's part at a clip bar of {bar!r}: scale 0")
                    sum_indices_K, average_K = self._shard_average(
                        reply, payload, names, bar, own_parts[j], stop - start, start
                    )
                    if names:
                        self._screen_aggregate(group.servers[j], average_K, own_peaks[j])
                except PayloadError as exc:
                    logger.warning("aggregate rejected round=%d owner=%s error=%s", group.round, group.servers[j], exc)
                    bar = own_scale = None
                else:
                    accepted = tuple(sorted(names))
                    kept = sum_indices_K if reply.get("exchange") == "topk" else None
                    if accepted:  # every part refused: nothing counted in this shard
                        all_indices.append(sum_indices_K + start)
                        all_average.append(average_K)
                    live_peers.update(accepted)
                    live_peers.add(group.servers[j])
            accepted_lists.append(accepted)
            bar_lists.append(bar)
            own_scale_list.append(own_scale)
            kept_lists.append(kept)
        return all_indices, all_average, accepted_lists, bar_lists, own_scale_list, live_peers, kept_lists

    def _shard_average(
        self,
        reply: dict[str, Any],
        payload: bytes,
        names: list[str],
        bar: float | None,
        own_part: bytes,
        numel: int,
        start: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A fetched shard's average (local indices, FP32 values; ``numel`` entries from ``start``) by the owner's
        rules: a sum (``exchange`` ``sums``) divided by the peers it counted, or already the mean over senders; the
        kept budget of the aggregate (``topk``, the same division; more entries per tile than this peer's own
        budget allows is refused, :func:`~pulseloco.loco.reduce.check_budget`); or the accepted parts
        themselves (``gather``: this peer's own part is its own bytes, the others' come in ``payload``, their sizes
        in ``parts``), each clipped at the ``bar`` as the owner did (:func:`~pulseloco.loco.robust.clip_scale` of
        its :func:`~pulseloco.loco.robust.part_norm`) and combined as the owner would (:func:`combine_parts`).
        Raises :class:`PayloadError` for a reply that does not follow its rules, a part or sum that does not
        decode, or an accepted part the bar scales to 0."""
        exchange, mean_over = reply.get("exchange", "sums"), reply.get("mean_over", "peers")
        if exchange not in ("sums", "gather", "topk") or mean_over not in MEAN_OVER:
            raise PayloadError(f"aggregate names an unknown exchange {exchange!r} or mean {mean_over!r}")
        if exchange in ("sums", "topk"):
            indices_K, sum_K = decode_sparse(payload, AGGREGATE_NAME, numel)
            if not names and sum_K.numel():
                raise PayloadError("aggregate has values but no accepted contributors")
            if exchange == "topk" and self.reduce_spec is not None:
                budget = reply.get("budget", self.reduce_spec.factor)  # absent from a release before the field
                if budget != self.reduce_spec.factor:
                    raise PayloadError(
                        f"the shard's owner kept its aggregate at exchange_budget {budget!r}, this peer's is "
                        f"{self.reduce_spec.factor:g}: every peer of a run needs the same exchange_budget"
                    )
                check_budget(self.reduce_spec, indices_K, start, numel)
            return indices_K, (sum_K if mean_over == "senders" else sum_K / float(max(1, len(names))))
        sizes = reply.get("parts")
        if (
            not isinstance(sizes, list)
            or len(sizes) != len(names)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
            or sum(sizes) != len(payload)
        ):
            raise PayloadError("gathered shard's part sizes do not match its accepted list and payload")
        parts: list[tuple[tuple[torch.Tensor, torch.Tensor], float]] = []
        offset = 0
        for name, size in zip(names, sizes):
            frame = own_part if name == self.peer_id else payload[offset : offset + size]
            offset += size
            if not frame:
                raise PayloadError(f"gathered shard lacks the part of {name}")
            decoded = decode_sparse(frame, CONTRIBUTION_NAME, numel)
            scale = clip_scale(part_norm(decoded[1]), bar)
            if scale == 0.0:
                raise PayloadError(f"gathered shard counts the part of {name}, which its clip bar scales to 0")
            parts.append((decoded, scale))
        order = sorted(range(len(names)), key=names.__getitem__)
        indices_K, sum_K = combine_parts([parts[i] for i in order], numel, mean_over)
        return indices_K, (sum_K if mean_over == "senders" else sum_K / float(max(1, len(names))))

    def all_reduce(
        self,
        group: Group,
        indices_K: torch.Tensor,
        values_K: torch.Tensor,
        value_dtype: str = "float32",
        group_starts: torch.Tensor | None = None,
    ) -> AllReduceResult:
        """Average this peer's sparse entries (sorted global ``indices_K``, FP32 ``values_K``) with ``group``; the
        parts travel in ``value_dtype`` (``"bfloat16"`` only for values exact in BF16; ``"quantized"`` for values with
        few distinct numbers in each quantization group, the groups beginning at the global ``group_starts``).

        Never raises because of another peer: entries of shards whose fetched accepted list does not show this
        peer (or whose sum could not be fetched) are flagged in ``returned_K``. Waits at most
        ``averaging_timeout`` plus twice ``request_timeout``, and one more ``request_timeout`` plus a second
        to collect the sums again when that wait was cut short (a stalled process resuming past its deadline).
        Encodes the whole selection once more for ``payload_bytes`` (:func:`payload_frame`) on another thread
        during the exchange when the group has more than one shard owner.
        """
        self._current_round = group.round
        bounds = shard_bounds(self.numel, len(group.servers))
        exchange = self.exchange_for(len(group.members))
        stops = torch.tensor([stop for _, stop in bounds], dtype=torch.int64)
        offsets = [0, *torch.searchsorted(indices_K, stops).tolist()]
        parts = encode_parts(
            indices_K, values_K, bounds, round_index=group.round, value_dtype=value_dtype, group_starts=group_starts
        )
        # The whole selection as one frame (payload_bytes): the one part when there is one shard, else encoded on
        # another thread while the exchange waits on the network.
        whole_frame: Future[FrameHeader] | None = None
        if len(parts) > 1:
            whole_frame = self._payload_pool.submit(
                payload_frame,
                self.numel,
                indices_K,
                values_K,
                round_index=group.round,
                value_dtype=value_dtype,
                group_starts=group_starts,
            )
        results, owned, traffic = self._run_exchange(group, parts)
        whole = peek_header(parts[0], max_elements=NO_ELEMENT_LIMIT) if whole_frame is None else whole_frame.result()
        own_peaks = [peak(values_K[offsets[j] : offsets[j + 1]]) for j in range(len(bounds))]
        own_norms = [part_norm(values_K[offsets[j] : offsets[j + 1]]) for j in range(len(bounds))]
        all_indices, all_average, accepted_lists, bar_lists, own_scales, live_peers, kept_lists = self._average_shards(
            group, bounds, results, own_peaks, parts, own_norms
        )
        returned_K, dropped_K, kept_unknown = delivery(
            self.peer_id,
            indices_K,
            offsets,
            bounds,
            accepted_lists,
            kept_lists,
            topk_expected=exchange == "topk",
        )
        absorbed_indices_K = torch.zeros(0, dtype=torch.int64)
        absorbed_K = torch.zeros(0, dtype=torch.float32)
        absorbed_shard = None
        own_index = group.servers.index(self.peer_id) if self.peer_id in group.servers else None
        absorbed = owned.absorbed if owned is not None else None
        if own_index is not None and absorbed is None and exchange == "topk":
            # This peer's wait was cut short, or its own aggregation outlasted it: the others may still have
            # applied that aggregate, and then its rounding error is this owner's to keep all the same.
            try:
                absorbed = self._host.run(self._settled_absorbed(group), timeout=self.request_timeout + 1.0)
            except (SwarmError, TimeoutError) as exc:
                logger.warning("reading the own aggregation failed round=%d error=%s", group.round, exc)
        if own_index is not None and absorbed is not None:
            absorbed_indices_K = absorbed[0] + bounds[own_index][0]
            absorbed_K = absorbed[1]
            absorbed_shard = own_index
        return AllReduceResult(
            group=group,
            indices_K=torch.cat(all_indices) if all_indices else torch.zeros(0, dtype=torch.int64),
            average_K=torch.cat(all_average) if all_average else torch.zeros(0, dtype=torch.float32),
            returned_K=returned_K,
            complete=all(a is not None for a in accepted_lists),
            live_peers=frozenset(live_peers),
            num_rejected=owned.num_rejected if owned is not None else 0,
            bytes_sent=traffic.sent,
            bytes_received=traffic.received,
            accepted=tuple(accepted_lists),
            bars=tuple(bar_lists),
            own_scales=tuple(own_scales),
            own_norms=tuple(own_norms),
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
            largest_norm_ratio=owned.largest_norm_ratio if owned is not None else 0.0,
            dropped_K=dropped_K,
            kept_unknown=tuple(kept_unknown),
            kept=tuple(None if k is None else k + bounds[j][0] for j, k in enumerate(kept_lists)),
            absorbed_indices_K=absorbed_indices_K,
            absorbed_K=absorbed_K,
            absorbed_shard=absorbed_shard,
            absorbed_counted=own_index is not None and bool(accepted_lists[own_index]),
            parts=tuple(parts),
            num_union=int((owned.header or {}).get("union", 0)) if owned is not None else 0,
        )
