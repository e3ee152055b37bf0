"""Ed25519 signing of PULSESync envelopes: who published a version, and which bytes they published.

An *envelope* is a small signed record that travels beside a payload (patch, squashed patch or anchor) and in
the DHT (the head record). Its fields name the run, the kind, the version and base version, the state digests,
and the SHA-256 and size of the payload bytes; the signature covers a domain-separated canonical JSON of the
fields. xxh3 state digests are integrity checks, not authenticators; the SHA-256 binds the payload to the
publisher's key, so a relay or a stranger on the swarm cannot substitute other bytes.

Key files: the private key is PKCS#8 PEM written with mode 0600; the public key is SubjectPublicKeyInfo PEM.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulseloco.errors import ChecksumError, ConfigError, PayloadError, TruncatedPayloadError, UnauthorizedError

logger = logging.getLogger(__name__)

__all__ = [
    "ENVELOPE_KINDS",
    "Envelope",
    "check_payload",
    "generate_key",
    "load_private_key",
    "load_public_key",
    "parse_envelope_unverified",
    "public_key_fingerprint",
    "public_key_source",
    "save_keypair",
    "sign_envelope",
    "verify_envelope",
]

_DOMAIN = b"pulseloco-sync-envelope-v1\n"
#: Bound on an envelope's size: it is read from the DHT and the network before anything else.
MAX_ENVELOPE_BYTES = 16 << 10
EnvelopeKind = Literal["head", "patch", "squash", "anchor"]
ENVELOPE_KINDS: tuple[EnvelopeKind, ...] = get_args(EnvelopeKind)


@dataclass(frozen=True)
class Envelope:
    """The signed facts about one published object.

    ``kind`` is ``head`` (the newest version, in the DHT), ``patch`` (base -> version), ``squash`` (a
    squashed patch base -> version) or ``anchor`` (the full state at ``version``; ``base_version`` is None).
    ``digest`` is the state digest at ``version``; ``anchor_version`` (head only) is the newest anchor.
    """

    run_id: str
    kind: str
    version: int
    base_version: int | None
    digest: str
    base_digest: str
    sha256: str
    size: int
    anchor_version: int | None = None
    time: float = 0.0


def generate_key() -> Ed25519PrivateKey:
    """A new random Ed25519 private key."""
    return Ed25519PrivateKey.generate()


def save_keypair(key: Ed25519PrivateKey, path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``path`` (private key, mode 0600) and ``path.pub`` (public key); refuse to overwrite.

    Missing parent directories are created (mode 0700, so that only the owner lists the keys).
    Raises :class:`ConfigError` if either file exists or a directory or file cannot be written.
    """
    private_path = Path(path)
    public_path = private_path.with_name(private_path.name + ".pub")
    for p in (private_path, public_path):
        if p.exists():
            raise ConfigError(f"{p} already exists; refusing to overwrite a key (choose another --out)")
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        private_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ConfigError(f"cannot create the key directory {private_path.parent}: {exc.strerror}") from None
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_pem)
    except OSError as exc:
        raise ConfigError(f"cannot write the key {private_path}: {exc.strerror}") from None
    try:
        public_path.write_bytes(public_pem)
    except OSError as exc:
        private_path.unlink(missing_ok=True)  # no private key without its public half
        raise ConfigError(f"cannot write the public key {public_path}: {exc.strerror}") from None
    return private_path, public_path


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Read an Ed25519 private key (PKCS#8 PEM). Raises :class:`ConfigError` saying what is wrong."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise ConfigError(f"cannot read signing key {path}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"{path} is not an unencrypted PEM private key ({exc}); make one with `pulseloco keygen`"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} holds a {type(key).__name__}, pulseloco signs with Ed25519 (`pulseloco keygen`)")
    return key


def load_public_key(path_or_pem: str | os.PathLike[str] | bytes) -> Ed25519PublicKey:
    """Read an Ed25519 public key from a PEM file path or PEM bytes. Raises :class:`ConfigError`."""
    if isinstance(path_or_pem, bytes):
        pem = path_or_pem
    else:
        try:
            pem = Path(path_or_pem).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read public key {path_or_pem}: {exc.strerror}") from None
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"not a PEM public key ({exc}); use the .pub file written by `pulseloco keygen`") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"public key is a {type(key).__name__}, expected Ed25519")
    if not isinstance(path_or_pem, bytes):
        _KEY_SOURCES[public_key_fingerprint(key)] = str(path_or_pem)
    return key


_KEY_SOURCES: dict[str, str] = {}
"""Fingerprint -> the file :func:`load_public_key` read that key from (for messages that name the key file)."""


def public_key_source(key: Ed25519PublicKey) -> str | None:
    """The file this process loaded ``key`` from with :func:`load_public_key`, or None (loaded from bytes, made in
    memory, or derived from a private key)."""
    return _KEY_SOURCES.get(public_key_fingerprint(key))


def public_key_fingerprint(key: Ed25519PublicKey) -> str:
    """Short hex fingerprint of a public key, for logs and the DHT."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _canonical(fields: Mapping[str, Any]) -> bytes:
    return _DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_envelope(key: Ed25519PrivateKey, envelope: Envelope) -> bytes:
    """Serialize and sign ``envelope``; the result is what travels (JSON with a base64 signature)."""
    if envelope.kind not in ENVELOPE_KINDS:
        raise ValueError(f"envelope kind must be one of {ENVELOPE_KINDS}, got {envelope.kind!r}")
    fields = asdict(envelope)
    signature = key.sign(_canonical(fields))
    return json.dumps({"fields": fields, "sig": base64.b64encode(signature).decode()}).encode()


def _check_fields(fields: object) -> Envelope:
    if not isinstance(fields, dict) or set(fields) != {f for f in Envelope.__dataclass_fields__}:
        raise PayloadError("envelope fields do not match the expected set")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    ok = (
        isinstance(fields["run_id"], str)
        and fields["kind"] in ENVELOPE_KINDS
        and is_int(fields["version"])
        and (fields["base_version"] is None or is_int(fields["base_version"]))
        and (fields["anchor_version"] is None or is_int(fields["anchor_version"]))
        and all(isinstance(fields[k], str) and len(fields[k]) <= 128 for k in ("digest", "base_digest", "sha256"))
        and is_int(fields["size"])
        and isinstance(fields["time"], (int, float))
    )
    if not ok:
        raise PayloadError("envelope has fields of the wrong type")
    return Envelope(**fields)


def _load_outer(blob: bytes) -> dict[str, Any]:
    """The JSON object around an envelope's fields; :class:`PayloadError` if too large or not a JSON object."""
    if len(blob) > MAX_ENVELOPE_BYTES:
        raise PayloadError(f"envelope of {len(blob)} bytes exceeds {MAX_ENVELOPE_BYTES}")
    try:
        outer = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PayloadError(f"envelope is not JSON: {exc}") from None
    if not isinstance(outer, dict):
        raise UnauthorizedError("envelope carries no signature")
    return outer


def parse_envelope_unverified(blob: bytes) -> Envelope:
    """The fields of an envelope WITHOUT checking its signature, for display when no public key is at hand
    (``pulseloco status``); anyone can write such a record, so never act on what this returns.

    Raises :class:`PayloadError` when the bytes are not a well-formed envelope (too large, not JSON, fields of
    the wrong set or type) and :class:`UnauthorizedError` when they are JSON but not an envelope object.
    """
    return _check_fields(_load_outer(blob).get("fields"))


def verify_envelope(key: Ed25519PublicKey, blob: bytes, *, run_id: str | None = None) -> Envelope:
    """Parse and verify a signed envelope.

    Raises :class:`UnauthorizedError` when the signature is missing or does not verify under ``key`` (forged,
    or signed by another publisher) or the envelope is for another ``run_id``; :class:`PayloadError` when
    the bytes are not an envelope at all.
    """
    outer = _load_outer(blob)
    if not isinstance(outer.get("sig"), str):
        raise UnauthorizedError("envelope carries no signature")
    envelope = _check_fields(outer.get("fields"))
    try:
        signature = base64.b64decode(outer["sig"], validate=True)
        key.verify(signature, _canonical(asdict(envelope)))
    except (InvalidSignature, ValueError):
        raise UnauthorizedError(
            f"{envelope.kind} envelope for version {envelope.version} is not signed by the trusted publisher key"
        ) from None
    if run_id is not None and envelope.run_id != run_id:
        raise UnauthorizedError(f"envelope is for run {envelope.run_id!r}, expected {run_id!r}")
    return envelope


def check_payload(envelope: Envelope, payload: bytes, where: str) -> None:
    """Check ``payload`` against the size and SHA-256 its (already verified) ``envelope`` signs.

    ``where`` names the object in the error (a file path, a peer). Raises :class:`TruncatedPayloadError` when the
    payload is shorter than the signed size and :class:`ChecksumError` when its bytes differ from the signed ones
    (corrupted on disk or in transit, or replaced).
    """
    if len(payload) < envelope.size:
        raise TruncatedPayloadError(
            f"{where} is truncated: {len(payload)} of the {envelope.size} bytes its signed envelope records"
        )
    if len(payload) != envelope.size or hashlib.sha256(payload).hexdigest() != envelope.sha256:
        raise ChecksumError(f"{where} is corrupt: its bytes do not match the SHA-256 its signed envelope records")
