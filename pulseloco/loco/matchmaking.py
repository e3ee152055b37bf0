"""DHT records of PULSELoCo: per-round group formation and each peer's latest (round, digest).

Only small records go through the DHT; payloads travel over libp2p streams (:mod:`pulseloco.loco.averaging`).

Group formation for round ``r`` (all keys are prefixed by the run id): a registration set closed at a DHT-time
deadline, then a check that every member computed the same group before any payload moves.

1. every peer registers under ``pulseloco:{run_id}:loco:r{r}:peers`` (:func:`pulseloco.keys.loco_round_key`;
   subkey: its peer id, value: its client mode, the DHT time ``t`` of its registration and the digest of the theta
   it starts the round from);
2. registration for the round closes ``matchmaking_time`` after the earliest registration: the members are the
   registrations with ``t`` at or before the close. A peer reads registrations until the close has passed,
   until ``target_group_size`` members are seen, or, with ``close_when_expected`` in a running swarm, until
   every **expected** peer has registered (:meth:`Matchmaker.expected_peers`): the peers whose state records say
   they start this round (they completed the previous one, or repaired to it) or the previous one (still in it,
   or catching up: a joiner's or restarted peer's record says where it got to), except those that were
   expected in the previous round, did not register, and have not moved since (dead: one wait, not two); when
   they are two or more and the round is not the run's first (there, peers still starting have published
   nothing yet; a peer expecting only itself waits for others as before). The records are read again every
   :data:`STATE_REREAD` seconds while registration is open, so a peer that publishes meanwhile is waited for
   too. A peer that registered after the close sits the round out;
3. every member publishes the member list it computed under ``pulseloco:{run_id}:loco:r{r}:view0full``, then
   its digest (:func:`view_hash`) under ``...:view0``, and reads the others' digests for at most
   ``request_timeout``: a read returns one short record per member, not every member's whole list (``P``
   records, not ``P^2`` entries: at 256 peers each read of whole lists was 5.9 MB, experiments/wan's round
   simulation). Equal digests make the group (members that published nothing in time are left out: they died or
   stalled before the round began; a server-mode member whose ping is refused is not waited for after
   :data:`VIEW_PROBE_AFTER` seconds); only when some differ does the peer read the whole lists under ``view0full``
   to compare and merge them. If the others agree on a group without this peer, it sits the round out.
   Differing lists (a registration some saw and others did not) are merged and compared again under ``view1``,
   ``view2`` (:data:`VIEW_ATTEMPTS` in all); if they still differ, or the merged group is not confirmed by every
   member, the peer sits the round out;
4. of the agreed members, those starting from the most common theta digest average (ties: one a server-mode
   member holds, then the smallest: :func:`pulseloco.loco.consensus.preferred_digest`);
   a member starting from another theta (it missed a repair) sits the round out, so that every peer completing a
   round ends on the same theta;
5. a group needs a server-mode member to own shards; a group of client-mode peers only sits the round out and
   says that one volunteer must be reachable.

Every peer applies the same rule to the same records, so peers whose views differ by a little (a registration
seen late) still end with one group; a disagreement the views cannot settle is seen before any payload moves.
A peer that sits a round out keeps its entries in its residual; the state records then tell it that it is
behind, and it downloads the state. Views that still disagree (a DHT partition) are caught by the group id
carried in every averaging request and, at worst, by the digest check after the round. DHT time is each
peer's clock: registrations from a machine whose clock runs far ahead look late.

State records live under ``pulseloco:{run_id}:loco:state`` (:func:`pulseloco.keys.loco_state_key`): subkey peer id,
value ``{"round", "digest", "client", "complete", "disputed", "rounds"}`` (``disputed``: owners whose average the peer
refused as poisoned, and contributors its shard excluded for repeated outliers (:mod:`pulseloco.loco.robust`); no
peer repairs its state from a disputed peer; ``rounds``: the peer's last
:data:`MAX_ROUND_RECORDS` rounds as :class:`RoundRecord` lists, for monitors such as ``pulseloco monitor``). Readers
ignore keys they do not know (:mod:`pulseloco.loco.peers` parses them). Records come from strangers:
:meth:`Matchmaker.read_state_records` skips malformed ones (and drops a malformed ``rounds`` alone, keeping the
peer's vote) and counts them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import xxhash
from hivemind.utils import get_dht_time

from pulseloco.keys import loco_round_key, loco_state_key
from pulseloco.loco.consensus import preferred_digest
from pulseloco.loco.peers import MAX_DISPUTED, MAX_ROUND_RECORDS, PeerState, RoundRecord, StateRecords, parse_state

logger = logging.getLogger(__name__)

__all__ = [
    "VIEW_ATTEMPTS",
    "Group",
    "Matchmaker",
]

VIEW_ATTEMPTS = 3
"""How many times members compare their views of a round's group before sitting the round out."""
STATE_REREAD = 1.0
"""Seconds between two reads of the state records while a round's registration is open and some expected peer
has not registered (``close_when_expected``): a peer that publishes meanwhile is waited for too."""
VIEW_PROBE_AFTER = 2.0
"""Seconds the view check waits for a server-mode member's view before pinging it, and between two pings: a member
whose ping is refused (not timed out) is not waited for any longer. A trainer killed after it registered cost every
other member ``request_timeout`` (10 s) in a 16-peer WAN run."""


async def _ping_refused(_dht: Any, node: Any, peer: str) -> bool:
    """In the DHT process: whether a ping of ``peer`` failed before half the DHT's request timeout (its process is
    gone: the connection was refused or reset, or libp2p backs off dialing it after such failures). A ping that
    answers or times out (a loaded peer, a slow link), and a peer id that does not parse, give ``False``."""
    from hivemind.p2p import PeerID

    try:
        peer_id = PeerID.from_base58(peer)
    except Exception:  # not a libp2p peer id (never raises)
        return False
    started = time.monotonic()
    answered = await node.protocol.call_ping(peer_id)
    return answered is None and time.monotonic() - started < node.protocol.wait_timeout / 2


@dataclass(frozen=True)
class Group:
    """The peers that average together in one round.

    ``members`` are all participants sorted by peer id (contribution order); ``servers`` the members that own
    shards (not in client mode), sorted.
    """

    round: int
    members: tuple[str, ...]
    servers: tuple[str, ...]
    digest: str = ""
    """The theta digest every member starts the round from."""

    @property
    def group_id(self) -> str:
        """A digest of round, member list and starting theta: every averaging request carries it, mismatches are
        refused."""
        text = f"{self.round}|{','.join(self.members)}|{','.join(self.servers)}|{self.digest}"
        return xxhash.xxh3_64_hexdigest(text.encode())


def view_hash(members: dict[str, tuple[bool, str]]) -> str:
    """The digest of a member list (peer id -> (client mode, start digest)) that members compare in the view check:
    xxh3-128 of the sorted entries, the same on every peer for the same list."""
    text = "\n".join(f"{peer}|{int(client)}|{digest}" for peer, (client, digest) in sorted(members.items()))
    return xxhash.xxh3_128_hexdigest(text.encode())


def _parse_view(value: Any) -> dict[str, tuple[bool, str]] | None:
    """A member list published under a ``view`` key (peer id -> [client mode, digest]); ``None`` if malformed."""
    view = value.get("members") if isinstance(value, dict) else None
    if not isinstance(view, dict):
        return None
    parsed = {}
    for peer, entry in view.items():
        if not (
            isinstance(peer, str)
            and isinstance(entry, (list, tuple))
            and len(entry) == 2
            and isinstance(entry[0], bool)
            and isinstance(entry[1], str)
        ):
            return None
        parsed[peer] = (entry[0], entry[1])
    return parsed


class Matchmaker:
    """Group formation and state records for one peer, over a running ``hivemind.DHT``.

    Every DHT operation waits at most ``request_timeout`` seconds; a failed store or get is logged and treated
    as "nothing seen", never raised, so that a flaky DHT degrades a round instead of stopping training.
    """

    def __init__(
        self,
        dht: Any,
        *,
        run_id: str,
        peer_id: str,
        client_mode: bool,
        matchmaking_time: float,
        target_group_size: int | None,
        request_timeout: float,
        close_when_expected: bool = True,
        state_ttl: float = 600.0,
        poll_interval: float = 0.05,
    ) -> None:
        self.dht = dht
        self.run_id = run_id
        self.peer_id = peer_id
        self.client_mode = client_mode
        self.matchmaking_time = matchmaking_time
        self.target_group_size = target_group_size
        self.close_when_expected = close_when_expected
        self.request_timeout = request_timeout
        self.state_ttl = state_ttl
        self.poll_interval = poll_interval
        self.rounds: collections.deque[RoundRecord] = collections.deque(maxlen=MAX_ROUND_RECORDS)
        """This peer's latest rounds, published with its state (:meth:`record_round`)."""
        self.no_shows: tuple[int, frozenset[str]] = (-1, frozenset())
        """The last round whose registration closed while some expected peers had not registered, and those peers
        (:meth:`expected_peers` does not wait for them again unless their state record moved on)."""
        self.outvoted_by: frozenset[str] = frozenset()
        """The members that went on without this peer in the last :meth:`form_group` because they start from
        another theta (empty otherwise): the peer waits for their state records after the round and repairs."""
        self.late_by = 0.0
        """Seconds this peer registered after the last :meth:`form_group`'s registration closed (0: in time)."""
        self.seen_too_late = False
        """Whether in the last :meth:`form_group` the other members agreed on a group without this peer: its
        registration reached them after they went (it registered near the close, or after they all had), so its
        phase lags theirs as when :attr:`late_by` is positive."""

    # -- DHT helpers -------------------------------------------------------------------------------------
    def _store(self, key: str, subkey: str, value: Any, expiration: float) -> bool:
        try:
            future = self.dht.store(key, value, expiration_time=expiration, subkey=subkey, return_future=True)
            return bool(future.result(timeout=self.request_timeout))
        except (concurrent.futures.TimeoutError, TimeoutError):
            logger.warning(
                "dht store timed out key=%s timeout=%.1fs (raise request_timeout)", key, self.request_timeout
            )
        except Exception as exc:  # hivemind surfaces daemon and serialization errors as plain exceptions
            logger.warning("dht store failed key=%s error=%r", key, exc)
        return False

    def _get(self, key: str) -> dict[str, Any]:
        """Subkey -> value of ``key`` (expired entries are dropped by the DHT); empty on failure."""
        try:
            result = self.dht.get(key, latest=True, return_future=True).result(timeout=self.request_timeout)
        except (concurrent.futures.TimeoutError, TimeoutError):
            logger.warning("dht get timed out key=%s timeout=%.1fs", key, self.request_timeout)
            return {}
        except Exception as exc:
            logger.warning("dht get failed key=%s error=%r", key, exc)
            return {}
        if result is None or not isinstance(result.value, dict):
            return {}
        out: dict[str, Any] = {}
        for subkey, item in result.value.items():
            if isinstance(subkey, str) and hasattr(item, "value"):
                out[subkey] = (item.value, item.expiration_time)
        return out

    def _refused(self, peer: str) -> bool:
        """Whether ``peer``'s ping was refused (:func:`_ping_refused`); ``False`` when the DHT call fails or takes
        longer than ``request_timeout`` (never raises)."""
        try:
            future = self.dht.run_coroutine(functools.partial(_ping_refused, peer=peer), return_future=True)
            return bool(future.result(timeout=self.request_timeout))
        except Exception as exc:  # a DHT that is shutting down, a timeout: not evidence that the peer is gone
            logger.debug("ping of %s for the view check failed: %r", peer, exc)
            return False

    # -- group formation ----------------------------------------------------------------------------------
    def _key(self, round_index: int, what: str) -> str:
        return loco_round_key(self.run_id, round_index, what)

    def _registrations(self, round_index: int) -> dict[str, tuple[bool, float, str]]:
        """Peer id -> (client mode, DHT time of registration, theta digest) of the well-formed registrations."""
        seen = {}
        for peer, (value, _) in self._get(self._key(round_index, "peers")).items():
            if not isinstance(value, dict):
                continue
            client, registered, digest = value.get("client"), value.get("t"), value.get("digest")
            if (
                isinstance(client, bool)
                and isinstance(registered, (int, float))
                and math.isfinite(registered)
                and isinstance(digest, str)
            ):
                seen[peer] = (client, float(registered), digest)
        return seen

    def form_group(self, round_index: int, expiration: float, digest: str) -> Group | None:
        """Register for ``round_index`` with the digest of the theta this peer starts it from and return the
        group every member agreed on, or ``None`` when this peer sits the round out: it registered after the
        registration closed, no member is in server mode, the members' views still disagreed after
        :data:`VIEW_ATTEMPTS` attempts, or most members start from another theta. Never raises for DHT failures
        (they are logged and look like peers not seen). Takes at most ``matchmaking_time`` plus
        ``VIEW_ATTEMPTS * request_timeout`` seconds (plus the DHT calls' own timeouts); registration ends at once
        when every expected peer has registered (:meth:`expected_peers`).

        ``expiration`` is the DHT time after which the round's records may vanish.
        """
        me, registered = self.peer_id, get_dht_time()
        self.outvoted_by = frozenset()
        self.late_by, self.seen_too_late = 0.0, False
        value = {"client": self.client_mode, "t": registered, "digest": digest}
        self._store(self._key(round_index, "peers"), me, value, expiration)
        expected = self.expected_peers(round_index)
        reread = time.monotonic() + STATE_REREAD
        seen: dict[str, tuple[bool, float, str]] = {me: (self.client_mode, registered, digest)}
        while True:
            seen.update(self._registrations(round_index))
            closes = min(t for _, t, _ in seen.values()) + self.matchmaking_time
            if registered > closes:
                self.late_by = registered - closes
                logger.warning(
                    "round=%d registration closed %.1fs before this peer registered: sitting this round out; its "
                    "entries stay in the residual and the state is downloaded if the others move ahead",
                    round_index,
                    registered - closes,
                )
                return None
            members = {p: (client, d) for p, (client, t, d) in seen.items() if t <= closes}
            if self.target_group_size is not None and len(members) >= self.target_group_size:
                break
            if expected is not None and expected <= members.keys():
                logger.info(
                    "round=%d: all %d expected peers registered, %.1fs after this one and %.1fs before the close: "
                    "the group goes now",
                    round_index,
                    len(expected),
                    get_dht_time() - registered,
                    closes - get_dht_time(),
                )
                break
            if get_dht_time() >= closes + self.poll_interval:  # this read started after the close
                if expected is not None and not expected <= members.keys():
                    self.no_shows = (round_index, frozenset(expected - members.keys()))
                    logger.info(
                        "round=%d: registration closed without %d expected peer(s): %s",
                        round_index,
                        len(self.no_shows[1]),
                        ", ".join(sorted(self.no_shows[1])),
                    )
                break
            if self.close_when_expected and time.monotonic() >= reread:
                expected, reread = self.expected_peers(round_index), time.monotonic() + STATE_REREAD
            time.sleep(max(0.0, min(self.poll_interval, closes + self.poll_interval - get_dht_time())))
        started = time.monotonic()
        group = self._agree(round_index, members, expiration)
        logger.debug(
            "round=%d: view check of %d registrations took %.1fs: %s",
            round_index,
            len(members),
            time.monotonic() - started,
            "no group for this peer" if group is None else f"a group of {len(group.members)}",
        )
        return group

    def expected_peers(self, round_index: int) -> frozenset[str] | None:
        """The peers a round's registration waits for, this peer included: those whose state records say they
        start ``round_index`` or ``round_index - 1`` (still in it, or catching up), less the peers that did not
        register when last expected (:attr:`no_shows`, the previous round) and whose record has not moved past
        ``round_index - 1`` since. ``None`` (wait for the close) without ``close_when_expected``, in the run's
        first round or when no other peer is expected. :meth:`form_group` reads them again every
        :data:`STATE_REREAD` seconds; a peer that registers after the others went sits the round out
        (:meth:`_agree`). A lookup that fails reads as no other peer (never raises)."""
        if not self.close_when_expected or round_index == 0:
            return None
        last, missing = self.no_shows
        starting = {self.peer_id}
        for state in self.read_states():
            gone = last == round_index - 1 and state.peer_id in missing and state.round < round_index
            if state.round in (round_index, round_index - 1) and not gone:
                starting.add(state.peer_id)
        return frozenset(starting) if len(starting) >= 2 else None

    def _agree(self, round_index: int, members: dict[str, tuple[bool, str]], expiration: float) -> Group | None:
        """The view check: every member publishes the member list it computed (peer id -> client mode, digest)
        and reads the others'. Equal views give the group (members that published no view within
        ``request_timeout`` are left out: they died or stalled before the round began); differing views are
        merged and checked again. Of an agreed view, only the members starting from its most common digest
        average (:meth:`_common_start`)."""
        me = self.peer_id
        for attempt in range(VIEW_ATTEMPTS):
            views = self._views(round_index, attempt, members, expiration)
            others = [view for peer, view in views.items() if peer != me]
            if others and all(view == others[0] and me not in view for view in others):
                logger.warning(
                    "round=%d: the other members agreed on a group without this peer (it was seen too late): "
                    "sitting this round out; its entries stay in the residual",
                    round_index,
                )
                self.seen_too_late = True
                return None
            if all(view == members for view in views.values()):
                if attempt and len(views) < len(members):
                    logger.warning(
                        "round=%d: %d member(s) did not confirm the merged group within %.1fs (they went on with "
                        "another): sitting this round out; its entries stay in the residual",
                        round_index,
                        len(members) - len(views),
                        self.request_timeout,
                    )
                    return None
                common = self._common_start(round_index, {p: members[p] for p in views})
                if common is None:
                    return None
                digest, agreed = common
                servers = sorted(p for p, client in agreed.items() if not client)
                if not servers:
                    logger.warning(
                        "round=%d: every peer of the group is in client mode (%d peer(s)), and client-mode peers "
                        "cannot receive connections, so nobody can own a shard: sitting this round out. At least "
                        "one volunteer must be reachable: a --client_mode volunteer reserves a slot on its initial "
                        "peers as a relay when one has a public address (see its log for 'no relay reservation'; "
                        "--use_auto_relay true forces it, --relays MADDR names public relays), or forward a TCP "
                        "port PORT on its router to it and run it without --client_mode, with --host_maddrs "
                        "/ip4/0.0.0.0/tcp/PORT --announce_maddrs /ip4/PUBLIC_IP/tcp/PORT",
                        round_index,
                        len(agreed),
                    )
                    return None
                if attempt:
                    logger.info("round=%d views agreed after %d retries", round_index, attempt)
                return Group(round=round_index, members=tuple(sorted(agreed)), servers=tuple(servers), digest=digest)
            merged = dict(members)
            for view in views.values():
                merged.update(view)
            logger.info(
                "round=%d views disagree (%d distinct among %d members): retrying with %d members",
                round_index,
                len({tuple(sorted(v)) for v in views.values()}),
                len(views),
                len(merged),
            )
            members = merged
        logger.warning(
            "round=%d: the members' views of the group still disagreed after %d attempts (a partitioned DHT?): "
            "sitting this round out; its entries stay in the residual",
            round_index,
            VIEW_ATTEMPTS,
        )
        return None

    def _views(
        self, round_index: int, attempt: int, members: dict[str, tuple[bool, str]], expiration: float
    ) -> dict[str, dict[str, tuple[bool, str]]]:
        """One attempt's views: publish this peer's member list and then its :func:`view_hash`, read the members'
        digests until all are there, ``request_timeout`` passed, or the missing ones are server-mode members whose
        ping was refused (:data:`VIEW_PROBE_AFTER`: they died after registering), and return member -> its list
        for the members whose digest was read (a digest equal to this peer's stands for ``members``; another
        digest's list is read from the whole lists, and one that cannot be read or does not match its digest
        counts as a list of this peer alone: a disagreement that merges nothing, never a silent exclusion). DHT
        failures read as nothing (logged by the DHT helpers); never raises."""
        me, mine = self.peer_id, view_hash(members)
        key, full_key = self._key(round_index, f"view{attempt}"), self._key(round_index, f"view{attempt}full")
        self._store(full_key, me, {"members": {p: list(v) for p, v in members.items()}}, expiration)
        self._store(key, me, {"hash": mine}, expiration)
        deadline = time.monotonic() + self.request_timeout
        probe_at, gone = time.monotonic() + VIEW_PROBE_AFTER, set[str]()
        while True:
            hashes = {me: mine}
            for peer, (value, _) in self._get(key).items():
                found = value.get("hash") if isinstance(value, dict) else None
                if peer in members and isinstance(found, str):
                    hashes[peer] = found
            missing = set(members) - set(hashes) - gone
            if not missing or time.monotonic() >= deadline:
                break
            if time.monotonic() >= probe_at:  # client-mode members cannot be pinged: they are waited for
                refused = {peer for peer in missing if not members[peer][0] and self._refused(peer)}
                probe_at = time.monotonic() + VIEW_PROBE_AFTER
                if refused:
                    logger.info(
                        "round=%d: not waiting for the view of %d member(s) whose ping was refused (gone since "
                        "they registered): %s",
                        round_index,
                        len(refused),
                        ", ".join(sorted(refused)),
                    )
                    gone |= refused
                    continue
            time.sleep(self.poll_interval)
        views: dict[str, dict[str, tuple[bool, str]]] = {p: members for p, h in hashes.items() if h == mine}
        differing = {p: h for p, h in hashes.items() if h != mine}
        if differing:
            whole = self._get(full_key)
            for peer, expected in differing.items():
                view = _parse_view(whole[peer][0]) if peer in whole else None
                # unreadable: a placeholder that disagrees without claiming a group without this peer
                views[peer] = view if view is not None and view_hash(view) == expected else {me: members[me]}
        return views

    def _common_start(
        self, round_index: int, agreed: dict[str, tuple[bool, str]]
    ) -> tuple[str, dict[str, bool]] | None:
        """The :func:`preferred_digest` of an agreed view's members and the members starting from it (peer id ->
        client mode); ``None`` when this peer starts from another theta. Averaging one pseudo-gradient into
        different thetas would leave peers that completed the round on different states; the minority sits the
        round out and repairs from the others afterwards."""
        counts = collections.Counter(digest for _, digest in agreed.values())
        common = preferred_digest([(digest, client) for client, digest in agreed.values()]) or ""
        if agreed[self.peer_id][1] != common:
            logger.warning(
                "round=%d: %d of the %d members start from theta %s, this peer from %s: sitting this round out; its "
                "entries stay in the residual and it repairs from the others",
                round_index,
                counts[common],
                len(agreed),
                common,
                agreed[self.peer_id][1],
            )
            self.outvoted_by = frozenset(p for p, (_, digest) in agreed.items() if digest == common)
            return None
        return common, {p: client for p, (client, digest) in agreed.items() if digest == common}

    # -- state records --------------------------------------------------------------------------------------
    def record_round(self, record: RoundRecord) -> None:
        """Remember one of this peer's rounds; the next :meth:`publish_state` carries the latest
        :data:`MAX_ROUND_RECORDS` of them."""
        self.rounds.append(record)

    def publish_state(
        self, round_index: int, digest: str, complete: bool = True, disputed: tuple[str, ...] = ()
    ) -> None:
        """Announce this peer's latest completed round, the digest of its global parameters, whether that
        round applied every shard, the owners it disputes (at most :data:`MAX_DISPUTED` are sent) and its latest
        rounds (:meth:`record_round`). A failed store is logged, never raised."""
        value = {
            "round": int(round_index),
            "digest": digest,
            "client": self.client_mode,
            "complete": complete,
            "disputed": sorted(disputed)[:MAX_DISPUTED],
            "rounds": [r.to_wire() for r in self.rounds if r.round < round_index],
        }
        self._store(loco_state_key(self.run_id), self.peer_id, value, get_dht_time() + self.state_ttl)

    def read_states(self) -> list[PeerState]:
        """Every peer's latest published state (malformed records are skipped)."""
        return self.read_state_records().states

    def read_state_records(self) -> StateRecords:
        """Every peer's latest published state, with how many records were skipped as malformed and how many
        carried a malformed ``rounds`` list (dropped: the rest of the record is kept). A lookup that fails or
        times out is logged and reads as no records; never raises."""
        states, malformed, malformed_rounds = [], 0, 0
        for peer, (value, _) in self._get(loco_state_key(self.run_id)).items():
            parsed = parse_state(peer, value)
            if parsed is None:
                malformed += 1
                continue
            states.append(parsed[0])
            malformed_rounds += parsed[1]
        if malformed or malformed_rounds:
            logger.debug(
                "state records: %d malformed skipped, %d malformed round lists dropped", malformed, malformed_rounds
            )
        return StateRecords(states, malformed, malformed_rounds)

    def wait_for_states(self, round_index: int, peers: set[str], timeout: float) -> list[PeerState]:
        """Poll the state records until every peer in ``peers`` reported ``round_index`` or later, or
        ``timeout`` seconds passed; return the last records read."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.read_states()
            reported = {s.peer_id for s in states if s.round >= round_index}
            if peers <= reported or time.monotonic() >= deadline:
                return states
            time.sleep(self.poll_interval)
