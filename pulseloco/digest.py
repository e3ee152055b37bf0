"""State digests, shared by PULSESync (patch digests) and PULSELoCo (`theta_digest`): xxh3-128 over a state's
tensors in sorted-name order, with name, dtype and shape included.

Two states have the same digest exactly when they have the same names, dtypes, shapes and bit patterns
(up to hash collisions). xxh3 runs at memory speed, so a digest of a 7B BF16 state costs about as much as
reading it once. It is an integrity check, not an authenticator: signatures over patch headers (which carry
digests) provide authenticity.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping

import torch
import xxhash

logger = logging.getLogger(__name__)

__all__ = ["state_digest", "tensor_bytes"]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, copied to contiguous CPU memory only when needed."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().data


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """Hex xxh3-128 digest of ``state`` (a ``state_dict()``-like mapping of names to tensors).

    Raises :class:`TypeError` if a value is not a tensor.
    """
    h = xxhash.xxh3_128()
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state[{name!r}] is {type(tensor).__name__}, not a tensor")
        encoded = name.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
        meta = f"{tensor.dtype}:{tuple(tensor.shape)}".encode()
        h.update(struct.pack("<I", len(meta)))
        h.update(meta)
        h.update(tensor_bytes(tensor))
    return h.hexdigest()
