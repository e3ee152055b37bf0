"""The shard owner's side of the sparse all-reduce (:mod:`pulseloco.loco.averaging`): receiving, checking and summing
the members' parts of the owner's shard, and serving the sum.

:class:`ShardOwner` is a base of :class:`~pulseloco.loco.averaging.SparseAverager` (never used on its own). A
server-mode member owns one contiguous shard of the flat parameter space per round. It receives the other members' parts
over ``rpc_push`` (and takes its own locally, :meth:`ShardOwner._open_own_shard`), waits for all of them until the
round's deadline, decodes and validates them (frame, index range, finiteness, norm against the other contributions'
median, or largest entry against the owner's own part's in a group of two), clips each part to the group's median norm
and sums the clipped parts in sorted peer-id order (:meth:`ShardOwner._aggregate`; the rule, what it bounds and the
exclusion of peers that keep sending outliers: :mod:`pulseloco.loco.robust`). ``rpc_fetch`` streams that sum, with the
sorted list of accepted contributors and the clip bar (from which each contributor derives its own scale), to every
member of the group; the list and the scales decide delivery (docs/design.md, "Exactly-once contributions"). Owner state
is created only for rounds near the current one and for at most four groups per round.

Failure behaviour: a handler never raises because of a peer; a refused push is answered ``ok`` False with a
reason, a refused fetch with one refusal message (:func:`pulseloco.p2p.read_stream` reads it); a part that fails
validation, or comes from an excluded peer, is left out of the sum and counted as rejected (logged with its
reason).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

# hivemind's ServicerBase recognises streaming handlers by typing.AsyncIterator hints (their ``_name``); the
# collections.abc alias is not recognised and would silently register a unary handler.
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from pulseloco.errors import PayloadError, SwarmError
from pulseloco.loco.matchmaking import Group
from pulseloco.loco.reduce import ReduceSpec, combine_parts, reduce_parts
from pulseloco.loco.robust import RepeatOutliers, clip_bar, clip_scales, parse_bar, part_norm
from pulseloco.loco.traffic import FrameLayout, TrafficCounter
from pulseloco.loco.validation import AGGREGATE_NAME, CONTRIBUTION_NAME, decode_sparse, encode_sparse, screen_outliers
from pulseloco.p2p import asker_closes, header_message, parse_header, read_stream, stream_messages

logger = logging.getLogger(__name__)

__all__ = [
    "AGGREGATE_NAME",
    "CONTRIBUTION_NAME",
    "OwnedShard",
    "ShardOwner",
    "accepted_names",
    "compact_header",
    "peak",
    "served_bar",
]


def compact_header(header: dict[str, Any], members: list[str]) -> dict[str, Any]:
    """The header of a served shard as it goes on the wire. Every member is sent every owner's header, so nothing in
    it may grow much with the group (a list of peer ids would cost each peer ``O(R^2)`` bytes a round, some 70
    bytes per member per owner): the accepted contributors go as a hex bitmask over the group's sorted ``members``
    (``accepted_mask``), without the rejected ones (the owner logs them). The clip needs no per-contributor field:
    the header's one ``clip_bar`` lets each member derive its own scale (:mod:`pulseloco.loco.robust`). Members
    read it back with :func:`accepted_names` and :func:`served_bar`."""
    if "accepted" not in header:
        return header
    names = set(header["accepted"])
    mask = sum(1 << i for i, member in enumerate(members) if member in names)
    wire = {key: value for key, value in header.items() if key not in ("accepted", "rejected")}
    wire["accepted_mask"] = format(mask, "x")
    return wire


def _hex_mask(value: Any, width: int, what: str) -> int:
    """The bits of a hex ``value`` over ``width`` positions. Raises :class:`PayloadError` for anything else."""
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= max(1, (width + 3) // 4)
        or not all(c in "0123456789abcdef" for c in value)
    ):
        raise PayloadError(f"aggregate header's {what} is not a hex mask of {width} positions")
    bits = int(value, 16)
    if bits >> width:
        raise PayloadError(f"aggregate header's {what} names positions beyond its {width}")
    return bits


def accepted_names(reply: dict[str, Any], members: tuple[str, ...]) -> Any:
    """The accepted contributors a served header names: decoded from ``accepted_mask`` (:func:`compact_header`),
    in the group's sorted member order, or its ``accepted`` list as it is (the caller checks it). Raises
    :class:`PayloadError` for a mask that is not a hex string of the group's width."""
    mask = reply.get("accepted_mask")
    if mask is None:
        return reply.get("accepted")
    bits = _hex_mask(mask, len(members), "accepted_mask")
    return [member for i, member in enumerate(sorted(members)) if bits >> i & 1]


def served_bar(reply: dict[str, Any]) -> float | None:
    """The clip bar of a served header (``clip_bar``; absent or null: nothing was clipped). Raises
    :class:`PayloadError` for one that is not a finite number at least 0 (:func:`~pulseloco.loco.robust.parse_bar`).
    """
    return parse_bar(reply.get("clip_bar"))


def peak(values_K: torch.Tensor) -> float:
    """The largest absolute entry (0 for none): the scale of a part that does not grow with its entry count."""
    return float(values_K.abs().max()) if values_K.numel() else 0.0


PROBE_SECONDS = 2.0
"""How often an owner waiting for parts pings the members still missing (:meth:`ShardOwner._aggregate`)."""

CLIENT_PROBES = 2
"""Probes in a row that must find a client-mode member disconnected before the owner stops waiting for it."""

DUPLICATE = "duplicate contribution"
"""The refusal of a second part from one member: a member's retried push whose first answer was lost."""


@dataclass
class OwnedShard:
    """Owner-side state of one shard in one round (created on the first push, fetch or local begin)."""

    round: int
    group_id: str
    expected: frozenset[str] | None = None
    numel: int | None = None
    contributions: dict[str, bytes] = field(default_factory=dict)
    """The parts received, by sender; once a shard is summed or reduced, only the senders (their parts dropped: the
    owner keeps the aggregate it serves, not the model's worth of parts behind it)."""
    closed: bool = False
    all_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    all_fetched: asyncio.Event = field(default_factory=asyncio.Event)
    fetched: set[str] = field(default_factory=set)
    awaiting: frozenset[str] | None = None
    dialable: frozenset[str] = frozenset()
    """The members (server mode, this owner excepted) whose liveness the owner checks while it waits for their
    parts (:meth:`ShardOwner._aggregate`)."""
    seen_connected: set[str] = field(default_factory=set)
    """Client-mode members (not dialable) this owner has seen connected to it in this round: they pushed a part, or
    a probe found them among the daemon's connections (:meth:`ShardOwner._find_gone`)."""
    disconnected: dict[str, int] = field(default_factory=dict)
    """Per client-mode member seen connected, the probes in a row that found it no longer connected."""
    header: dict[str, Any] | None = None
    payload: bytes = b""
    parts: tuple[bytes, ...] = ()
    """With the gather exchange, the accepted parts in the order of the header's ``accepted`` list."""
    layout: FrameLayout = field(default_factory=FrameLayout)
    num_rejected: int = 0
    largest_norm_ratio: float = 0.0
    start: int = 0
    """The shard's first flat index (the ``topk`` exchange's tiles need it)."""
    absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
    """With the ``topk`` exchange, the owner's rounding error of the kept aggregate (local indices, values), which
    goes into the owner's residual (:mod:`pulseloco.loco.reduce`)."""


@dataclass(frozen=True)
class ShardSum:
    """What :meth:`ShardOwner._sum_contributions` made of a shard's parts: the ``header`` served with the sum
    (``accepted`` contributors, sorted, the ``clip_bar`` when parts were clipped to one, the ``rejected`` ones, the
    ``exchange`` and ``mean_over`` rules), the encoded sum ``payload`` (with the gather exchange, the accepted ``parts``
    instead, served by :meth:`ShardOwner._served`), the number of parts rejected, the largest ratio of an accepted
    part's norm to the clip bar (0 without a bar), and with the ``topk`` exchange the owner's rounding error of the kept
    aggregate (``absorbed``: local indices and values; the header then also names the ``union``'s size and the
    ``budget``)."""

    header: dict[str, Any]
    payload: bytes
    num_rejected: int
    largest_norm_ratio: float
    parts: tuple[bytes, ...] = ()
    absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
    scales: tuple[float, ...] = ()
    """The accepted parts' clip scales, in the order of ``accepted`` (the owner's record; not served: each member
    derives its own from ``clip_bar``)."""


def _refusal(reason: str) -> dict[str, Any]:
    """The header of the one message of a refused stream (:func:`pulseloco.p2p.read_stream` reads it): ``ok``
    False, the ``reason`` and no payload."""
    return {"ok": False, "reason": reason, "size": 0}


class ShardOwner(TrafficCounter):
    """The owner side of :class:`~pulseloco.loco.averaging.SparseAverager`, which sets the attributes below and
    registers ``rpc_push``, ``rpc_fetch`` and ``rpc_ping`` with its other handlers. Owner state is touched on the
    averager's event-loop thread only (the handlers, the aggregation tasks and the exchange run there)."""

    numel: int
    peer_id: str
    averaging_timeout: float
    request_timeout: float
    max_norm_ratio: float
    clip_to_median: bool
    dispute_norm_ratio: float
    repeat_outliers: RepeatOutliers
    chunk_bytes: int
    exchange: str = "sums"
    """``sums`` (serve the FP32 sum), ``gather`` (relay the accepted parts), ``topk`` (serve the budget of the
    aggregate, :mod:`pulseloco.loco.reduce`) or ``auto`` (:meth:`exchange_for`)."""
    reduce_spec: ReduceSpec | None = None
    """The tiles, budget and wire precision of the ``topk`` exchange (and what ``auto`` decides by)."""
    mean_over: str = "peers"
    """``peers`` (the members divide the sum by the peers counted) or ``senders`` (each entry by its senders)."""
    _owned: dict[tuple[int, str], OwnedShard]
    _aggregations: dict[tuple[int, str], asyncio.Task[None]]
    _current_round: int
    _gave_up: set[tuple[int, str, str]]
    """``(round, group, owner)``: the owners this member gave up pushing its part to (the averager's ``_push``)."""
    _finished: set[tuple[int, str]]
    """``(round, group)``: the rounds whose exchange this member has ended: it pushes and fetches nothing more."""

    async def _probe(self, peer: str, about: dict[str, Any]) -> dict[str, Any] | None:
        """``peer``'s answer to a ping about ``about`` (a round and group), ``None`` when it does not answer (the
        averager pings it); this base class assumes an answer that knows nothing of the round."""
        return {}

    async def _alive(self, peer: str) -> bool:
        """Whether ``peer`` answers a ping (:meth:`_probe`); never raises."""
        return await self._probe(peer, {}) is not None

    async def _connected(self) -> set[str] | None:
        """The peers this peer's daemon holds a connection to, ``None`` when it cannot tell (the averager asks the
        daemon); this base class cannot."""
        return None

    @staticmethod
    async def _wait_probing(event: asyncio.Event, deadline: float) -> bool | None:
        """Wait for ``event`` at most :data:`PROBE_SECONDS` and not past ``deadline`` (loop time): True once it is
        set, False when it is time to ping the peers still waited for, None when the deadline has passed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            await asyncio.wait_for(event.wait(), timeout=min(remaining, PROBE_SECONDS))
        except TimeoutError:
            return False
        return True

    async def _find_gone(self, shard: OwnedShard, waiting: frozenset[str], gone: set[str], *, for_part: bool) -> None:
        """Ping the peers of ``waiting`` that ``shard``'s owner can dial and that are not yet in ``gone`` (at once,
        :meth:`_probe`, which never raises), and add to ``gone`` those that will not come: that do not answer, that
        answer that their exchange of the round has ended, or (``for_part``: the owner waits for their parts) that
        they gave up pushing to this owner."""
        probed = sorted((waiting - gone) & shard.dialable)
        about = {"round": shard.round, "group": shard.group_id}
        answers = await asyncio.gather(*(self._probe(peer, about) for peer in probed))
        for peer, answer in zip(probed, answers, strict=True):
            if answer is None or answer.get("finished") is True or (for_part and answer.get("gave_up") is True):
                if answer is not None:
                    logger.info("member done with the round round=%d peer=%s answer=%s", shard.round, peer, answer)
                gone.add(peer)
        await self._find_disconnected(shard, waiting - gone - shard.dialable - {self.peer_id}, gone)

    async def _find_disconnected(self, shard: OwnedShard, clients: frozenset[str], gone: set[str]) -> None:
        """Client-mode members cannot be pinged (nothing dials them). One this owner has seen connected (it pushed,
        or an earlier probe found it) and that is no longer connected in :data:`CLIENT_PROBES` probes in a row
        (a process that died, its daemon with it) goes to ``gone``; one never seen connected is waited for as
        before. A live client taken for gone costs only this round: its part is refused later (it stays in its
        residual) or it fetches a sum that is still served."""
        if not clients:
            return
        connected = await self._connected()
        if connected is None:
            return
        shard.seen_connected.update(clients & set(shard.contributions))
        for peer in sorted(clients):
            if peer in connected:
                shard.seen_connected.add(peer)
                shard.disconnected.pop(peer, None)
            elif peer in shard.seen_connected:
                shard.disconnected[peer] = shard.disconnected.get(peer, 0) + 1
                if shard.disconnected[peer] >= CLIENT_PROBES:
                    logger.info(
                        "client-mode member no longer connected round=%d peer=%s probes=%d",
                        shard.round,
                        peer,
                        shard.disconnected[peer],
                    )
                    gone.add(peer)

    @asker_closes
    async def rpc_ping(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Answer a liveness check (an owner waiting for this member's part or fetch, a member whose fetch failed)
        with one message on a stream the asker closes. When the request names a round and group, the answer says
        whether this member gave up pushing its part to the asker (``gave_up``) and whether its exchange of that
        round has ended (``finished``): an owner waiting for a part or fetch that will not come stops waiting
        (:meth:`_find_gone`). An unreadable request gets an answer about nothing (the asker only learns that
        this peer is alive)."""
        try:
            about = parse_header(request.metadata)
        except PayloadError:
            about = {}
        round_index, group_id = about.get("round"), about.get("group")
        answer: dict[str, Any] = {}
        if isinstance(round_index, int) and isinstance(group_id, str):
            asker = context.remote_id.to_base58()
            answer = {
                "gave_up": (round_index, group_id, asker) in self._gave_up,
                "finished": (round_index, group_id) in self._finished,
            }
        yield header_message(runtime_pb2.ExpertResponse, answer)

    def exchange_for(self, group_size: int) -> str:
        """The exchange this owner serves a group of ``group_size`` members with: the configured one, or for
        ``auto`` the one that sends least while staying exact where that costs nothing: for quantized values ``topk``
        where it sends less than ``gather`` (``gather`` sends ``R - 1`` payloads, ``topk`` about
        ``(1 + exchange_budget) (R - 1)/R``: from 4 peers on at the default budget) and ``gather`` below (no more
        bytes, nothing dropped); ``sums`` otherwise."""
        if self.exchange != "auto":
            return self.exchange
        spec = self.reduce_spec
        if spec is not None and spec.value_dtype == "quantized":
            return "gather" if spec.gathers_less(group_size) else "topk"
        return "sums"

    @property
    def max_payload_bytes(self) -> int:
        """Upper bound of one encoded part or sum: 12 bytes per entry (index and value, uncompressed) plus 1 MiB
        of framing; anything larger is refused while it streams in."""
        return 12 * self.numel + (1 << 20)

    def _reply(self, round_index: int, header: dict[str, Any]) -> runtime_pb2.ExpertResponse:
        """A one-message answer (push acknowledgement, refusal), counted as sent in ``round_index``."""
        message = header_message(runtime_pb2.ExpertResponse, header)
        self._count(round_index, sent=message.ByteSize())
        return message

    def expect_round(self, round_index: int) -> None:
        """Accept parts for ``round_index`` (and the rounds next to it) from now on. Call it before this peer
        registers for the round: a member may push as soon as the group forms, and a peer that has just joined,
        or repaired its state, can be many rounds past its last exchange (before this, such an owner refused
        every part as out of range and its group waited out ``averaging_timeout``)."""
        self._current_round = round_index

    def _owned_shard(self, round_index: int, group_id: str) -> OwnedShard | None:
        """The owner state for ``(round, group)``, created on demand for rounds near the current one
        (:meth:`expect_round`)."""
        key = (round_index, group_id)
        shard = self._owned.get(key)
        if shard is None:
            if not self._current_round - 1 <= round_index <= self._current_round + 2:
                return None
            if sum(1 for r, _ in self._owned if r == round_index) >= 4:
                return None  # bounded state per round: a flood of bogus group ids is refused
            shard = self._owned[key] = OwnedShard(round_index, group_id)
        return shard

    def _add_contribution(self, shard: OwnedShard, sender: str, payload: bytes) -> str | None:
        """Store a part; return a refusal reason or ``None``."""
        if shard.closed:
            return "late: the shard was already aggregated"
        if sender in shard.contributions:
            return DUPLICATE
        if shard.expected is not None and sender not in shard.expected:
            return "sender is not a member of this group"
        shard.contributions[sender] = payload
        if shard.expected is not None and shard.expected <= shard.contributions.keys():
            shard.all_arrived.set()
        return None

    @asker_closes
    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Receive one member's part of this owner's shard (header first, then chunks); answer with one message
        (a stream, so that the member closes it once read: :func:`pulseloco.p2p.asker_closes`)."""
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
            yield self._reply(round_key, {"ok": False, "reason": repr(exc)})
            return
        if not isinstance(header.get("round"), int) or not isinstance(header.get("group"), str):
            yield self._reply(round_key, {"ok": False, "reason": "missing round or group"})
            return
        shard = self._owned_shard(header["round"], header["group"])
        reason = "round out of range" if shard is None else self._add_contribution(shard, sender, payload)
        if reason is not None:
            logger.info("push refused sender=%s round=%s reason=%s", sender, header["round"], reason)
        yield self._reply(header["round"], {"ok": reason is None, "reason": reason})

    @asker_closes
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
        header, frames, layout = self._served(shard, requester)
        messages = stream_messages(runtime_pb2.ExpertResponse, header, frames, chunk_bytes=self.chunk_bytes)
        for message in self._counted(shard.round, messages, layout, is_sum=True):
            yield message
        shard.fetched.add(requester)
        if shard.awaiting is not None and shard.awaiting <= shard.fetched:
            shard.all_fetched.set()

    def _served(self, shard: OwnedShard, requester: str) -> tuple[dict[str, Any], list[bytes], FrameLayout]:
        """What ``requester`` is sent of an aggregated shard: the sum, or with the gather exchange every accepted
        part but the requester's own (it has it; its size is listed as 0), with the header and the layout."""
        header = compact_header(shard.header or {}, sorted(shard.expected or ()))
        if header.get("exchange") != "gather":
            return header, [shard.payload], shard.layout
        names = (shard.header or {})["accepted"]
        frames = [b"" if name == requester else part for name, part in zip(names, shard.parts, strict=True)]
        header = {**header, "parts": [len(frame) for frame in frames], "size": sum(map(len, frames))}
        return header, frames, FrameLayout.of_frames([frame for frame in frames if frame])

    def _open_own_shard(self, group: Group, start: int, numel: int, part: bytes, deadline: float) -> OwnedShard:
        """Become the owner of this peer's shard (``numel`` entries from ``start``) of ``group``'s round: fix the
        expected members (parts pushed early by non-members are dropped), add this peer's own ``part`` and start the
        aggregation (until ``deadline``) as its own task. Raises :class:`SwarmError` when the round is out of
        range (never for the current round)."""
        owned = self._owned_shard(group.round, group.group_id)
        if owned is None:  # cannot happen: the current round is always in range
            raise SwarmError(f"cannot own a shard of round {group.round}")
        owned.expected = frozenset(group.members)
        owned.dialable = frozenset(group.servers) - {self.peer_id}
        owned.numel = numel
        owned.start = start
        for sender in list(owned.contributions):
            if sender not in owned.expected:
                logger.warning("dropping part from non-member round=%d peer=%s", group.round, sender)
                del owned.contributions[sender]
        reason = self._add_contribution(owned, self.peer_id, part)
        if reason is not None:
            logger.warning("own part refused round=%d reason=%s", group.round, reason)
        if owned.expected <= owned.contributions.keys():
            owned.all_arrived.set()
        # Its own task, not cancelled with this exchange: the other members fetch this sum even when this
        # peer's wait is cut short (a stalled process resumes past its deadline).
        self._aggregations[(group.round, group.group_id)] = asyncio.create_task(self._aggregate(owned, deadline))
        return owned

    async def _finished_aggregation(self, group: Group, timeout: float) -> OwnedShard | None:
        """This owner's state for ``group``'s round once its aggregation has finished, waiting at most ``timeout``
        seconds; None when it aggregates nothing for that group. Raises :class:`TimeoutError` when it does not finish
        in time (the aggregation itself goes on: the other members still fetch its sum)."""
        task = self._aggregations.get((group.round, group.group_id))
        owned = self._owned.get((group.round, group.group_id))
        if task is None or owned is None:
            return None
        await asyncio.wait_for(asyncio.shield(task), timeout=timeout)
        return owned

    async def _settled_absorbed(self, group: Group) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This owner's rounding error of its ``topk`` aggregate of ``group``'s round (local indices, values), once
        its aggregation has finished (waiting at most ``request_timeout`` for it): the other members may have
        applied that aggregate even when this peer's own wait for it was cut short. None without one: no
        aggregation of this group here, another exchange, or not finished in time (logged)."""
        try:
            owned = await self._finished_aggregation(group, self.request_timeout)
        except TimeoutError:
            logger.warning(
                "own aggregation still running round=%d: if the others apply it, its rounding error is lost",
                group.round,
            )
            return None
        return owned.absorbed if owned is not None else None

    async def _own_sum(self, group: Group, deadline: float) -> tuple[dict[str, Any], bytes] | None:
        """This owner's sum of its shard of ``group``'s round, once aggregated (waiting at least
        ``request_timeout``, else until ``deadline``); None when there is none or the aggregation did not finish
        in time (logged)."""
        try:
            owned = await self._finished_aggregation(group, max(self.request_timeout, deadline - time.monotonic()))
        except TimeoutError:
            logger.warning("own aggregation did not finish round=%d", group.round)
            return None
        if owned is None:
            return None
        owned.fetched.add(self.peer_id)
        if owned.header is None:
            return {}, b""
        header, frames, _ = self._served(owned, self.peer_id)
        return header, b"".join(frames)

    async def _serve_until_fetched(self, owned: OwnedShard, deadline: float) -> None:
        """Keep serving until every member that contributed (and this peer) has fetched the sum, at most until
        ``deadline`` (a timeout is logged, never raised), so that a peer finishing first does not leave the others
        without its shard; later fetches are still served. Every :data:`PROBE_SECONDS` the members still to fetch
        are probed (:meth:`_find_gone`), and those that will not fetch (they died after pushing their part, or
        ended their exchange) are no longer waited for."""
        owned.awaiting = frozenset(owned.contributions) | {self.peer_id}
        if owned.awaiting <= owned.fetched:
            owned.all_fetched.set()
        gone: set[str] = set()
        while not owned.all_fetched.is_set():
            done = await self._wait_probing(owned.all_fetched, deadline)
            if done is None:
                logger.info(
                    "not every member fetched round=%d missing=%s",
                    owned.round,
                    sorted(owned.awaiting - owned.fetched),
                )
                return
            if done:
                return
            await self._find_gone(owned, owned.awaiting - owned.fetched, gone, for_part=False)
            if gone and owned.awaiting - gone <= owned.fetched:
                logger.info("every live member fetched round=%d gone=%s", owned.round, sorted(gone))
                return

    async def _aggregate(self, shard: OwnedShard, deadline: float) -> None:
        """Wait for the members' parts (until ``deadline``, loop time), validate and sum them. Every
        :data:`PROBE_SECONDS` without them, the members still missing are probed (:meth:`_find_gone`: server-mode
        ones pinged, client-mode ones looked for among the connections): once every member still missing is one
        that will not push (a process that died mid-round, a member that gave up), the shard is summed without
        them instead of waiting out ``averaging_timeout``. A part that comes later is refused, so
        its sender keeps it in its residual (exactly once holds either way)."""
        expected = shard.expected or frozenset()
        gone: set[str] = set()
        while not shard.all_arrived.is_set():
            done = await self._wait_probing(shard.all_arrived, deadline)
            if done is None:
                logger.warning(
                    "averaging timeout: aggregating without parts round=%d missing=%s (raise averaging_timeout if "
                    "peers are slow rather than gone)",
                    shard.round,
                    sorted(expected - shard.contributions.keys()),
                )
                break
            if done:
                break
            await self._find_gone(shard, expected - shard.contributions.keys(), gone, for_part=True)
            if gone and expected - gone <= shard.contributions.keys() and not shard.all_arrived.is_set():
                logger.warning(
                    "aggregating without parts round=%d gone=%s: they do not answer (a process that died "
                    "mid-round) or gave up pushing to this owner; not waiting out averaging_timeout for them",
                    shard.round,
                    sorted(gone),
                )
                break
        shard.closed = True
        contributions = dict(shard.contributions)
        loop = asyncio.get_running_loop()
        summed = await loop.run_in_executor(
            None,
            self._sum_contributions,
            shard.round,
            shard.numel or 0,
            contributions,
            len(shard.expected or ()),
            shard.start,
        )
        shard.layout = await loop.run_in_executor(None, FrameLayout.of, summed.payload)
        shard.header, shard.payload, shard.num_rejected = summed.header, summed.payload, summed.num_rejected
        if not summed.parts:  # summed or reduced: only who sent a part matters from now on, not its bytes
            shard.contributions = dict.fromkeys(contributions, b"")
        del contributions
        shard.parts = summed.parts
        shard.largest_norm_ratio = summed.largest_norm_ratio
        shard.absorbed = summed.absorbed
        shard.done.set()

    def _sum_contributions(
        self, round_index: int, numel: int, contributions: dict[str, bytes], group_size: int = 0, start: int = 0
    ) -> ShardSum:
        """Validate, clip and sum the parts in sorted peer-id order (CPU work, run off the event loop): parts of
        excluded peers are refused, the others decoded and screened for gross outliers, each remaining part
        clipped to the bar (:func:`~pulseloco.loco.robust.clip_bar`; not with ``clip_to_median`` False) and
        judged for :class:`~pulseloco.loco.robust.RepeatOutliers`; then served by the exchange
        :meth:`exchange_for` picks for ``group_size`` members (``start``: the shard's first flat index). Never
        raises because of a part."""
        valid: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        rejected: dict[str, str] = {}
        strikes: dict[str, str | None] = {}
        for peer in sorted(contributions):
            exclusion = self.repeat_outliers.exclusion(peer)
            if exclusion is not None:
                rejected[peer] = f"ExcludedPeer: {exclusion}"
                continue
            try:
                valid[peer] = decode_sparse(contributions[peer], CONTRIBUTION_NAME, numel)
            except PayloadError as exc:
                rejected[peer] = strikes[peer] = f"{type(exc).__name__}: {exc}"
        l2_norms = {peer: part_norm(values_K) for peer, (_, values_K) in valid.items()}
        if len(valid) >= 3:  # L2 norms against the leave-one-out median
            screen_norms, reference = l2_norms, None
        else:  # no majority: largest entries against this owner's own (the part it can trust)
            screen_norms = {peer: peak(values_K) for peer, (_, values_K) in valid.items()}
            reference = screen_norms.get(self.peer_id)
        for peer, reason in screen_outliers(screen_norms, self.max_norm_ratio, reference=reference).items():
            rejected[peer] = strikes[peer] = f"OutlierPayloadError: {reason}"
            del valid[peer]
        norms = {peer: l2_norms[peer] for peer in valid}
        bar, what = clip_bar(norms, self.peer_id)
        scales = clip_scales(norms, bar) if self.clip_to_median else dict.fromkeys(norms, 1.0)
        for peer, norm in norms.items():
            strike = None
            if bar > 0.0 and norm > self.dispute_norm_ratio * bar:
                strike = f"norm {norm:.3e} above {self.dispute_norm_ratio:g}x {what} {bar:.3e}"
            strikes[peer] = strike
            if scales[peer] == 0.0:
                rejected[peer] = f"OutlierPayloadError: norm {norm:.3e} clipped to nothing by {what} {bar:.3e}"
                del valid[peer]
            elif strike is not None:
                logger.warning(
                    "contribution clipped hard round=%d peer=%s scale=%.3g: %s", round_index, peer, scales[peer], strike
                )
            elif scales[peer] < 1.0:
                logger.debug("contribution clipped round=%d peer=%s scale=%.4g", round_index, peer, scales[peer])
        largest_ratio = max((norms[peer] / bar for peer in valid), default=0.0) if bar > 0.0 else 0.0
        for peer, reason in rejected.items():
            logger.warning("contribution rejected round=%d peer=%s reason=%s", round_index, peer, reason)
        for peer, reason in self.repeat_outliers.record(round_index, strikes).items():
            logger.warning(
                "peer excluded from this owner's sums for the rest of the run round=%d peer=%s: %s (if it is honest, "
                "raise dispute_norm_ratio or set dispute_rounds=0)",
                round_index,
                peer,
                reason,
            )
        accepted = sorted(valid)
        exchange = self.exchange_for(group_size)
        header: dict[str, Any] = {
            "ok": True,
            "accepted": accepted,
            "rejected": sorted(rejected),
            "exchange": exchange,
            "mean_over": self.mean_over,
        }
        if self.clip_to_median and bar > 0.0:
            header["clip_bar"] = bar
        accepted_scales = tuple(scales[peer] for peer in accepted)
        if exchange == "topk" and self.reduce_spec is not None:
            spec = self.reduce_spec
            reduced = reduce_parts(
                [(valid[peer], scales[peer]) for peer in accepted],
                start=start,
                numel=numel,
                spec=spec,
                mean_over=self.mean_over,
            )
            payload = encode_sparse(
                AGGREGATE_NAME,
                numel,
                reduced.indices_K,
                reduced.values_K,
                round_index=round_index,
                value_dtype=spec.value_dtype,
                group_starts=reduced.group_starts,
            )
            return ShardSum(
                {**header, "union": reduced.num_union, "budget": spec.factor, "size": len(payload)},
                payload,
                len(rejected),
                largest_ratio,
                absorbed=(reduced.indices_K, reduced.absorbed_K),
                scales=accepted_scales,
            )
        if exchange == "gather":
            parts = tuple(contributions[peer] for peer in accepted)
            return ShardSum(
                {**header, "size": sum(map(len, parts))},
                b"",
                len(rejected),
                largest_ratio,
                parts,
                scales=accepted_scales,
            )
        indices_K, sum_K = combine_parts([(valid[peer], scales[peer]) for peer in accepted], numel, self.mean_over)
        payload = encode_sparse(AGGREGATE_NAME, numel, indices_K, sum_K, round_index=round_index)
        return ShardSum({**header, "size": len(payload)}, payload, len(rejected), largest_ratio, scales=accepted_scales)
