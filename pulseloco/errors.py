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
    "PatchError",
    "PayloadError",
    "PayloadSizeError",
    "PulseLocoError",
    "StalePatchError",
    "TensorMismatchError",
    "TruncatedPayloadError",
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
