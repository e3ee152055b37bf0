"""The ``lut`` value mode: values that take few distinct FP32 numbers per group, as packed codes and tables.

A quantizer (:mod:`pulseloco.loco.quantize`) maps every value of a group (one parameter tensor's sent entries) to
one of ``2**bits`` FP32 numbers. A tensor's entries, in index order, are cut into consecutive groups of
``groups[g]`` entries; its value bytes are

    tables: 2**bits little-endian FP32 numbers per group | codes: ``bits`` bits per entry, packed LSB first

``bits`` is the smallest of 1, 2, 4, 8 whose table holds every group's distinct values (a group with fewer
distinct values repeats its last one). Decoding a code gives back the exact FP32 value that was encoded, so
encoding is lossless for values that are already quantized, and refuses (``ValueError``) values that are not.

Failure behaviour: :func:`encode_lut` raises :class:`ValueError` for a group with more than 256 distinct values or
group sizes that do not add up; :func:`decode_lut` raises :class:`PayloadError` for sizes that do not match and
:class:`NonFiniteValuesError` for a table entry that is not finite (checked before any value is built).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from pulseloco.errors import NonFiniteValuesError, PayloadError, PayloadSizeError

logger = logging.getLogger(__name__)

__all__ = ["LUT_BITS", "decode_lut", "encode_lut", "lut_value_bytes"]

LUT_BITS = (1, 2, 4, 8)
"""Code widths of the ``lut`` mode (each divides a byte)."""


def lut_value_bytes(count: int, num_groups: int, bits: int) -> int:
    """Bytes of a tensor's value section in the ``lut`` mode: the tables and the packed codes."""
    return 4 * (1 << bits) * num_groups + (count * bits + 7) // 8


def _pack(codes: np.ndarray, bits: int) -> bytes:
    """``bits``-bit codes (uint8 below ``2**bits``), packed least significant first, the last byte zero-padded."""
    per_byte = 8 // bits
    padded = np.zeros(-(-codes.size // per_byte) * per_byte, dtype=np.uint8)
    padded[: codes.size] = codes
    lanes = padded.reshape(-1, per_byte).astype(np.uint16)
    shifts = (np.arange(per_byte, dtype=np.uint16) * bits)[None, :]
    return (lanes << shifts).sum(axis=1).astype(np.uint8).tobytes()


def _unpack(raw: bytes | memoryview, count: int, bits: int) -> np.ndarray:
    """Inverse of :func:`_pack`; padding bits must be zero (:class:`PayloadError` otherwise)."""
    per_byte = 8 // bits
    packed = np.frombuffer(raw, dtype=np.uint8)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)[None, :]
    codes = ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)
    if bool(codes[count:].any()):
        raise PayloadError("lut codes: padding bits are not zero")
    return codes[:count]


def encode_lut(values_K: torch.Tensor, groups: Sequence[int]) -> tuple[bytes, int]:
    """The ``lut`` value bytes of FP32 ``values_K`` cut into consecutive ``groups`` (entry counts), and the code
    width chosen. Raises :class:`ValueError` when the groups do not add up to the values or a group holds more
    than 256 distinct values (the values were not quantized)."""
    values = values_K.detach().to("cpu", torch.float32).contiguous().numpy()
    if sum(groups) != values.size or any(g < 1 for g in groups):
        raise ValueError(f"lut groups {list(groups)[:8]}... must be positive and add up to {values.size} values")
    tables: list[np.ndarray] = []
    codes: list[np.ndarray] = []
    start = 0
    for size in groups:
        # Distinct bit patterns, not numbers: -0.0 and 0.0 stay apart, so decoding gives the exact bits back.
        bits_G = values[start : start + size].view(np.uint32)
        table, code = np.unique(bits_G, return_inverse=True)
        if table.size > 256:
            raise ValueError(f"lut group of {size} values holds {table.size} distinct values (at most 256)")
        tables.append(table)
        codes.append(code.astype(np.uint8))
        start += size
    width = max((t.size for t in tables), default=1)
    bits = next(b for b in LUT_BITS if (1 << b) >= width)
    rows = np.empty((len(tables), 1 << bits), dtype="<u4")
    for g, table in enumerate(tables):
        rows[g, : table.size] = table
        rows[g, table.size :] = table[-1]
    packed = _pack(np.concatenate(codes) if codes else np.zeros(0, np.uint8), bits)
    return rows.tobytes() + packed, bits


def decode_lut(raw: bytes | memoryview, count: int, groups: Sequence[int], bits: int) -> torch.Tensor:
    """FP32 values of a tensor's ``lut`` value bytes (:func:`encode_lut`). Raises :class:`PayloadSizeError` when
    ``raw`` is not :func:`lut_value_bytes` long, :class:`PayloadError` for groups that do not add up to
    ``count``, an unknown width or non-zero padding, and :class:`NonFiniteValuesError` for a table entry that
    is NaN or infinite."""
    if bits not in LUT_BITS:
        raise PayloadError(f"lut code width {bits} is not one of {LUT_BITS}")
    if sum(groups) != count or any(g < 1 for g in groups):
        raise PayloadError(f"lut groups add up to {sum(groups)} entries, the tensor has {count}")
    expected = lut_value_bytes(count, len(groups), bits)
    if len(raw) != expected:
        raise PayloadSizeError(
            f"lut values are {len(raw)} bytes, {count} entries in {len(groups)} groups need {expected}"
        )
    table_bytes = 4 * (1 << bits) * len(groups)
    tables = np.frombuffer(raw[:table_bytes], dtype="<f4").reshape(len(groups), 1 << bits)
    if not bool(np.isfinite(tables).all()):
        raise NonFiniteValuesError("lut table holds a non-finite value")
    codes = _unpack(raw[table_bytes:], count, bits).astype(np.int64)
    group_of = np.repeat(np.arange(len(groups)), np.asarray(groups, dtype=np.int64))
    return torch.from_numpy(np.ascontiguousarray(tables[group_of, codes], dtype=np.float32))
