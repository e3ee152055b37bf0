"""Exceptions raised by pulseloco.

Every error caused by bad input (bytes from the network or disk, configuration, command-line flags) is a
subclass of :class:`ValueError` so that callers can catch the whole family at once, and each message says what
is wrong and, where it can, what to do about it. Raising one never leaves a half-applied state.
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
    "TensorMismatchError",
    "TruncatedPayloadError",
    "UnauthorizedError",
    "UnsupportedVersionError",
]


class PulseLocoError(ValueError):
    """Base class of every pulseloco input error."""


class PayloadError(PulseLocoError):
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


class PatchError(PulseLocoError):
    """A well-formed patch cannot be applied to this state; the state is left as it was."""


class StalePatchError(PatchError):
    """The receiver is not at the patch's base version (its digest differs from the base digest)."""


class DigestMismatchError(PatchError):
    """Applying the patch did not produce the state digest the publisher announced; the state was restored."""


class ConfigError(PulseLocoError):
    """Invalid configuration or command-line flag; the message names the field to fix."""


class UnauthorizedError(PayloadError):
    """A payload or record is unsigned, or not signed by the trusted key; it was not used."""


class NonFiniteValuesError(PayloadError):
    """A sparse pseudo-gradient payload carries NaN or infinite values; it was rejected, nothing applied."""


class OutlierPayloadError(PayloadError):
    """A sparse pseudo-gradient's norm is far above the median of its group's payloads; it was rejected."""


class SwarmError(PulseLocoError):
    """The swarm could not complete an operation within its timeouts and retries (matchmaking, averaging,
    state download); the local state is left as it was and the message names the knob to turn."""


class StateDownloadError(SwarmError):
    """No peer served a valid state (right size, finite, matching the announced digest) within the retries."""
