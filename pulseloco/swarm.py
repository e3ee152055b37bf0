"""Building a hivemind DHT from configuration: bootstrap peers, listen/announce addresses, identity, NAT.

A peer with a public address listens on ``host_maddrs`` (for example ``/ip4/0.0.0.0/tcp/31337``) and tells
others ``announce_maddrs``; volunteers behind NAT join with ``initial_peers`` only and run in ``client_mode``
(they connect out and use relays; they serve nothing). A persistent ``identity_path`` keeps the peer id (and so
the bootstrap multiaddr) stable across restarts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import hivemind
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from pulseloco.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "SwarmConfig",
    "SwarmKeyValidator",
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


@dataclass(kw_only=True)
class SwarmConfig:
    """How this process joins the swarm."""

    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of peers already in the swarm (``/ip4/.../tcp/.../p2p/...``); empty to start a new swarm."""
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    """Addresses to listen on; ``/ip4/0.0.0.0/tcp/PORT`` for a publicly reachable peer."""
    announce_maddrs: list[str] = field(default_factory=list)
    """Addresses others should dial (the public address of a host behind port forwarding)."""
    identity_path: str | None = None
    """Private key file that fixes the peer id across restarts (created if missing)."""
    client_mode: bool = False
    """Connect out only (behind NAT); the peer serves no DHT requests or shards."""
    use_relay: bool = True
    """Allow relayed connections (needed to reach peers behind NAT)."""
    use_auto_relay: bool = False
    """Look for relays automatically (for a client behind NAT)."""
    startup_timeout: float = 30.0
    """Seconds to wait for the DHT to start and reach the initial peers."""
    swarm_key_path: str | None = None
    """Shared swarm key file: only peers holding it can write DHT records the others accept."""

    def __post_init__(self) -> None:
        self.initial_peers = parse_maddrs(self.initial_peers, "initial_peers")
        self.host_maddrs = parse_maddrs(self.host_maddrs, "host_maddrs")
        self.announce_maddrs = parse_maddrs(self.announce_maddrs, "announce_maddrs")
        if self.startup_timeout <= 0:
            raise ConfigError(f"startup_timeout must be positive, got {self.startup_timeout}")
        if self.client_mode and not self.initial_peers:
            raise ConfigError("client_mode needs initial_peers: a peer behind NAT cannot start a swarm")


def make_dht(config: SwarmConfig) -> hivemind.DHT:
    """Start a DHT process for ``config``.

    Raises :class:`ConfigError` with what to check when the daemon cannot start or no initial peer answers.
    """
    kwargs: dict = {
        "host_maddrs": config.host_maddrs,
        "client_mode": config.client_mode,
        "use_relay": config.use_relay,
        "use_auto_relay": config.use_auto_relay,
        "startup_timeout": config.startup_timeout,
    }
    if config.announce_maddrs:
        kwargs["announce_maddrs"] = config.announce_maddrs
    if config.identity_path:
        kwargs["identity_path"] = config.identity_path
    validators = [SwarmKeyValidator(load_swarm_key(config.swarm_key_path))] if config.swarm_key_path else []
    try:
        dht = hivemind.DHT(
            initial_peers=config.initial_peers or None, start=True, record_validators=validators, **kwargs
        )
    except Exception as exc:  # hivemind surfaces daemon and bootstrap failures as assorted exceptions
        hint = (
            "check that --initial-peers is the exact multiaddr printed by the bootstrap node and that it is reachable"
            if config.initial_peers
            else "check --host-maddrs (address in use? not a local address?)"
        )
        raise ConfigError(f"could not join the swarm: {exc}; {hint}") from None
    logger.info("joined swarm peer_id=%s maddrs=%s", dht.peer_id, [str(m) for m in dht.get_visible_maddrs()])
    return dht
