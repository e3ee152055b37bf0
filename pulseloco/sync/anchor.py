"""Anchors: full BF16 states serialized with safetensors, validated on load."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pulseloco.digest import state_digest
from pulseloco.errors import DigestMismatchError, PayloadError

logger = logging.getLogger(__name__)

__all__ = ["anchor_bytes", "load_anchor"]


def anchor_bytes(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize a state (contiguous CPU copies; shared storage is written once per name)."""
    plain = {name: t.detach().cpu().contiguous().clone() for name, t in state.items()}
    return st_save(plain, metadata=dict(metadata or {}))


def load_anchor(blob: bytes, *, expected_digest: str | None = None) -> dict[str, torch.Tensor]:
    """Parse anchor bytes; raises :class:`PayloadError` for bytes that are not a safetensors state and
    :class:`DigestMismatchError` when ``expected_digest`` is given and differs."""
    try:
        state = st_load(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise PayloadError(f"anchor is not a valid safetensors state: {exc}") from None
    if expected_digest is not None:
        digest = state_digest(state)
        if digest != expected_digest:
            raise DigestMismatchError(f"anchor digest {digest[:16]} differs from the signed {expected_digest[:16]}")
    return state
