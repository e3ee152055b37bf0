"""The consensus vote (pulseloco/loco/consensus.py): which state a peer downloads, from the swarm's state records.

Pure functions over records, so every case of the rule is checked directly; tests/test_loco_swarm.py runs the same
rule in real swarms (late joiners, poisoned averages, split groups)."""

from __future__ import annotations

from pulseloco.loco.consensus import distrusted, majority_digest, preferred_digest, repair_target
from pulseloco.loco.peers import PeerState


def state(peer: str, round_index: int, digest: str, *, client: bool = False, complete: bool = True) -> PeerState:
    return PeerState(peer, round_index, digest, client, complete)


def test_preferred_digest_counts_then_prefers_a_servable_one_then_the_smallest() -> None:
    assert preferred_digest([]) is None
    assert preferred_digest([("b", False), ("b", True), ("a", False)]) == "b"  # most holders
    assert preferred_digest([("a", True), ("b", False)]) == "b"  # a tie: a server-mode peer can serve b
    assert preferred_digest([("b", False), ("a", False)]) == "a"  # still a tie: the smallest, on every peer


def test_complete_rounds_outvote_partial_ones() -> None:
    states = [state("p1", 3, "partial", complete=False), state("p2", 3, "partial", complete=False)]
    states.append(state("p3", 3, "full"))
    assert majority_digest(states, 3) == "full"
    assert majority_digest(states, 4) is None


def test_a_peer_behind_downloads_the_newest_round_most_peers_hold() -> None:
    own = state("me", 2, "old")
    others = [state("p1", 3, "new"), state("p2", 3, "new"), state("p3", 3, "odd")]
    assert repair_target(others, own) == {3: "new"}


def test_a_peer_racing_ahead_alone_does_not_drag_the_others_along() -> None:
    own = state("me", 3, "mine")
    others = [state("p1", 3, "mine"), state("loner", 5, "raced")]  # one peer at round 5, two at round 3
    assert repair_target(others, own) is None


def test_at_the_end_a_peer_alone_ahead_steps_back_to_the_round_most_peers_hold() -> None:
    own = state("me", 12, "alone")
    others = [state("p1", 11, "swarm"), state("p2", 11, "swarm"), state("p3", 10, "old")]
    assert repair_target(others, own) is None  # during training the others may still be on their way
    assert repair_target(others, own, step_back=True) == {11: "swarm"}
    # not alone at its round: it stays
    assert repair_target([*others, state("p4", 12, "alone")], own, step_back=True) is None
    # one peer alone further ahead steps back itself: both go back (following it, the two swapped places and ended on
    # two states, seen in a WAN churn run with overlap); during training the usual rule follows it
    staggered = [*others, state("p4", 13, "raced")]
    assert repair_target(staggered, own, step_back=True) == {11: "swarm"}
    assert repair_target([*others, own], state("p4", 13, "raced"), step_back=True) == {11: "swarm"}
    assert repair_target(staggered, own) == {13: "raced"}
    # two peers ahead together are a round the swarm can follow
    assert repair_target([*staggered, state("p5", 13, "raced")], own, step_back=True) == {13: "raced"}
    # nobody else agrees on an older round either: nothing better to go back to
    assert repair_target([state("p1", 11, "a"), state("p2", 10, "b")], own, step_back=True) is None
    # among rounds held by equally many, the newest
    pairs = [state("p1", 11, "x"), state("p2", 11, "x"), state("p3", 10, "y"), state("p4", 10, "y")]
    assert repair_target(pairs, own, step_back=True) == {11: "x"}


def test_a_peer_disagreeing_with_the_majority_of_its_round_repairs_and_an_agreeing_one_does_not() -> None:
    others = [state("p1", 4, "good"), state("p2", 4, "good")]
    assert repair_target(others, state("me", 4, "bad")) == {4: "good"}
    assert repair_target(others, state("me", 4, "good")) is None


def test_only_server_mode_peers_offer_a_round() -> None:
    others = [state("p1", 6, "new", client=True), state("p2", 6, "new", client=True)]
    assert repair_target(others, state("me", 5, "old")) is None  # nobody could serve round 6


def test_disputed_peers_are_distrusted_by_everyone_reading_the_records() -> None:
    accuser = PeerState("p1", 4, "good", False, True, disputed=("poisoner",))
    assert distrusted([accuser, state("poisoner", 4, "bad")]) == {"poisoner"}
