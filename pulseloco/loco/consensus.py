"""The consensus vote: which global state a peer should hold, from the state records of the swarm.

Every peer publishes its latest ``(round, digest, complete, disputed)``
(:class:`~pulseloco.loco.peers.PeerState`). After a round, and before the next, a trainer applies
:func:`repair_target` to what it read: it downloads the state when server-mode peers hold a newer round that at
least as many peers report as its own, or when most peers at its own round hold another digest. ``pulseloco
status`` applies the same rule (:func:`majority_digest`, :func:`distrusted`) to say which peers agree. Pure
functions over the records: no DHT, no tensors.

The rule's parts: a digest is chosen by count, preferring one a server-mode peer holds (it can be downloaded), then
the smallest (:func:`preferred_digest`), so every peer reading the same records picks the same one; a peer whose
round was incomplete (it missed a shard) does not outvote complete ones (:func:`majority_digest`); a peer some peer
caught sending a poisoned average neither votes nor serves (:func:`distrusted`): a false accusation only removes a
source, it never makes anyone adopt a state.
"""

from __future__ import annotations

import collections

from pulseloco.loco.peers import PeerState

__all__ = ["distrusted", "majority_digest", "preferred_digest", "repair_target"]


def preferred_digest(holders: list[tuple[str, bool]]) -> str | None:
    """Of ``(digest, client_mode)`` pairs, one per peer: the digest most peers hold; among equals, one a
    server-mode peer holds (it can be downloaded), then the smallest, so that every peer reading the same
    records picks the same one. ``None`` for no holders."""
    counts = collections.Counter(digest for digest, _ in holders)
    served = {digest for digest, client in holders if not client}
    return min(counts, key=lambda d: (-counts[d], d not in served, d), default=None)


def majority_digest(states: list[PeerState], round_index: int) -> str | None:
    """The :func:`preferred_digest` of the peers that report ``round_index``, counting only peers whose round
    was complete when any was (a peer that missed a shard holds a partial round and must not outvote the
    others). ``None`` if no peer reported that round."""
    voters = [s for s in states if s.round == round_index]
    if any(s.complete for s in voters):
        voters = [s for s in voters if s.complete]
    return preferred_digest([(s.digest, s.client_mode) for s in voters])


def distrusted(states: list[PeerState]) -> set[str]:
    """The peers some peer disputed (caught sending a poisoned average, or excluded from its shard for repeated
    outliers): they neither vote nor serve."""
    return {p for s in states for p in s.disputed}


def repair_target(states: list[PeerState], own: PeerState, *, step_back: bool = False) -> dict[int, str] | None:
    """``{round: digest}`` of the state this peer (``own``) should download, or ``None`` to keep its own.

    ``states`` are the other peers' records, already without :func:`distrusted` peers. The newest round some
    other server-mode peer can serve with a majority digest wins when at least as many peers report it as this
    peer's own round (a peer that averaged alone and raced ahead, a group of one while the DHT failed it, must not
    drag the majority along); else this peer's own round, when the majority there holds another digest.

    ``step_back`` (for a swarm that has stopped, :meth:`PulseLoCo.catch_up`): a peer alone at its round, ahead of
    every round that more than one peer holds, also goes back to the older round most other peers hold (the newest
    among equals), since nobody will follow it there; and no peer follows one that is alone further ahead, which
    steps back itself (two peers that each ran on alone, to different rounds, would otherwise swap places and end on
    two states). During training a peer ahead waits instead, because the others may still be on their way."""
    votes = [s for s in states if s.peer_id != own.peer_id] + [own]
    servable = {s.round for s in votes if not s.client_mode and s.peer_id != own.peer_id}
    accept = {r: d for r in servable if (d := majority_digest(votes, r)) is not None}
    voters = collections.Counter(s.round for s in votes)
    lone = step_back  # a stopped swarm: a round only one peer holds is not followed
    newest = max(
        (r for r in accept if r > own.round and voters[r] >= voters[own.round] and not (lone and voters[r] == 1)),
        default=None,
    )
    if newest is not None:
        return {newest: accept[newest]}
    if own.round in accept and accept[own.round] != own.digest:
        return {own.round: accept[own.round]}
    shared = max((r for r, n in voters.items() if n > 1), default=-1)
    if step_back and voters[own.round] == 1 and own.round > shared:
        older = max((r for r in accept if r < own.round and voters[r] > 1), key=lambda r: (voters[r], r), default=None)
        if older is not None:
            return {older: accept[older]}
    return None
