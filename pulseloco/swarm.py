"""Building a hivemind DHT from configuration: bootstrap peers, listen/announce addresses, identity, NAT.

A peer with a public address listens on ``host_maddrs`` (for example ``/ip4/0.0.0.0/tcp/31337``) and tells
others ``announce_maddrs``; volunteers behind NAT join with ``initial_peers`` only and run in ``client_mode``
(they connect out; they serve nothing). A persistent ``identity`` file keeps the peer id (and so the bootstrap
multiaddr) stable across restarts.

Reachable through a relay (``use_auto_relay``): a volunteer behind NAT reserves a slot on a circuit relay (by
default its initial peers; every public hivemind peer with ``use_relay`` serves as one) and is then reachable
at ``/ip4/RELAY/tcp/PORT/p2p/RELAY_ID/p2p-circuit/p2p/ITS_ID``: other peers can open streams to it, so it can
own shards and relay PULSESync objects although nobody can dial it directly. Measured in network namespaces
behind iptables MASQUERADE (``tests/test_nat.py``): left to libp2p's defaults, hivemind's daemon looks for relay
candidates in its DHT and waits about 3 minutes (go-libp2p autorelay's boot delay, for 4 candidates) before it
reserves a slot with the one it knows; given the relays as static relays (daemon flags ``-trustedRelays``
with ``-relayDiscovery=0``, and reachability forced private, since AutoNAT needs several public peers to
decide) it holds a relay address as soon as the DHT has started. :func:`is_reachable` says whether a running
DHT can be dialed by others (server mode, or a relay address).

The default (``use_auto_relay=None``, "auto") is one rule: **a client-mode peer reserves a relay slot when it
knows a relay with a public address** (``relays``, else its initial peers), so a volunteer behind NAT needs
only ``client_mode`` and the initial peers. Relays known only by loopback or private addresses are skipped:
libp2p builds relay addresses only through public relays, so such a reservation could never make the peer
reachable and would only delay its start (this is what keeps client-mode peers on 127.0.0.1, as in the tests,
as fast as before). ``use_auto_relay=False`` (``--use_auto_relay false``) or
``use_relay=False`` (``--use_relay false``, ``--no_use_relay``) opts out; ``True`` forces a reservation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from pulseloco.errors import ConfigError, SwarmUnreachableError

logger = logging.getLogger(__name__)

__all__ = [
    "SwarmConfig",
    "SwarmKeyValidator",
    "is_reachable",
    "latest_maddrs",
    "load_swarm_key",
    "make_dht",
    "new_swarm_key",
    "parse_maddrs",
]

_TAG_MAGIC = b"[plswarm]"
_TAG_BYTES = 32


def new_swarm_key(path: str | os.PathLike[str]) -> Path:
    """Write a new random 256-bit swarm key (hex, mode 0600). Raises :class:`ConfigError` if it exists."""
    target = Path(path)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{target} already exists; refusing to overwrite a swarm key") from None
    except OSError as exc:
        raise ConfigError(f"cannot write swarm key {target}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return target


def load_swarm_key(path: str | os.PathLike[str]) -> bytes:
    """Read a swarm key file (64 hex characters). Raises :class:`ConfigError` saying what is wrong."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read swarm key {path}: {exc.strerror} (make one with `pulseloco dht --new-swarm-key`)"
        ) from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError(f"{path} is not a swarm key (expected 64 hex characters)")
    return key


class SwarmKeyValidator(RecordValidatorBase):
    """Swarm authorization: every DHT record carries an HMAC-SHA256 under the swarm's shared key.

    Records without a valid tag are refused when stored and ignored when read, so only holders of the key can
    announce themselves, match into averaging groups or publish heads; strangers who connect see nothing
    they can act on and cannot poison the DHT. (Payload streams carry their own checks: group membership for
    PULSELoCo, publisher signatures for PULSESync.)
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ConfigError("swarm key must be 32 bytes")
        self._key = key

    def _tag(self, record: DHTRecord, value: bytes) -> bytes:
        message = MSGPackSerializer.dumps((record.key, record.subkey, value, record.expiration_time))
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + _TAG_MAGIC + self._tag(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        value = record.value
        suffix = len(_TAG_MAGIC) + _TAG_BYTES
        if len(value) < suffix or value[-suffix:-_TAG_BYTES] != _TAG_MAGIC:
            return False
        stripped = value[:-suffix]
        return hmac.compare_digest(
            value[-_TAG_BYTES:], self._tag(dataclasses.replace(record, value=stripped), stripped)
        )

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[: -(len(_TAG_MAGIC) + _TAG_BYTES)]

    @property
    def priority(self) -> int:
        return 100  # signs last (covering other validators' signatures), validates first

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def parse_maddrs(values: Sequence[str], what: str) -> list[str]:
    """Validate multiaddrs; raises :class:`ConfigError` naming the flag and the bad value."""
    out = []
    for value in values:
        for item in value.replace(",", " ").split():
            try:
                Multiaddr(item)
            except Exception as exc:  # multiaddr raises several unrelated types for bad input
                raise ConfigError(
                    f"{what}: {item!r} is not a multiaddr ({exc}); expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
                ) from None
            out.append(item)
    return out


def _help(text: str, **argparse_kwargs: object) -> dict[str, object]:
    """A field's ``metadata``: its ``--help`` text (and argparse settings) for ``HfArgumentParser``."""
    return {"help": text, **argparse_kwargs}


@dataclass(kw_only=True)
class SwarmConfig:
    """How this process joins the swarm: the one definition of the swarm options.

    Every field is a command-line option of the recipes (``--initial_peers``, through
    :class:`pulseloco.integrations.args.SwarmArguments`) and of the ``pulseloco`` command (``--initial-peers``;
    ``HfArgumentParser`` accepts both spellings), with the help text in its ``metadata``. Raises
    :class:`ConfigError` naming the option when a value is bad or the options contradict each other.
    """

    initial_peers: list[str] = field(
        default_factory=list,
        metadata=_help(
            "Multiaddrs of peers in the swarm (/ip4/.../tcp/.../p2p/..., printed by `pulseloco dht` or a peer); "
            "none: start a new swarm."
        ),
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
        metadata=_help("Addresses to listen on (/ip4/0.0.0.0/tcp/PORT for a publicly reachable peer)."),
    )
    announce_maddrs: list[str] = field(
        default_factory=list,
        metadata=_help("Addresses others should dial (the public address of a host behind port forwarding)."),
    )
    identity: str | None = field(
        default=None,
        metadata=_help("Identity file that keeps the peer id and multiaddr across restarts (created if missing)."),
    )
    client_mode: bool = field(
        default=False,
        metadata=_help(
            "Behind NAT: connect out only (needs initial_peers); by default reachable through a relay slot on a "
            "public initial peer (see use_auto_relay), else it serves nothing."
        ),
    )
    use_relay: bool = field(
        default=True,
        metadata=_help(
            "Allow relayed connections (needed to reach peers behind NAT) and serve as a relay for others "
            "(--use_relay false / --no_use_relay turns both off)."
        ),
    )
    use_auto_relay: bool | None = field(
        default=None,
        metadata=_help(
            "Reserve a slot on a relay (the initial peers, or relays) and be reachable through it, so that a peer "
            "behind NAT can own shards and relay weights to rollout workers. Default (auto): on for a client-mode "
            "peer that knows a relay with a public address; false: never; a bare flag or true: always (needs "
            "use_relay and a relay).",
            nargs="?",  # a bare --use_auto_relay means true, as for the other bool options
            const=True,
        ),
    )
    relays: list[str] = field(
        default_factory=list,
        metadata=_help("Relays to reserve a slot on (multiaddrs with /p2p/ID); none: the initial peers."),
    )
    rejoin_interval: float = field(
        default=30.0,
        metadata=_help(
            "Seconds between pings of the initial peers, which keep this peer in their routing tables and them in "
            "its own, so that the two sides of a network partition find each other again once it heals; 0: never."
        ),
    )
    relay_wait: float = field(
        default=15.0,
        metadata=_help("When reserving a relay slot: seconds to wait for the relay address (warns if none)."),
    )
    startup_timeout: float = field(
        default=30.0, metadata=_help("Seconds to start the DHT and reach the initial peers.")
    )
    swarm_key: str | None = field(
        default=None,
        metadata=_help("Swarm key file: only its holders write DHT records the others accept."),
    )

    def __post_init__(self) -> None:
        self.initial_peers = parse_maddrs(self.initial_peers, "initial_peers")
        self.host_maddrs = parse_maddrs(self.host_maddrs, "host_maddrs")
        self.announce_maddrs = parse_maddrs(self.announce_maddrs, "announce_maddrs")
        self.relays = parse_maddrs(self.relays, "relays")
        if not (self.startup_timeout > 0 and math.isfinite(self.startup_timeout)):
            raise ConfigError(f"startup_timeout must be a positive number of seconds, got {self.startup_timeout}")
        if not (self.rejoin_interval >= 0 and math.isfinite(self.rejoin_interval)):
            raise ConfigError(f"rejoin_interval must be a number of seconds >= 0, got {self.rejoin_interval}")
        if not self.relay_wait >= 0:
            raise ConfigError(f"relay_wait must be a non-negative number of seconds, got {self.relay_wait}")
        if self.client_mode and not self.initial_peers:
            raise ConfigError("client_mode needs initial_peers: a peer behind NAT cannot start a swarm")
        if self.use_auto_relay and not self.use_relay:
            raise ConfigError(
                "use_auto_relay needs use_relay: relayed connections are how others reach this peer "
                "(drop --use_relay false, or drop use_auto_relay)"
            )
        if self.use_auto_relay and not self.auto_relays():
            raise ConfigError(
                "use_auto_relay needs a relay: give initial_peers (/p2p/PEER_ID multiaddrs; public peers relay) "
                "or relays"
            )
        for maddr in self.relays:
            if "/p2p/" not in maddr:
                raise ConfigError(f"relays: {maddr!r} has no /p2p/PEER_ID part; a relay is dialed by its peer id")
        if self.relays and not self.reserves_relay():
            if self.use_auto_relay is False or not self.use_relay:
                why = "use_auto_relay is false" if self.use_relay else "use_relay is off"
            elif not self.client_mode:
                why = "this peer is not in client_mode (only client-mode peers reserve a slot by default)"
            else:
                why = "none of them has a public address (libp2p builds relay addresses only through public relays)"
            raise ConfigError(
                f"relays is set but no relay slot will be reserved: {why}; drop relays or set use_auto_relay true"
            )

    def auto_relays(self) -> list[str]:
        """The relays a reservation is made on: ``relays``, or the initial peers with a peer id."""
        return list(self.relays) or [m for m in self.initial_peers if "/p2p/" in m]

    def reserves_relay(self) -> bool:
        """Whether :func:`make_dht` reserves a relay slot: ``use_auto_relay`` when set; in auto (``None``), when
        this peer is in ``client_mode`` with ``use_relay`` and one of :meth:`auto_relays` has a public address
        (see :func:`has_public_address`)."""
        if self.use_auto_relay is not None:
            return self.use_auto_relay
        return self.client_mode and self.use_relay and any(has_public_address(m) for m in self.auto_relays())


def has_public_address(maddr: str) -> bool:
    """Whether ``maddr`` is a public address as libp2p counts it for relay addresses: a DNS name, or a global
    IPv4/IPv6 address (not loopback, RFC 1918, link-local, carrier-grade NAT or documentation ranges).
    An address that does not parse counts as not public."""
    parts = maddr.split("/")
    if len(parts) < 3:
        return False
    proto, host = parts[1], parts[2]
    if proto in ("dns", "dns4", "dns6", "dnsaddr"):
        return not host.endswith("localhost")
    if proto not in ("ip4", "ip6"):
        return False
    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        return False


_STATIC_RELAYS_INSTALLED = False


def _install_static_relays() -> None:
    """Make hivemind's daemon treat ``trusted_relays`` as static relays (idempotent).

    ``hivemind.P2P.create`` passes ``trusted_relays`` as p2pd's ``-trustedRelays`` but never
    ``-relayDiscovery=0``, so the daemon feeds them to go-libp2p's autorelay as discovery candidates, which
    waits about 3 minutes for 4 of them before reserving with fewer. With discovery off, the daemon uses them as
    static relays and reserves at once. Only daemons started with ``-autoRelay`` and ``-trustedRelays`` (which
    only :func:`make_dht` passes, when it reserves a relay slot) are affected; hivemind's DHT forks its process,
    so the patch made here reaches the daemon it starts.
    """
    global _STATIC_RELAYS_INSTALLED
    if _STATIC_RELAYS_INSTALLED:
        return
    from hivemind.p2p import P2P

    original = P2P._make_process_args

    def make_process_args(*args: object, **kwargs: object) -> list[str]:
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return original(*args, **kwargs)

    P2P._make_process_args = staticmethod(make_process_args)
    _STATIC_RELAYS_INSTALLED = True


ADDRESS_TIMEOUT_S = 10.0
"""Seconds to wait for the DHT process to say which addresses its daemon holds now (:func:`latest_maddrs`)."""


async def _daemon_maddrs(_dht: hivemind.DHT, node: Any) -> list[Any]:
    """Runs in the DHT process: the addresses its daemon holds now."""
    return list(await node.get_visible_maddrs(latest=True))


def latest_maddrs(dht: hivemind.DHT, timeout: float = ADDRESS_TIMEOUT_S) -> list[str]:
    """The addresses ``dht``'s daemon holds now (asked of the daemon, not hivemind's list cached at start).

    ``hivemind.DHT.get_visible_maddrs`` waits for its answer without a limit; on a loaded machine the DHT process
    has been seen to drop such a request (its task destroyed while pending: "Task was destroyed but it is
    pending!"), and the caller then waited forever (a relaying subscriber's announcer thread, which never
    announced again). This asks the same thing with a limit: raises ``TimeoutError`` after ``timeout`` s (the
    request is cancelled), and whatever the DHT process raises.
    """
    future = dht.run_coroutine(_daemon_maddrs, return_future=True)
    try:
        return [str(m) for m in future.result(timeout)]
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the DHT process did not report its addresses within {timeout:.0f} s") from None


def is_reachable(dht: hivemind.DHT) -> bool:
    """Whether other peers can open streams to ``dht``'s peer: it runs in server mode (it was told to listen
    where others can dial), or it holds a relay address now (``/p2p-circuit``, from a relay reservation; the
    daemon is asked, not hivemind's list cached at start).

    A client-mode peer without a relay address is behind NAT as far as anyone can tell: it must not offer to
    serve anything. Errors asking the DHT process for its addresses, and no answer within
    :data:`ADDRESS_TIMEOUT_S`, count as not reachable (logged).
    """
    if not dht.client_mode:
        return True
    try:
        maddrs = latest_maddrs(dht)
    except Exception as exc:  # the DHT process is gone or stuck: we cannot vouch for reachability
        logger.warning("cannot read this peer's addresses (%r); treating it as unreachable", exc)
        return False
    return any("/p2p-circuit" in m for m in maddrs)


def make_dht(config: SwarmConfig) -> hivemind.DHT:
    """Start a DHT process for ``config``.

    When ``config.reserves_relay()`` (a client-mode peer that knows a public relay, or ``use_auto_relay``), the
    daemon reserves a slot on ``config.auto_relays()`` (static relays, reachability forced private) and the DHT
    is returned once it holds a relay address, or after ``config.relay_wait`` s with a warning that says what to
    check (the peer is then unreachable, see :func:`is_reachable`, and trains in client mode). The daemon is
    not restarted to ask again: a relay that refused keeps refusing for its reservation TTL (an hour), and every
    new daemon takes another of the relay's 8 slots per public IP. Raises :class:`SwarmUnreachableError` with what
    to check when no initial peer answers, :class:`ConfigError` when a daemon without initial peers cannot start
    (its ``host_maddrs``).
    """
    relay = config.reserves_relay()
    kwargs: dict = {
        "host_maddrs": config.host_maddrs,
        "client_mode": config.client_mode,
        "use_relay": config.use_relay,
        "use_auto_relay": relay,
        "startup_timeout": config.startup_timeout,
        "blacklist_time": BLACKLIST_SECONDS,
        "backoff_rate": 1.0,
    }
    if relay:
        _install_static_relays()
        kwargs["trusted_relays"] = config.auto_relays()
        kwargs["force_reachability"] = "private"
    if config.announce_maddrs:
        kwargs["announce_maddrs"] = config.announce_maddrs
    if config.identity:
        kwargs["identity_path"] = config.identity
    validators = [SwarmKeyValidator(load_swarm_key(config.swarm_key))] if config.swarm_key else []
    dht = _start_dht(config, validators, kwargs)
    if relay:
        maddrs = _wait_for_relay_address(dht, config)
    else:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
    logger.info("joined swarm peer_id=%s maddrs=%s", dht.peer_id, maddrs)
    initial = sorted({m.split("/p2p/")[-1] for m in config.initial_peers if "/p2p/" in m} - {str(dht.peer_id)})
    if config.rejoin_interval > 0 and initial:
        dht.run_coroutine(functools.partial(_keep_in_touch, peer_ids=initial, period=config.rejoin_interval))
    return dht


async def _keep_in_touch(_dht: hivemind.DHT, node: Any, *, peer_ids: list[str], period: float) -> None:
    """Start, in the DHT process, a task that pings ``peer_ids`` (the initial peers) every ``period`` s (+-20%),
    and looks up this node's own neighbourhood through them when one answers. A ping adds each side to the other's
    routing table; the lookup then finds the peers the initial peers know. Without it, a network partition that
    heals can leave two DHTs: each side dropped the other's nodes from its routing tables while they were cut
    off, and nothing makes them meet again (4 WAN trainers cut 2 against 2 averaged as two pairs for every round
    after the heal). When an initial peer answers after none did (this node was cut off), the node's blacklist
    of peers that did not answer is cleared first, so the lookup and the ones after it reach them again at once.
    A peer that does not answer is skipped until the next period (hivemind logs its failures at
    debug level); the task ends with the DHT process."""
    from hivemind.p2p import PeerID

    peers = [PeerID.from_base58(peer_id) for peer_id in peer_ids]
    cut_off = False

    async def loop() -> None:
        nonlocal cut_off
        while node.is_alive:
            await asyncio.sleep(period * random.uniform(0.8, 1.2))
            answered = [peer for peer in peers if await node.protocol.call_ping(peer) is not None]
            if answered and cut_off:  # back from a cut: nodes that failed meanwhile may answer again
                logger.info("an initial peer answers again: looking up the swarm's nodes afresh")
                node.blacklist.clear()
            cut_off = not answered
            if answered:
                await node.find_nearest_nodes([node.node_id])

    _TASKS.append(asyncio.create_task(loop()))


BLACKLIST_SECONDS = 5.0
"""Seconds a DHT node leaves out of its lookups a node that did not answer, each time (hivemind's default, without
its doubling per failure: after a network partition of 18 s the doubled bans outlasted the heal by tens of seconds,
each side's lookups skipped the other's nodes, and 4 WAN trainers split 2 against 2 averaged as two pairs to the end
of the run, in 1 of 2 runs). A dead node costs one timed-out request per period in the lookups that reach it."""

_TASKS: list[asyncio.Task[None]] = []
"""The DHT process's keep-in-touch tasks (a reference keeps a running task from being garbage-collected)."""


BOOTSTRAP_ATTEMPTS = 5
"""Daemon starts :func:`make_dht` tries when no initial peer answers (p2pd gives up on its initial peers after
10 s, hivemind's DHT node on their pings after a few seconds: a loaded machine, a slow link or a passing network
fault can miss that once; of 16 peers starting at once behind 100 ms links on 2 cores, most missed it once or
twice), while within ``startup_timeout`` (the bound that counts: each try takes seconds). A start that never
connected holds no relay reservation, so trying again costs the relays nothing."""
_BOOTSTRAP_FAILED = (
    "failed to connect to bootstrap peers",  # p2pd's message, in hivemind's P2PDaemonError
    "none of the initial_peers responded to a ping",  # hivemind's DHTNode: connected, but no DHT answer in time
)


def _start_dht(config: SwarmConfig, validators: list[RecordValidatorBase], kwargs: dict) -> hivemind.DHT:
    """Start a ``hivemind.DHT``; raises :class:`SwarmUnreachableError` (initial peers given) or
    :class:`ConfigError` (none: the host addresses) with a hint when it fails.

    When the daemon connects to none of the initial peers, or none answers the DHT node's ping, it is started
    again, up to :data:`BOOTSTRAP_ATTEMPTS`
    times in all and while ``config.startup_timeout`` s have not passed since the first try, with a warning each
    time; any other failure is raised at once."""
    started = time.monotonic()
    for attempt in range(1, BOOTSTRAP_ATTEMPTS + 1):
        try:
            return hivemind.DHT(
                initial_peers=config.initial_peers or None, start=True, record_validators=validators, **kwargs
            )
        except Exception as exc:  # hivemind surfaces daemon and bootstrap failures as assorted exceptions
            again = (
                any(message in str(exc) for message in _BOOTSTRAP_FAILED)
                and attempt < BOOTSTRAP_ATTEMPTS
                and time.monotonic() - started + attempt < config.startup_timeout
            )
            if again:
                logger.warning(
                    "no initial peer answered (attempt %d of %d); starting the daemon again in %d s",
                    attempt,
                    BOOTSTRAP_ATTEMPTS,
                    attempt,
                )
                time.sleep(attempt)
                continue
            if not config.initial_peers:  # a daemon of our own that did not start: its addresses are the cause
                raise ConfigError(
                    f"could not start the swarm: {exc}; check --host-maddrs (address in use? not a local address?)"
                ) from None
            raise SwarmUnreachableError(
                f"could not join the swarm: {exc}; check that --initial-peers is the exact multiaddr printed by the "
                "bootstrap node and that it is reachable"
            ) from None
    raise AssertionError("unreachable: the last attempt returns or raises")


def _wait_for_relay_address(dht: hivemind.DHT, config: SwarmConfig) -> list[str]:
    """Poll the daemon's current addresses until one is a relay address (``/p2p-circuit``), for at most
    ``config.relay_wait`` s; a peer still without one is logged as unreachable (a warning naming the relays and
    what to check), not raised: it can still train in client mode. Returns the last addresses read.

    The addresses are asked of the daemon each time (``latest=True``): hivemind caches the list it read when
    the daemon started, which holds the relay address only if the reservation won the race against that first
    read (it lost in about one start in four on loaded machines, and the peer then counted itself unreachable
    for its whole life although others could dial it through the relay)."""
    deadline = time.monotonic() + config.relay_wait
    while True:
        try:
            maddrs = latest_maddrs(dht)
        except TimeoutError as exc:  # asked again below, until the deadline
            logger.warning("%s; asking again", exc)
            maddrs = []
        if any("/p2p-circuit" in m for m in maddrs):
            return maddrs
        if time.monotonic() >= deadline:
            logger.warning(
                "no relay reservation within %.0f s on %s: this peer is not reachable through a relay, so it serves "
                "nothing. Check that the relays run with relaying on (use_relay) and are reachable from here; "
                "a relay refuses more than 8 reservations per public IP address within an hour (go-libp2p's limit: "
                "many volunteers or restarts behind one NAT), so name other public peers with --relays; "
                "--use_auto_relay false skips the reservation",
                config.relay_wait,
                config.auto_relays(),
            )
            return maddrs
        time.sleep(0.2)
