"""The peer-state records of PULSELoCo: each peer's latest (round, digest) and its recent rounds, as read from the DHT.

A peer publishes its record under ``pulseloco:{run_id}:loco:state`` (:func:`pulseloco.keys.loco_state_key`; the
:class:`pulseloco.loco.matchmaking.Matchmaker` writes and reads it). The value is
``{"round", "digest", "client", "complete", "disputed", "rounds"}``. Records come from strangers:
:func:`parse_state` returns ``None`` for a malformed record (a field of the wrong type, an unprintable or overlong
peer id or digest, too many disputes) and drops a malformed ``rounds`` list alone, keeping the peer's vote. Readers
ignore keys they do not know. :mod:`pulseloco.loco.consensus` decides from these records; it and the matchmaker
both import this module and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

__all__ = ["MAX_DISPUTED", "MAX_ROUND_RECORDS", "PeerState", "RoundRecord", "StateRecords", "parse_state"]

MAX_DISPUTED = 64
"""Most disputed owners one state record carries (a longer list in a record makes the record malformed)."""

MAX_ROUND_RECORDS = 16
"""Most :class:`RoundRecord` entries one state record carries (its peer's latest rounds; a longer list is malformed).
A monitor polling less often than every 16 rounds misses rounds."""

_MAX_TEXT = 128
"""Longest peer id (a base58 libp2p id is about 52 characters) or digest accepted in a state record."""

_MAX_COUNT = 2**62
"""Largest count (peers, bytes) a :class:`RoundRecord` may claim."""


@dataclass(frozen=True)
class RoundRecord:
    """One outer round as its peer saw it, carried in its state record (``rounds``) for monitors: the fields of
    :class:`~pulseloco.loco.metrics.RoundMetrics` of the same names. On the wire a list ``[round, num_peers,
    num_contributors, bytes_sent, bytes_received]``; readers ignore elements after these five (room for more)."""

    round: int
    """Index of the outer round."""
    num_peers: int
    """Size of the averaging group, this peer included (0: the peer sat the round out)."""
    num_contributors: int
    """Contributions the round aggregated, as seen by this peer."""
    bytes_sent: int
    """Wire bytes this peer sent for the round's averaging."""
    bytes_received: int
    """Wire bytes this peer received for it."""

    def to_wire(self) -> list[int]:
        return [self.round, self.num_peers, self.num_contributors, self.bytes_sent, self.bytes_received]


@dataclass(frozen=True)
class PeerState:
    """A peer's latest published (round, digest) record."""

    peer_id: str
    round: int
    digest: str
    client_mode: bool
    complete: bool = True
    """False when the peer's last round missed some shard's sum (it applied only part of the round)."""
    disputed: tuple[str, ...] = ()
    """Owners whose average this peer refused as poisoned, and contributors its shard excluded
    (:meth:`SparseAverager.distrusted_peers`)."""
    rounds: tuple[RoundRecord, ...] = ()
    """The peer's latest rounds, oldest first (empty when the record carries none)."""


@dataclass(frozen=True)
class StateRecords:
    """What :meth:`Matchmaker.read_state_records` found: the well-formed ``states``, the records skipped as
    ``malformed``, and the records kept whose ``rounds`` list was malformed and dropped (``malformed_rounds``)."""

    states: list[PeerState]
    malformed: int = 0
    malformed_rounds: int = 0


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_COUNT


def _parse_rounds(value: Any, record_round: int) -> tuple[RoundRecord, ...] | None:
    """The ``rounds`` list of a state record (absent: empty), or ``None`` if malformed: more than
    :data:`MAX_ROUND_RECORDS` entries, an entry that is not a list of 5 to 16 counts, rounds not increasing or not
    before the record's round."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > MAX_ROUND_RECORDS:
        return None
    parsed: list[RoundRecord] = []
    for entry in value:
        if not (isinstance(entry, (list, tuple)) and 5 <= len(entry) <= 16 and all(map(_is_count, entry[:5]))):
            return None
        record = RoundRecord(*entry[:5])
        if record.round >= record_round or (parsed and record.round <= parsed[-1].round):
            return None
        parsed.append(record)
    return tuple(parsed)


def parse_state(peer: Any, value: Any) -> tuple[PeerState, bool] | None:
    """One state record: ``(state, whether its rounds list was malformed and dropped)``, or ``None`` if the record
    is malformed (a field of the wrong type, an unprintable or overlong peer id or digest, too many disputes)."""
    if not (isinstance(peer, str) and 0 < len(peer) <= _MAX_TEXT and peer.isprintable() and isinstance(value, dict)):
        return None
    round_index, digest, client = value.get("round"), value.get("digest"), value.get("client")
    complete, disputed = value.get("complete", True), value.get("disputed", [])
    if not (
        _is_count(round_index)
        and isinstance(digest, str)
        and len(digest) <= _MAX_TEXT
        and digest.isprintable()
        and isinstance(client, bool)
        and isinstance(complete, bool)
        and isinstance(disputed, list)
        and len(disputed) <= MAX_DISPUTED
        and all(isinstance(p, str) for p in disputed)
    ):
        return None
    rounds = _parse_rounds(value.get("rounds"), round_index)
    state = PeerState(peer, round_index, digest, client, complete, tuple(disputed), rounds or ())
    return state, rounds is None
