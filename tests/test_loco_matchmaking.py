"""Group formation over real hivemind DHTs (four DHT processes on 127.0.0.1): a round whose expected peers have
all registered goes at once instead of waiting out ``matchmaking_time``; a missing expected peer, and the run's
first round, still wait for the close."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import hivemind
import pytest
from hivemind.utils import get_dht_time

from pulseloco.loco.matchmaking import Group, Matchmaker, view_hash

PEERS = ("peer-a", "peer-b", "peer-c")


@pytest.fixture(scope="module")
def dhts() -> Iterator[list[hivemind.DHT]]:
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    maddrs = [str(a) for a in first.get_visible_maddrs()]
    nodes = [hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True) for _ in PEERS]
    try:
        yield nodes
    finally:
        for node in [*nodes, first]:
            node.shutdown()


def _matchmakers(dhts: list[hivemind.DHT], run_id: str, matchmaking_time: float) -> list[Matchmaker]:
    return [
        Matchmaker(
            dht,
            run_id=run_id,
            peer_id=peer,
            client_mode=False,
            matchmaking_time=matchmaking_time,
            target_group_size=None,
            request_timeout=10.0,
            close_when_expected=True,
        )
        for dht, peer in zip(dhts, PEERS, strict=True)
    ]


def _publish_and_wait(matchmakers: list[Matchmaker], round_index: int, extra: Matchmaker | None = None) -> None:
    """Every matchmaker (and ``extra``) announces that it starts ``round_index``; returns once each reads all."""
    announcing = [*matchmakers, *([extra] if extra is not None else [])]
    for matchmaker in announcing:
        matchmaker.publish_state(round_index, "d0")
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if all(len([s for s in m.read_states() if s.round == round_index]) == len(announcing) for m in matchmakers):
            return
        time.sleep(0.1)
    raise AssertionError("the state records did not reach every peer within 30 s")


def _form_groups(matchmakers: list[Matchmaker], round_index: int, timeout: float) -> list[Group | None]:
    """``form_group`` on every matchmaker at once (threads); fails if one has not returned within ``timeout``."""
    groups: list[Group | None] = [None] * len(matchmakers)
    expiration = get_dht_time() + 600.0

    def form(i: int) -> None:
        groups[i] = matchmakers[i].form_group(round_index, expiration, "d0")

    threads = [threading.Thread(target=form, args=(i,), daemon=True) for i in range(len(matchmakers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), f"form_group did not return within {timeout:.0f} s"
    return groups


def test_a_round_whose_expected_peers_all_registered_goes_at_once(
    dhts: list[hivemind.DHT], caplog: pytest.LogCaptureFixture
) -> None:
    """matchmaking_time is 300 s; the three peers that completed round 0 register for round 1 and form their group
    as soon as each has seen the other two, well before the close (the test allows 60 s)."""
    matchmakers = _matchmakers(dhts, "mm-early", matchmaking_time=300.0)
    _publish_and_wait(matchmakers, 1)
    with caplog.at_level(logging.INFO, logger="pulseloco.loco.matchmaking"):
        groups = _form_groups(matchmakers, 1, timeout=60.0)
    assert all(g is not None and g.members == PEERS for g in groups), groups
    assert len({g.group_id for g in groups if g is not None}) == 1
    assert caplog.text.count("all 3 expected peers registered") == 3


def test_an_expected_peer_that_does_not_register_is_waited_for_until_the_close(
    dhts: list[hivemind.DHT], caplog: pytest.LogCaptureFixture
) -> None:
    """A fourth peer's state says it starts round 1 too, but it never registers (it died after publishing): the
    others wait for the close, as without the rule, and form the group of three; in the run's first round,
    nobody is expected (peers still starting have published nothing) and the close is waited for as well. In
    round 2 its record still says round 1, where it did not register: it costs no second wait."""
    matchmakers = _matchmakers(dhts, "mm-wait", matchmaking_time=4.0)
    ghost = _matchmakers(dhts, "mm-wait", matchmaking_time=4.0)[0]
    ghost.peer_id = "peer-ghost"
    _publish_and_wait(matchmakers, 1, extra=ghost)
    with caplog.at_level(logging.INFO, logger="pulseloco.loco.matchmaking"):
        for round_index in (1, 0):
            started = get_dht_time()
            groups = _form_groups(matchmakers, round_index, timeout=60.0)
            assert all(g is not None and g.members == PEERS for g in groups), (round_index, groups)
            assert get_dht_time() - started >= 4.0  # registration stayed open until the close
        assert "expected peers registered" not in caplog.text
        _publish_and_wait(matchmakers, 2)
        groups = _form_groups(matchmakers, 2, timeout=60.0)
    assert all(g is not None and g.members == PEERS for g in groups), groups
    assert caplog.text.count("all 3 expected peers registered") == 3


def test_a_peer_still_in_the_previous_round_is_waited_for(
    dhts: list[hivemind.DHT], caplog: pytest.LogCaptureFixture
) -> None:
    """Round 2 with matchmaking_time 300 s: three peers start it; a fourth one's record still says round 1 (it is
    finishing that round, or downloading the state as a joiner does). It publishes round 2 and registers 3 s into
    the others' registration: they wait for it (reading the records again), and the group of four goes as soon
    as it has registered, not at the close."""
    matchmakers = _matchmakers(dhts, "mm-behind", matchmaking_time=300.0)
    behind = _matchmakers(dhts, "mm-behind", matchmaking_time=300.0)[0]
    behind.peer_id = "peer-behind"
    behind.publish_state(1, "d0")
    _publish_and_wait(matchmakers, 2)
    deadline = time.monotonic() + 30.0
    while not all(any(s.peer_id == "peer-behind" for s in m.read_states()) for m in matchmakers):
        assert time.monotonic() < deadline, "the fourth peer's record did not reach the others within 30 s"
        time.sleep(0.1)
    late: list[Group | None] = []

    def catch_up() -> None:
        time.sleep(3.0)
        behind.publish_state(2, "d0")
        late.append(behind.form_group(2, get_dht_time() + 600.0, "d0"))

    thread = threading.Thread(target=catch_up, daemon=True)
    thread.start()
    with caplog.at_level(logging.INFO, logger="pulseloco.loco.matchmaking"):
        groups = _form_groups(matchmakers, 2, timeout=60.0)
    thread.join(60.0)
    assert not thread.is_alive() and late, "the late peer's form_group did not return"
    everyone = tuple(sorted((*PEERS, "peer-behind")))
    assert all(g is not None and g.members == everyone for g in [*groups, *late]), (groups, late)
    assert caplog.text.count("all 4 expected peers registered") == 4  # the late peer too


def test_differing_views_are_compared_in_whole_and_merged(
    dhts: list[hivemind.DHT], caplog: pytest.LogCaptureFixture
) -> None:
    """The view check compares digests of the member lists (one short record per member); peer-c missed peer-b's
    registration, so its digest differs: the peers then read the whole lists, merge them and agree on all three at
    the second attempt."""
    members = {peer: (False, "d0") for peer in PEERS}
    assert view_hash(members) == view_hash(dict(reversed(members.items())))  # the order of the entries is not hashed
    assert view_hash(members) != view_hash({**members, "peer-a": (True, "d0")})
    seen = [members, members, {p: v for p, v in members.items() if p != "peer-b"}]
    matchmakers = _matchmakers(dhts, "mm-views", matchmaking_time=4.0)
    groups: list[Group | None] = [None] * 3
    expiration = get_dht_time() + 600.0

    def agree(i: int) -> None:
        groups[i] = matchmakers[i]._agree(5, seen[i], expiration)

    threads = [threading.Thread(target=agree, args=(i,), daemon=True) for i in range(3)]
    with caplog.at_level(logging.INFO, logger="pulseloco.loco.matchmaking"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60.0)
    assert all(g is not None and g.members == PEERS for g in groups), groups
    assert caplog.text.count("views agreed after 1 retries") == 3, caplog.text
    # what every peer reads first is one digest per member, not every member's whole list
    digests = matchmakers[0]._get(matchmakers[0]._key(5, "view0"))
    assert sorted(digests) == sorted(PEERS) and all(set(value) == {"hash"} for value, _ in digests.values())


def test_a_peer_the_others_went_without_knows_it_was_seen_too_late(dhts: list[hivemind.DHT]) -> None:
    """matchmaking_time is 300 s: two peers expect only each other (the third has published no state yet, as a
    joiner still downloading it) and their group goes at once. The third then publishes and registers well before
    the close; their views leave it out, so it sits the round out with ``seen_too_late`` set and ``late_by`` 0
    (``PulseLoCo`` then ends its phase early, as for a late registration: ``_realign``)."""
    first, second, joiner = _matchmakers(dhts, "mm-seen-late", matchmaking_time=300.0)
    _publish_and_wait([first, second], 1)
    groups = _form_groups([first, second], 1, timeout=60.0)
    assert all(g is not None and g.members == PEERS[:2] for g in groups), groups
    assert not first.seen_too_late and not second.seen_too_late
    joiner.publish_state(1, "d0")
    assert joiner.form_group(1, get_dht_time() + 600.0, "d0") is None
    assert joiner.seen_too_late and joiner.late_by == 0.0


def test_a_member_that_died_after_registering_is_not_waited_for_in_the_view_check(
    dhts: list[hivemind.DHT], caplog: pytest.LogCaptureFixture
) -> None:
    """A fourth peer (its own DHT process and daemon, a real peer id) registers for the round and then dies with
    its DHT before publishing its view, as a trainer killed in a 16-peer WAN run did. The two others see its
    registration, ping it once its view is missing for ``VIEW_PROBE_AFTER`` seconds, are refused, and form their
    group without it in seconds, not after ``request_timeout`` (30 s here)."""
    first, second, _ = _matchmakers(dhts, "mm-died", matchmaking_time=2.0)
    for matchmaker in (first, second):
        matchmaker.request_timeout = 30.0
    maddrs = [str(a) for a in dhts[0].get_visible_maddrs()]
    doomed_dht = hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    doomed = _matchmakers([doomed_dht, *dhts[1:]], "mm-died", matchmaking_time=2.0)[0]
    doomed.peer_id = str(doomed_dht.peer_id)
    try:
        registration = {"client": False, "t": get_dht_time(), "digest": "d0"}
        assert doomed._store(doomed._key(0, "peers"), doomed.peer_id, registration, get_dht_time() + 600.0)
    finally:
        doomed_dht.shutdown()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="pulseloco.loco.matchmaking"):
        groups = _form_groups([first, second], 0, timeout=60.0)
    elapsed = time.monotonic() - started
    assert all(g is not None and g.members == PEERS[:2] for g in groups), groups
    assert elapsed < 15.0, elapsed
    assert caplog.text.count("whose ping was refused") == 2, caplog.text
