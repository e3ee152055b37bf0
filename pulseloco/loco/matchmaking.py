"""DHT records of PULSELoCo: per-round group formation and each peer's latest (round, digest).

Only small records go through the DHT; payloads travel over libp2p streams (:mod:`pulseloco.loco.averaging`).

Group formation for round ``r`` (all keys are prefixed by the run id):

1. every peer registers under ``{run_id}_loco_r{r}_peers`` (subkey: its peer id, value: its client mode);
2. it gathers registrations until ``target_group_size`` peers are seen or ``matchmaking_time`` has passed;
3. the leader, the smallest server-mode peer id it has seen, freezes the member list it sees and publishes
   it under ``{run_id}_loco_r{r}_group``, unless a group was published already (the first group wins);
4. every peer adopts the first published group (earliest expiration, then smallest leader id) containing it.

One group per round: a peer that registers after the group was frozen is not in it and sits the round out
(its entries stay in its residual); the state records then tell it that it is behind, and it downloads the
state. Views that still disagree (a DHT partition) are caught
by the group id carried in every averaging request and, at worst, by the digest check after the round.

State records live under ``{run_id}_loco_state``: subkey peer id, value ``{"round", "digest", "client"}``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

import xxhash
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

__all__ = ["Group", "Matchmaker", "PeerState", "majority_digest"]


@dataclass(frozen=True)
class Group:
    """The peers that average together in one round.

    ``members`` are all participants sorted by peer id (contribution order); ``servers`` the members that own
    shards (not in client mode), sorted.
    """

    round: int
    members: tuple[str, ...]
    servers: tuple[str, ...]
    leader: str

    @property
    def group_id(self) -> str:
        """A digest of round and member list: every averaging request carries it, mismatches are refused."""
        text = f"{self.round}|{','.join(self.members)}|{','.join(self.servers)}"
        return xxhash.xxh3_64_hexdigest(text.encode())


@dataclass(frozen=True)
class PeerState:
    """A peer's latest published (round, digest) record."""

    peer_id: str
    round: int
    digest: str
    client_mode: bool


def majority_digest(states: list[PeerState], round_index: int) -> str | None:
    """The digest most peers report for ``round_index``; ties go to the smallest digest, so that every peer
    reading the same records picks the same one. ``None`` if no peer reported that round."""
    counts = collections.Counter(s.digest for s in states if s.round == round_index)
    if not counts:
        return None
    return min(counts, key=lambda d: (-counts[d], d))


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
        state_ttl: float = 600.0,
        poll_interval: float = 0.05,
    ) -> None:
        self.dht = dht
        self.run_id = run_id
        self.peer_id = peer_id
        self.client_mode = client_mode
        self.matchmaking_time = matchmaking_time
        self.target_group_size = target_group_size
        self.request_timeout = request_timeout
        self.state_ttl = state_ttl
        self.poll_interval = poll_interval

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

    # -- group formation ----------------------------------------------------------------------------------
    def _key(self, round_index: int, what: str) -> str:
        return f"{self.run_id}_loco_r{round_index}_{what}"

    def form_group(self, round_index: int, expiration: float) -> Group | None:
        """Register for ``round_index`` and return the group this peer belongs to, or ``None`` if it was left
        out (registered after the group was frozen) or no group was published within ``matchmaking_time +
        request_timeout`` (leader gone). ``expiration`` is the DHT time after which the records may vanish."""
        start = time.monotonic()
        self._store(self._key(round_index, "peers"), self.peer_id, {"client": self.client_mode}, expiration)
        seen: dict[str, bool] = {self.peer_id: self.client_mode}
        while True:
            for peer, (value, _) in self._get(self._key(round_index, "peers")).items():
                if isinstance(value, dict) and isinstance(value.get("client"), bool):
                    seen[peer] = value["client"]
            if self.target_group_size is not None and len(seen) >= self.target_group_size:
                break
            if time.monotonic() - start >= self.matchmaking_time:
                break
            time.sleep(self.poll_interval)
        servers = sorted(p for p, client in seen.items() if not client)
        group_key = self._key(round_index, "group")
        if servers and servers[0] == self.peer_id:
            group, any_published = self._pick_group(round_index)
            if group is not None:
                return group
            if any_published:
                self._log_excluded(round_index)
                return None
            members = sorted(seen)
            self._store(group_key, self.peer_id, {"members": members, "servers": servers}, expiration)
            logger.debug("group frozen round=%d leader=%s num_peers=%d", round_index, self.peer_id, len(members))
        deadline = start + self.matchmaking_time + self.request_timeout
        while True:
            group, any_published = self._pick_group(round_index)
            if group is not None:
                return group
            if any_published:
                self._log_excluded(round_index)
                return None
            if time.monotonic() >= deadline:
                logger.warning(
                    "no group for round=%d within %.1fs: sitting this round out (the leader may be gone; raise "
                    "matchmaking_time if peers often miss rounds)",
                    round_index,
                    self.matchmaking_time + self.request_timeout,
                )
                return None
            time.sleep(self.poll_interval)

    def _log_excluded(self, round_index: int) -> None:
        logger.warning(
            "round=%d group was frozen without this peer (it registered late): sitting this round out; its "
            "entries stay in the residual and the state is downloaded if the others move ahead",
            round_index,
        )

    def _pick_group(self, round_index: int) -> tuple[Group | None, bool]:
        """The first published group containing this peer (earliest expiration, then smallest leader id), and
        whether any well-formed group was published for the round."""
        published = []
        any_published = False
        for leader, (value, expiration) in self._get(self._key(round_index, "group")).items():
            if not isinstance(value, dict):
                continue
            members, servers = value.get("members"), value.get("servers")
            if not (isinstance(members, list) and isinstance(servers, list)):
                continue
            if not all(isinstance(p, str) for p in members + servers) or not set(servers) <= set(members):
                continue
            if not servers:
                continue
            any_published = True
            if self.peer_id in members:
                published.append((expiration, leader, tuple(sorted(members)), tuple(sorted(servers))))
        if not published:
            return None, any_published
        _, leader, members, servers = min(published)
        return Group(round=round_index, members=members, servers=servers, leader=leader), True

    # -- state records --------------------------------------------------------------------------------------
    def publish_state(self, round_index: int, digest: str) -> None:
        """Announce this peer's latest completed round and the digest of its global parameters."""
        value = {"round": int(round_index), "digest": digest, "client": self.client_mode}
        self._store(f"{self.run_id}_loco_state", self.peer_id, value, get_dht_time() + self.state_ttl)

    def read_states(self) -> list[PeerState]:
        """Every peer's latest published state (malformed records are skipped)."""
        states = []
        for peer, (value, _) in self._get(f"{self.run_id}_loco_state").items():
            if not isinstance(value, dict):
                continue
            round_index, digest, client = value.get("round"), value.get("digest"), value.get("client")
            if isinstance(round_index, int) and isinstance(digest, str) and isinstance(client, bool):
                states.append(PeerState(peer, round_index, digest, client))
        return states

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
