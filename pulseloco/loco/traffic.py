"""Byte accounting of the sparse all-reduce (:mod:`pulseloco.loco.averaging`): what one round sent and received.

Every protobuf message a peer sends or receives for a round is counted at its serialized size (``ByteSize()``,
libp2p framing not included) where it is sent or read (:meth:`TrafficCounter._count`), into the round's
:class:`Traffic`. Each message sent is split exactly: the bytes of a contribution frame's index and value sections
it carries (their offsets read from the frame's header, :func:`pulseloco.codec.peek_header`, into a
:class:`FrameLayout`), the same for a shard sum it serves, and the rest (the stream's JSON header, the frame's
prefix, JSON header and checksum, protobuf tags and lengths, push replies, fetch requests and refusals). The parts
add up to the bytes sent. :class:`pulseloco.loco.averaging.AllReduceResult` and
:class:`pulseloco.loco.metrics.RoundMetrics` report them.

Failure behaviour: counting never raises; a frame that does not parse counts as all header and no entries.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

from pulseloco.codec import peek_header
from pulseloco.errors import PayloadError
from pulseloco.p2p import Message

__all__ = ["NO_ELEMENT_LIMIT", "FrameLayout", "Traffic", "TrafficCounter"]

M = TypeVar("M", bound=Message)

#: Element bound when reading the headers of this peer's own frames (the receivers' bound is ``numel``).
NO_ELEMENT_LIMIT = 1 << 40


@dataclass
class Traffic:
    """Wire bytes of one round on one peer, counted by :meth:`TrafficCounter._count`: whole protobuf messages
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
    group's indices in its shard; with the gather exchange, the other members' parts it relayed), once per member
    served."""
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
class FrameLayout:
    """Where the index and value sections of one frame, or of frames sent back to back (a gathered shard's parts),
    lie: per frame ``(index_start, value_start, value_stop)`` byte offsets into the bytes sent, and the number of
    entries of all of them."""

    spans: tuple[tuple[int, int, int], ...] = ()
    num_entries: int = 0

    @classmethod
    def of(cls, frame: bytes) -> FrameLayout:
        """The layout of ``frame``; a frame that does not parse (never one this peer encoded) counts as all
        header and no entries."""
        return cls.of_frames([frame])

    @classmethod
    def of_frames(cls, frames: list[bytes]) -> FrameLayout:
        """The layout of ``frames`` sent one after another (each as :meth:`of` reads it)."""
        spans: list[tuple[int, int, int]] = []
        entries = offset = 0
        for frame in frames:
            try:
                header = peek_header(frame, max_elements=NO_ELEMENT_LIMIT)
            except PayloadError:
                offset += len(frame)
                continue
            value_start = offset + header.header_bytes + header.index_bytes
            spans.append((offset + header.header_bytes, value_start, value_start + header.value_bytes))
            entries += header.num_changed
            offset += len(frame)
        return cls(tuple(spans), entries)

    def split(self, start: int, stop: int) -> tuple[int, int]:
        """How many of the bytes ``[start, stop)`` lie in index sections and in value sections."""
        index = value = 0
        for index_start, value_start, value_stop in self.spans:
            index += max(0, min(stop, value_start) - max(start, index_start))
            value += max(0, min(stop, value_stop) - max(start, value_start))
        return index, value


class TrafficCounter:
    """The per-round :class:`Traffic` counters: a base of :class:`~pulseloco.loco.averaging.SparseAverager`, which
    sets ``_traffic`` (never used on its own). Every method runs on the averager's event-loop thread only, where
    the handlers and the exchange send and read their messages; none of them locks or raises."""

    _traffic: dict[int, Traffic]

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

    def _counted(self, round_index: int, messages: Iterator[M], layout: FrameLayout, *, is_sum: bool) -> Iterator[M]:
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

    async def _traffic_copy(self, round_index: int) -> Traffic:
        """A copy of the round's :class:`Traffic` (a coroutine: the counters are only touched on the loop)."""
        return replace(self._traffic.get(round_index, Traffic()))
