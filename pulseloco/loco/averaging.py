"""Sparse all-reduce of pseudo-gradients over hivemind: reduce-scatter of contiguous shards, then all-gather.

hivemind's ``DecentralizedAverager`` averages dense tensors of a fixed shape; PULSELoCo's contributions are
sparse and of a different size on every peer. :class:`SparseAverager` builds the sparse all-reduce from
hivemind's own parts: the DHT for matchmaking (:mod:`pulseloco.loco.matchmaking`), a ``ServicerBase`` with
``rpc_*`` handlers over libp2p streams, and hivemind's ``ExpertRequest`` / ``ExpertResponse`` protobufs as
envelopes (a JSON header in ``metadata``, payload bytes in ``tensors[0].buffer``, chunks of at most
``chunk_bytes``, below the daemon's 4 MiB message limit).

One round, for a group whose server-mode members ``S_0 < S_1 < ...`` (sorted peer ids) each own a contiguous
shard of the flat parameter space:

1. reduce-scatter: every member splits its selected entries by shard and pushes each part, encoded with the
   codec's FP32 mode, to the shard's owner (its own part stays local);
2. every owner waits for all members' parts (at most until the averaging deadline), decodes and validates
   them (frame, index range, finiteness, norm against the other contributions' median), and sums the
   accepted ones in sorted peer-id order into a sparse sum;
3. all-gather: every member fetches every shard's sum, with the list of accepted contributors and their
   count, and divides by that count. Every peer divides the same sums by the same counts, so every peer
   computes bit-identical averages.

A member's traffic grows with its own payload plus the (sparse) sums, not with the number of peers times the
model. Failure behaviour: every remote wait has a deadline (``averaging_timeout`` for the whole exchange,
``request_timeout`` per message); a shard whose owner is gone, or which refused this peer's part, is reported
as not delivered so that the caller returns those entries to its residual; the round never raises because of a
peer. Client-mode members push and fetch but own no shard and serve nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

# hivemind's ServicerBase recognises streaming handlers by typing.AsyncIterator hints (their ``_name``); the
# collections.abc alias is not recognised and would silently register a unary handler.
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout

from pulseloco.errors import PayloadError, StateDownloadError, SwarmError
from pulseloco.loco.matchmaking import Group, PeerState
from pulseloco.loco.runtime import BackgroundLoop
from pulseloco.loco.validation import decode_sparse, encode_sparse, screen_outliers, theta_digest

logger = logging.getLogger(__name__)

__all__ = ["AllReduceResult", "SparseAverager", "StateSnapshot", "shard_bounds"]

CONTRIBUTION_NAME = "pseudo_gradient"
AGGREGATE_NAME = "pseudo_gradient_sum"
#: Largest payload chunk per protobuf message (hivemind's daemon refuses messages above 4 MiB).
DEFAULT_CHUNK_BYTES = 1 << 20
#: Owner-side rounds kept for late fetches before they are pruned.
_KEEP_ROUNDS = 2


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


@dataclass(frozen=True)
class StateSnapshot:
    """The global state a server-mode peer serves to peers that are behind or disagree."""

    round: int
    digest: str
    theta_N: torch.Tensor
    momentum_N: torch.Tensor | None


@dataclass(frozen=True)
class AllReduceResult:
    """What one round of averaging produced on this peer.

    ``indices_K`` / ``average_K``: the averaged pseudo-gradient (global flat indices, FP32 values); entries not
    listed are zero. ``returned_K``: one flag per entry this peer sent, True where it was not delivered or not
    accepted (the caller puts those back into its residual). ``complete`` is False if any shard's average is
    missing, so this peer's theta may differ from the others' (the digest check repairs that).
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
    header: dict[str, Any] | None = None
    payload: bytes = b""
    num_rejected: int = 0


def _chunks(data: bytes, chunk_bytes: int) -> Iterable[bytes]:
    for start in range(0, len(data), chunk_bytes):
        yield data[start : start + chunk_bytes]


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"message header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise PayloadError("message header must be a JSON object")
    return header


def _response(header: dict[str, Any], data: bytes = b"") -> runtime_pb2.ExpertResponse:
    tensors = [runtime_pb2.Tensor(buffer=data, dtype="uint8")] if data else []
    return runtime_pb2.ExpertResponse(metadata=json.dumps(header).encode(), tensors=tensors)


class SparseAverager(ServicerBase):
    """Sparse reduce-scatter / all-gather of one flat parameter space of ``numel`` entries over a hivemind DHT.

    Runs its RPC handlers on a private event loop in a background thread, on a replica of the DHT's P2P.
    ``client_mode`` peers register no handlers: they neither own shards nor serve state. Construction raises
    :class:`SwarmError` if the P2P replica cannot be set up within ``request_timeout`` seconds.
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
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
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
        self._traffic: dict[int, list[int]] = {}
        self._current_round = 0
        self._snapshot: StateSnapshot | None = None
        self._runner = BackgroundLoop()
        try:
            self.p2p: P2P = self._runner.run(self._setup(), timeout=max(30.0, request_timeout))
        except BaseException:
            self._runner.shutdown()
            raise
        self.peer_id: str = self.p2p.peer_id.to_base58()

    async def _setup(self) -> P2P:
        p2p = await self.dht.replicate_p2p()
        if not self.client_mode:
            await self.add_p2p_handlers(p2p, namespace=self.namespace)
        return p2p

    def shutdown(self) -> None:
        """Remove the handlers and stop the background loop (the DHT itself is the caller's)."""

        async def _teardown() -> None:
            if not self.client_mode:
                await self.remove_p2p_handlers(self.p2p, namespace=self.namespace)

        try:
            self._runner.run(_teardown(), timeout=self.request_timeout)
        except Exception as exc:  # the daemon may already be gone with the DHT
            logger.debug("handler removal failed error=%r", exc)
        self._runner.shutdown()

    # -- owner side ---------------------------------------------------------------------------------------
    def _count(self, round_index: int, sent: int = 0, received: int = 0) -> None:
        counters = self._traffic.setdefault(round_index, [0, 0])
        counters[0] += sent
        counters[1] += received

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
        parts: list[bytes] = []
        header: dict[str, Any] | None = None
        size = 0
        limit = 12 * self.numel + (1 << 20)
        try:
            async for message in aiter_with_timeout(requests, self.request_timeout):
                if header is None:
                    header = _parse_header(message.metadata)
                for tensor in message.tensors:
                    size += len(tensor.buffer)
                    if size > limit:
                        raise PayloadError(f"contribution exceeds {limit} bytes")
                    parts.append(tensor.buffer)
                round_key = header.get("round")
                self._count(round_key if isinstance(round_key, int) else -1, received=message.ByteSize())
        except (asyncio.TimeoutError, PayloadError) as exc:
            logger.warning("push refused sender=%s error=%r", sender, exc)
            return _response({"ok": False, "reason": repr(exc)})
        if header is None or not isinstance(header.get("round"), int) or not isinstance(header.get("group"), str):
            return _response({"ok": False, "reason": "missing round or group"})
        shard = self._owned_shard(header["round"], header["group"])
        reason = "round out of range" if shard is None else self._add_contribution(shard, sender, b"".join(parts))
        if reason is not None:
            logger.info("push refused sender=%s round=%s reason=%s", sender, header["round"], reason)
        return _response({"ok": reason is None, "reason": reason})

    async def rpc_fetch(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream this owner's summed shard for ``(round, group)`` once it is aggregated."""
        requester = context.remote_id.to_base58()
        try:
            header = _parse_header(request.metadata)
        except PayloadError as exc:
            yield _response({"ok": False, "reason": str(exc)})
            return
        round_index, group_id = header.get("round"), header.get("group")
        shard = None
        if isinstance(round_index, int) and isinstance(group_id, str):
            shard = self._owned_shard(round_index, group_id)
        if shard is None:
            yield _response({"ok": False, "reason": "unknown round or group"})
            return
        try:
            await asyncio.wait_for(shard.done.wait(), timeout=self.averaging_timeout + self.request_timeout)
        except asyncio.TimeoutError:
            yield _response({"ok": False, "reason": "aggregation did not finish"})
            return
        if shard.expected is None or requester not in shard.expected or shard.header is None:
            yield _response({"ok": False, "reason": "not a member of this group"})
            return
        first = _response(shard.header)
        self._count(shard.round, sent=first.ByteSize())
        yield first
        for chunk in _chunks(shard.payload, self.chunk_bytes):
            message = _response({}, chunk)
            self._count(shard.round, sent=message.ByteSize())
            yield message
        shard.fetched.add(requester)
        if shard.expected <= shard.fetched:
            shard.all_fetched.set()

    async def _aggregate(self, shard: _OwnedShard, deadline: float) -> None:
        """Wait for the members' parts (until ``deadline``, loop time), validate and sum them."""
        try:
            await asyncio.wait_for(shard.all_arrived.wait(), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
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
        norms = {peer: float(torch.linalg.vector_norm(values_K)) for peer, (_, values_K) in valid.items()}
        for peer, reason in screen_outliers(norms, self.max_norm_ratio).items():
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

        async def _requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            first = runtime_pb2.ExpertRequest(uid="push", metadata=json.dumps(header).encode())
            self._count(round_index, sent=first.ByteSize())
            yield first
            for chunk in _chunks(payload, self.chunk_bytes):
                message = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=chunk, dtype="uint8")])
                self._count(round_index, sent=message.ByteSize())
                yield message

        try:
            stub = self.get_stub(self.p2p, PeerID.from_base58(owner), namespace=self.namespace)
            response = await asyncio.wait_for(stub.rpc_push(_requests()), timeout=max(0.1, deadline - time.monotonic()))
            self._count(round_index, received=response.ByteSize())
            reply = _parse_header(response.metadata)
        except Exception as exc:  # a vanished peer surfaces as daemon, handler or timeout errors
            logger.warning("push failed round=%d owner=%s error=%r", round_index, owner, exc)
            return False
        if not reply.get("ok"):
            logger.warning("push refused round=%d owner=%s reason=%s", round_index, owner, reply.get("reason"))
        return bool(reply.get("ok"))

    async def _fetch(self, owner: str, header: dict[str, Any], deadline: float) -> tuple[dict[str, Any], bytes] | None:
        round_index = header["round"]
        request = runtime_pb2.ExpertRequest(uid="fetch", metadata=json.dumps(header).encode())
        self._count(round_index, sent=request.ByteSize())
        try:
            stub = self.get_stub(self.p2p, PeerID.from_base58(owner), namespace=self.namespace)
            stream = await asyncio.wait_for(stub.rpc_fetch(request), timeout=self.request_timeout)
            reply: dict[str, Any] | None = None
            parts: list[bytes] = []
            size = 0
            # The owner answers only after aggregating, so the first message may take until the deadline.
            first_timeout = max(0.1, deadline - time.monotonic()) + self.request_timeout
            async for message in aiter_with_timeout(stream, first_timeout):
                self._count(round_index, received=message.ByteSize())
                if reply is None:
                    reply = _parse_header(message.metadata)
                    if not reply.get("ok"):
                        raise SwarmError(f"owner refused: {reply.get('reason')}")
                for tensor in message.tensors:
                    size += len(tensor.buffer)
                    if size > 12 * self.numel + (1 << 20):
                        raise PayloadError("aggregate exceeds its size bound")
                    parts.append(tensor.buffer)
        except Exception as exc:
            logger.warning("fetch failed round=%d owner=%s error=%r", round_index, owner, exc)
            return None
        if reply is None:
            return None
        if reply.get("size") != size:
            logger.warning(
                "fetch cut short round=%d owner=%s received=%d declared=%s", round_index, owner, size, reply.get("size")
            )
            return None
        return reply, b"".join(parts)

    async def _exchange(
        self, group: Group, parts: list[bytes], deadline: float
    ) -> tuple[list[bool], list[tuple[dict[str, Any], bytes] | None], int]:
        """Push ``parts`` (one per shard), aggregate the own shard, fetch every shard's sum."""
        base = {"round": group.round, "group": group.group_id}
        own_index = group.servers.index(self.peer_id) if self.peer_id in group.servers else None
        owned: _OwnedShard | None = None
        aggregate_task = None
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
            aggregate_task = asyncio.create_task(self._aggregate(owned, deadline))

        pushes = [
            self._push(owner, {**base, "shard": j}, parts[j], deadline)
            for j, owner in enumerate(group.servers)
            if j != own_index
        ]
        pushed = await asyncio.gather(*pushes)
        delivered = list(pushed)
        if own_index is not None:
            delivered.insert(own_index, True)

        async def _own_result() -> tuple[dict[str, Any], bytes] | None:
            assert aggregate_task is not None and owned is not None  # noqa: S101 - set above when own_index
            await aggregate_task
            owned.fetched.add(self.peer_id)
            return (owned.header or {}), owned.payload

        fetches = [
            _own_result() if j == own_index else self._fetch(owner, {**base, "shard": j}, deadline)
            for j, owner in enumerate(group.servers)
        ]
        results = list(await asyncio.gather(*fetches))
        num_rejected = 0
        if owned is not None:
            num_rejected = owned.num_rejected
            # Keep serving until every member that contributed has fetched (bounded by the deadline), so that a
            # peer finishing first does not leave the others without its shard.
            live = frozenset(owned.contributions) | {self.peer_id}
            if not live <= owned.fetched:
                try:
                    await asyncio.wait_for(
                        self._wait_fetched(owned, live), timeout=max(0.0, deadline - time.monotonic())
                    )
                except asyncio.TimeoutError:
                    logger.info(
                        "not every member fetched round=%d missing=%s", group.round, sorted(live - owned.fetched)
                    )
        return delivered, results, num_rejected

    @staticmethod
    async def _wait_fetched(owned: _OwnedShard, live: frozenset[str]) -> None:
        while not live <= owned.fetched:
            await asyncio.sleep(0.01)

    def all_reduce(self, group: Group, indices_K: torch.Tensor, values_K: torch.Tensor) -> AllReduceResult:
        """Average this peer's sparse entries (sorted global ``indices_K``, FP32 ``values_K``) with ``group``.

        Never raises because of another peer: undelivered or refused entries are flagged in ``returned_K``.
        Waits at most ``averaging_timeout`` plus twice ``request_timeout``.
        """
        self._current_round = group.round
        for key in [k for k in self._owned if k[0] < group.round - _KEEP_ROUNDS]:
            del self._owned[key]
        for r in [r for r in self._traffic if r < group.round - _KEEP_ROUNDS]:
            del self._traffic[r]
        bounds = shard_bounds(self.numel, len(group.servers))
        stops = torch.tensor([stop for _, stop in bounds], dtype=torch.int64)
        cut = torch.searchsorted(indices_K, stops).tolist()
        parts, offsets = [], [0, *cut]
        for j, (start, stop) in enumerate(bounds):
            local_K = indices_K[offsets[j] : offsets[j + 1]] - start
            parts.append(
                encode_sparse(
                    CONTRIBUTION_NAME,
                    stop - start,
                    local_K,
                    values_K[offsets[j] : offsets[j + 1]],
                    round_index=group.round,
                )
            )
        deadline = time.monotonic() + self.averaging_timeout
        try:
            delivered, results, num_rejected = self._runner.run(
                self._exchange(group, parts, deadline), timeout=self.averaging_timeout + 2 * self.request_timeout
            )
        except SwarmError as exc:
            logger.warning("averaging failed round=%d error=%s", group.round, exc)
            delivered, results, num_rejected = [False] * len(bounds), [None] * len(bounds), 0
        returned_K = torch.zeros(indices_K.numel(), dtype=torch.bool)
        all_indices, all_average = [], []
        live_peers: set[str] = {self.peer_id}
        complete = True
        for j, (start, stop) in enumerate(bounds):
            ok = delivered[j]
            result = results[j]
            if result is not None:
                reply, payload = result
                accepted = reply.get("accepted")
                try:
                    if not isinstance(accepted, list) or not accepted or not all(isinstance(p, str) for p in accepted):
                        raise PayloadError("aggregate header lacks its accepted contributors")
                    sum_indices_K, sum_K = decode_sparse(payload, AGGREGATE_NAME, stop - start)
                except PayloadError as exc:
                    logger.warning("aggregate rejected round=%d owner=%s error=%s", group.round, group.servers[j], exc)
                    result = None
                else:
                    all_indices.append(sum_indices_K + start)
                    all_average.append(sum_K / float(len(accepted)))
                    live_peers.update(p for p in accepted if p in group.members)
                    live_peers.add(group.servers[j])
                    ok = ok and self.peer_id in accepted
            if result is None:
                complete = False
                ok = False
            if not ok:
                returned_K[offsets[j] : offsets[j + 1]] = True
        traffic = self._traffic.get(group.round, [0, 0])
        return AllReduceResult(
            group=group,
            indices_K=torch.cat(all_indices) if all_indices else torch.zeros(0, dtype=torch.int64),
            average_K=torch.cat(all_average) if all_average else torch.zeros(0, dtype=torch.float32),
            returned_K=returned_K,
            complete=complete,
            live_peers=frozenset(live_peers),
            num_rejected=num_rejected,
            bytes_sent=traffic[0],
            bytes_received=traffic[1],
        )

    # -- state transfer ---------------------------------------------------------------------------------------
    def set_snapshot(self, snapshot: StateSnapshot) -> None:
        """Serve ``snapshot`` (tensors are not copied: pass tensors that will not be modified)."""
        self._snapshot = snapshot

    async def rpc_download_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream the latest snapshot: header, then theta's bytes, then the momentum's bytes."""
        snapshot = self._snapshot
        if snapshot is None:
            yield _response({"ok": False, "reason": "no state yet"})
            return
        has_momentum = snapshot.momentum_N is not None
        yield _response(
            {
                "ok": True,
                "round": snapshot.round,
                "digest": snapshot.digest,
                "numel": self.numel,
                "momentum": has_momentum,
            }
        )
        tensors = [snapshot.theta_N] + ([snapshot.momentum_N] if snapshot.momentum_N is not None else [])
        for tensor in tensors:
            data = tensor.detach().cpu().contiguous().numpy().tobytes()
            for chunk in _chunks(data, self.chunk_bytes):
                yield _response({}, chunk)

    async def _download(self, peer: str) -> tuple[dict[str, Any], bytes]:
        stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        stream = await asyncio.wait_for(
            stub.rpc_download_state(runtime_pb2.ExpertRequest(uid="state")), self.request_timeout
        )
        header: dict[str, Any] | None = None
        parts, size = [], 0
        async for message in aiter_with_timeout(stream, self.request_timeout):
            if header is None:
                header = _parse_header(message.metadata)
                if not header.get("ok"):
                    raise SwarmError(f"peer refused: {header.get('reason')}")
            for tensor in message.tensors:
                size += len(tensor.buffer)
                if size > 8 * self.numel:
                    raise PayloadError("state exceeds twice the parameter size")
                parts.append(tensor.buffer)
        if header is None:
            raise SwarmError("empty state stream")
        return header, b"".join(parts)

    def download_state(self, states: list[PeerState], accept: dict[int, str], *, num_retries: int = 3) -> StateSnapshot:
        """Download the global state from a server-mode peer whose record is in ``accept`` (round -> digest).

        The received state must have ``numel`` finite FP32 entries and a digest equal to both its header's and
        the accepted digest of its round. Tries up to ``num_retries`` peers (newest rounds first, random among
        equals); raises :class:`StateDownloadError` if none served a valid state. Never modifies local state.
        """
        candidates = [
            s for s in states if s.peer_id != self.peer_id and not s.client_mode and accept.get(s.round) == s.digest
        ]
        random.shuffle(candidates)
        candidates.sort(key=lambda s: -s.round)
        errors = []
        for state in candidates[:num_retries]:
            try:
                header, data = self._runner.run(
                    self._download(state.peer_id), timeout=self.averaging_timeout + self.request_timeout
                )
                round_index, digest = header.get("round"), header.get("digest")
                if not isinstance(round_index, int) or accept.get(round_index) != digest:
                    raise PayloadError(f"served round {round_index} digest {digest} is not an accepted state")
                has_momentum = bool(header.get("momentum"))
                expected = 4 * self.numel * (2 if has_momentum else 1)
                if len(data) != expected:
                    raise PayloadError(f"state is {len(data)} bytes, expected {expected}")
                flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
                theta_N = flat[: self.numel].clone()
                momentum_N = flat[self.numel :].clone() if has_momentum else None
                if not bool(torch.isfinite(flat).all()):
                    raise PayloadError("state carries non-finite values")
                if theta_digest(theta_N) != digest:
                    raise PayloadError("state does not match its digest")
                logger.info("state downloaded peer=%s round=%d digest=%s", state.peer_id, round_index, digest)
                return StateSnapshot(round=round_index, digest=digest, theta_N=theta_N, momentum_N=momentum_N)
            except Exception as exc:  # any failure of one peer (timeout, daemon, bad bytes) moves on to the next
                logger.warning("state download failed peer=%s error=%r", state.peer_id, exc)
                errors.append(f"{state.peer_id}: {exc!r}")
        raise StateDownloadError(
            f"no peer served a valid state after {len(errors)} attempt(s) ({'; '.join(errors) or 'no candidates'}); "
            "check that server-mode peers are reachable or raise request_timeout"
        )
