"""Exceptions raised by pulseloco, grouped by what happened and who acts on it.

Every one derives from :class:`PulseLocoError`, says what is wrong and, where it can, what to do about it, and
leaves no half-applied state. Below it, three families:

- :class:`ConfigError` (a :class:`ValueError`): the user's configuration or flags are wrong; the user fixes them.
  Recipes exit 2.
- :class:`PayloadError` and :class:`PatchError` (both :class:`ValueError`): bytes received or read (from a peer,
  a relay, the disk) are malformed, forged or do not apply; nothing was applied. The code that received them
  drops the sender's data and tries elsewhere; nobody needs to change a flag.
- :class:`SwarmError` (a :class:`RuntimeError`): the swarm could not do something within its timeouts and
  retries (join it, average a round, download a state, deliver a version, find a rollout worker); the operator
  checks addresses, connectivity or the other peers. Recipes exit 1.
"""

from __future__ import annotations

__all__ = [
    "BadMagicError",
    "ChecksumError",
    "ConfigError",
    "DigestMismatchError",
    "InvalidIndicesError",
    "NonFiniteValuesError",
    "OutlierPayloadError",
    "PatchError",
    "PayloadError",
    "PayloadSizeError",
    "PulseLocoError",
    "StalePatchError",
    "StateDownloadError",
    "SwarmError",
    "SwarmUnreachableError",
    "TensorMismatchError",
    "TruncatedPayloadError",
    "UnauthorizedError",
    "UnsupportedVersionError",
    "VersionTimeoutError",
]


class PulseLocoError(Exception):
    """Base class of every error pulseloco raises."""


class PayloadError(PulseLocoError, ValueError):
    """A wire payload (patch or sparse pseudo-gradient) is malformed; nothing was applied."""


class TruncatedPayloadError(PayloadError):
    """The payload ends before the sizes in its header say it should."""


class BadMagicError(PayloadError):
    """The payload does not start with the pulseloco frame magic: it is not a pulseloco payload."""


class UnsupportedVersionError(PayloadError):
    """The payload's format version is not one this build can read (upgrade pulseloco on one side)."""


class ChecksumError(PayloadError):
    """The payload's checksum does not match its bytes: it was corrupted in transit or on disk."""


class PayloadSizeError(PayloadError):
    """Declared sizes do not add up, or exceed the receiver's limits (decompression-bomb guard)."""


class InvalidIndicesError(PayloadError):
    """Indices are out of range for their tensor or not strictly increasing."""


class TensorMismatchError(PayloadError):
    """The payload names a tensor the receiver does not have, or with another shape or dtype."""


class PatchError(PulseLocoError, ValueError):
    """A well-formed patch cannot be applied to this state; the state is left as it was."""


class StalePatchError(PatchError):
    """The receiver is not at the patch's base version (its digest differs from the base digest)."""


class DigestMismatchError(PatchError):
    """Applying the patch did not produce the state digest the publisher announced; the state was restored."""


class ConfigError(PulseLocoError, ValueError):
    """Invalid configuration or command-line flag; the message names the field to fix."""


class UnauthorizedError(PayloadError):
    """A payload or record is unsigned, or not signed by the trusted key; it was not used."""


class NonFiniteValuesError(PayloadError):
    """A sparse pseudo-gradient payload carries NaN or infinite values; it was rejected, nothing applied."""


class OutlierPayloadError(PayloadError):
    """A sparse pseudo-gradient's norm is far above the median of its group's payloads; it was rejected."""


class SwarmError(PulseLocoError, RuntimeError):
    """The swarm could not complete an operation within its timeouts and retries (joining, matchmaking,
    averaging, state download, a version or a rollout to arrive); the local state is left as it was and the
    message names what to check."""


class SwarmUnreachableError(SwarmError):
    """No DHT could be started or no initial peer answered: the swarm cannot be joined (check the multiaddrs,
    the network, the swarm key)."""


class VersionTimeoutError(SwarmError):
    """A PULSESync version that was waited for did not arrive in time (check that a publisher runs in the same
    swarm under that run id)."""


class StateDownloadError(SwarmError):
    """No peer served a valid state (right size, finite, matching the announced digest) within the retries."""
