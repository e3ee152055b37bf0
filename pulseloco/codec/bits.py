"""Bit-level views of floating tensors: bitwise change detection and value transforms for the wire.

Change detection compares integer views of the bit patterns, never float values: a float ``!=`` misses
``-0.0`` vs ``+0.0`` (equal as floats) and reports every NaN as changed even when its payload did not change.

Legend for array names: ``*_N`` has one entry per tensor element, ``*_K`` one per changed element.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pulseloco.errors import PayloadError

logger = logging.getLogger(__name__)

__all__ = [
    "BitFormat",
    "bit_format",
    "bit_view",
    "changed_indices",
    "from_wire_values",
    "modular_add",
    "modular_delta",
    "rotl1",
    "rotr1",
    "to_wire_values",
    "zigzag_decode",
    "zigzag_encode",
]


@dataclass(frozen=True)
class BitFormat:
    """How one floating dtype is seen as bits: its signed integer view and its unsigned wire dtype."""

    name: str
    dtype: torch.dtype
    int_dtype: torch.dtype
    wire: np.dtype
    width: int


_FORMATS: dict[str, BitFormat] = {
    "bfloat16": BitFormat("bfloat16", torch.bfloat16, torch.int16, np.dtype("<u2"), 2),
    "float16": BitFormat("float16", torch.float16, torch.int16, np.dtype("<u2"), 2),
    "float32": BitFormat("float32", torch.float32, torch.int32, np.dtype("<u4"), 4),
    "float64": BitFormat("float64", torch.float64, torch.int64, np.dtype("<u8"), 8),
}
_BY_DTYPE = {f.dtype: f for f in _FORMATS.values()}


def bit_format(dtype: torch.dtype | str) -> BitFormat:
    """Return the :class:`BitFormat` of a floating dtype (a ``torch.dtype`` or its wire name).

    Raises :class:`PayloadError` for a name that is not a supported floating dtype (wire names come from
    untrusted headers) and :class:`TypeError` for an unsupported ``torch.dtype`` passed by the caller.
    """
    if isinstance(dtype, str):
        try:
            return _FORMATS[dtype]
        except KeyError:
            raise PayloadError(f"unsupported dtype {dtype!r} in payload; expected one of {sorted(_FORMATS)}") from None
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise TypeError(
            f"pulseloco patches floating tensors only (bfloat16, float16, float32, float64), got {dtype}"
        ) from None


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return a flat signed-integer view of ``tensor``'s bit patterns (no copy when contiguous)."""
    fmt = bit_format(tensor.dtype)
    return tensor.reshape(-1).view(fmt.int_dtype)


def changed_indices(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted flat int64 indices where the bit patterns of ``base`` and ``new`` differ (on their device)."""
    base_bits, new_bits = bit_view(base), bit_view(new)
    if base_bits.device.type == "cpu" and new_bits.device.type == "cpu":
        # numpy's fused compare + flatnonzero is 4-5x faster than torch's on CPU.
        return torch.from_numpy(np.flatnonzero(base_bits.numpy() != new_bits.numpy()))
    return torch.nonzero(base_bits != new_bits).reshape(-1)


def _as_unsigned(values_K: torch.Tensor) -> np.ndarray:
    """Bits of a CPU tensor as the matching little-endian unsigned numpy array (no copy)."""
    fmt = bit_format(values_K.dtype) if values_K.is_floating_point() else None
    if fmt is not None:
        values_K = values_K.view(fmt.int_dtype)
    width = values_K.element_size()
    return values_K.contiguous().numpy().view(np.dtype(f"<u{width}"))


def rotl1(bits_K: np.ndarray) -> np.ndarray:
    """Rotate unsigned bit patterns left by one: the sign moves to bit 0 and, for BF16 and FP32, the whole
    exponent lands in the top byte, which then compresses far better than sign+exponent did."""
    top = bits_K.dtype.itemsize * 8 - 1
    return (bits_K << 1) | (bits_K >> top)


def rotr1(bits_K: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rotl1`."""
    top = bits_K.dtype.itemsize * 8 - 1
    return (bits_K >> 1) | (bits_K << top)


def zigzag_encode(delta_K: np.ndarray) -> np.ndarray:
    """Map signed deltas (given as unsigned two's-complement bits) to unsigned: 0,-1,1,-2 -> 0,1,2,3."""
    signed = delta_K.view(delta_K.dtype.str.replace("u", "i"))
    top = delta_K.dtype.itemsize * 8 - 1
    return ((signed << 1) ^ (signed >> top)).view(delta_K.dtype)


def zigzag_decode(zig_K: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag_encode`, returning unsigned two's-complement bits."""
    signed_dtype = zig_K.dtype.str.replace("u", "i")
    neg = -((zig_K & 1).view(signed_dtype))
    return (zig_K >> 1) ^ neg.view(zig_K.dtype)


def _unsigned(bits_K: np.ndarray) -> np.dtype:
    return np.dtype(f"<u{bits_K.dtype.itemsize}")


def modular_delta(base_K: np.ndarray, new_K: np.ndarray) -> np.ndarray:
    """Bit-pattern difference ``new - base`` of two integer arrays of one width, modulo 2**bits (wraps by
    design), in the inputs' dtype."""
    return (new_K.view(_unsigned(new_K)) - base_K.view(_unsigned(base_K))).view(base_K.dtype)


def modular_add(base_K: np.ndarray, delta_K: np.ndarray) -> np.ndarray:
    """Inverse of :func:`modular_delta`: ``base + delta`` modulo 2**bits, in ``base_K``'s dtype."""
    return (base_K.view(_unsigned(base_K)) + delta_K.view(_unsigned(delta_K))).view(base_K.dtype)


def to_wire_values(values_K: torch.Tensor, mode: str) -> np.ndarray:
    """Transform values for the wire: floats are rotated (:func:`rotl1`), modular deltas zig-zag coded.

    ``values_K`` is a CPU tensor: floats for the ``absolute`` and ``float32`` modes, the result of
    :func:`modular_delta` (signed-integer bit patterns) for ``delta``.
    """
    bits = _as_unsigned(values_K)
    return zigzag_encode(bits) if mode == "delta" else rotl1(bits)


def from_wire_values(wire_K: np.ndarray, mode: str) -> np.ndarray:
    """Inverse of :func:`to_wire_values`: unsigned bits of the values (floats) or of the modular deltas."""
    return zigzag_decode(wire_K) if mode == "delta" else rotr1(wire_K)
