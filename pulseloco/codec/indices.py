"""Coding of sorted flat index sets: Golomb-Rice coded gaps, a bitmask, or the trivial sets.

A change set at density ``p`` costs at least ``H(p)/p`` bits per index when its positions are independent.
Gaps between consecutive indices are then geometric, and a Rice code with the best parameter ``k`` is
within a few percent of that bound (0.4% at p = 1%), which a byte-oriented code (u8/u16 gaps) plus a general
compressor is not. The Rice code is stored as two byte-aligned streams so that both directions are
vectorised: a unary stream of quotients (``q`` zeros then a one; the positions of the ones give every ``q``
at once) and a stream of fixed-width ``k``-bit remainders. The parameter is chosen per tensor by computing the
exact size for candidates around the estimate; a bitmask is used when it is smaller (dense sets, above
about 6-10% density).

Methods: ``empty`` (no index), ``all`` (every element, no bytes), ``rice`` (parameter ``k``),
``bitmask`` (one bit per element).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from pulseloco.errors import InvalidIndicesError, PayloadSizeError

logger = logging.getLogger(__name__)

__all__ = ["METHODS", "IndexCode", "decode_indices", "encode_indices", "max_code_bytes", "rice_size_bits"]

METHODS = ("empty", "all", "rice", "bitmask")

#: Largest Rice parameter accepted from the wire (gaps are below 2**62 for any real tensor).
MAX_RICE_K = 40


@dataclass(frozen=True)
class IndexCode:
    """One tensor's coded index set: ``method``, its parameter ``k`` (rice only) and the bytes."""

    method: str
    k: int
    data: bytes


def rice_size_bits(gaps_K: np.ndarray, k: int) -> int:
    """Exact size in bits of the Rice code of ``gaps_K`` with parameter ``k``."""
    return int((gaps_K >> k).sum()) + gaps_K.size * (1 + k)


def max_code_bytes(method: str, k: int, count: int, numel: int) -> int:
    """Upper bound on the size of a code the encoder can produce, checked before decompressing anything
    (decompression-bomb guard): it grows with ``count``, never with ``numel`` alone.

    The encoder picks the locally optimal Rice parameter ``k``, at which the quotients sum to at most
    ``2 * count`` (``S_k <= S_{k+1} + count <= S_k / 2 + count``), so the unary stream holds at most
    ``3 * count`` bits, and uses a bitmask only when it is no
    larger than that Rice code, so only when ``numel <= count * (k + 2) + 8``. Raises
    :class:`InvalidIndicesError` for an unknown method or a Rice parameter out of range.
    """
    if method in ("empty", "all"):
        return 0
    if method == "bitmask":
        return (numel + 7) // 8 if numel <= count * (MAX_RICE_K + 2) + 64 else 0
    if method == "rice":
        if not 0 <= k <= MAX_RICE_K:
            raise InvalidIndicesError(f"rice parameter k={k} outside 0..{MAX_RICE_K}")
        return (3 * count + 7) // 8 + (count * k + 7) // 8
    raise InvalidIndicesError(f"unknown index method {method!r}; expected one of {METHODS}")


def _best_rice_k(gaps_K: np.ndarray) -> tuple[int, int]:
    """The locally optimal Rice parameter (exact sizes, searched from the geometric estimate)."""
    mean = float(gaps_K.mean()) if gaps_K.size else 0.0
    k = min(MAX_RICE_K, max(0, math.floor(math.log2(max(mean * math.log(2), 1.0)))))
    bits = rice_size_bits(gaps_K, k)
    for step in (1, -1):
        while 0 <= k + step <= MAX_RICE_K:
            candidate = rice_size_bits(gaps_K, k + step)
            if candidate > bits or (candidate == bits and step < 0):
                break
            k, bits = k + step, candidate
    return k, bits


def _group_layout(k: int) -> list[list[tuple[int, int]]]:
    """For each of the 8 values of a group (8 values of ``k`` bits fill exactly ``k`` bytes), the bytes of the
    group it touches and, per byte, ``shift``: the byte holds ``(value >> shift) & 0xFF`` (a left shift when
    negative). Every group has the same layout, so packing is a few column operations over all groups."""
    layout = []
    for j in range(8):
        first, last = (j * k) // 8, (j * k + k - 1) // 8
        layout.append([(q, j * k + k - 8 * q - 8) for q in range(first, last + 1)])
    return layout


def _work_dtype(k: int) -> np.dtype:
    """The narrowest unsigned dtype that holds a ``k``-bit value shifted left by up to 7 bits."""
    return np.dtype(np.uint16 if k <= 9 else np.uint32 if k <= 25 else np.uint64)


def _pack_fixed(values_K: np.ndarray, k: int) -> bytes:
    """Pack unsigned values (below ``2**k``) in ``k`` bits each, most significant bit first.

    Values are taken in groups of 8, which fill ``k`` bytes exactly; byte ``q`` of every group is assembled
    from the (at most two or three) values that overlap it, column by column, so the cost is a few passes over
    ``count * k / 8`` bytes. The last group is padded with zero values, whose bits past the end are cut.
    """
    count = int(values_K.size)
    if k == 0 or count == 0:
        return b""
    groups = -(-count // 8)
    work = _work_dtype(k)
    padded = np.zeros(groups * 8, dtype=work)
    padded[:count] = values_K
    cols = padded.reshape(groups, 8)
    out = np.zeros((groups, k), dtype=np.uint8)
    for j, parts in enumerate(_group_layout(k)):
        column = cols[:, j]
        for q, shift in parts:
            part = column >> work.type(shift) if shift >= 0 else column << work.type(-shift)
            out[:, q] |= part.astype(np.uint8)  # keeps the low byte
    return out.reshape(-1)[: (count * k + 7) // 8].tobytes()


def _unpack_fixed(data: bytes, count: int, k: int) -> np.ndarray:
    """Inverse of :func:`_pack_fixed`; the caller has checked ``len(data)``."""
    if k == 0 or count == 0:
        return np.zeros(count, dtype=np.uint64)
    groups = -(-count // 8)
    raw = np.frombuffer(data, dtype=np.uint8)
    buf = np.zeros(groups * k, dtype=np.uint8)
    buf[: raw.size] = raw
    rows = buf.reshape(groups, k)
    work = _work_dtype(k)
    out = np.zeros((groups, 8), dtype=work)
    mask = work.type((1 << k) - 1)
    for j, parts in enumerate(_group_layout(k)):
        acc = out[:, j]
        for q, shift in parts:
            byte = rows[:, q].astype(work)
            acc |= byte << work.type(shift) if shift >= 0 else byte >> work.type(-shift)
        acc &= mask
    return out.reshape(-1)[:count].astype(np.uint64)


def encode_indices(indices_K: np.ndarray, numel: int) -> IndexCode:
    """Code sorted, strictly increasing flat ``indices_K`` of a tensor with ``numel`` elements.

    The caller guarantees the ordering and range (they come from ``flatnonzero``); a violation raises
    :class:`InvalidIndicesError`.
    """
    count = int(indices_K.size)
    if count == 0:
        return IndexCode("empty", 0, b"")
    if count == numel:
        return IndexCode("all", 0, b"")
    indices_K = indices_K.astype(np.int64, copy=False)
    gaps_K = np.diff(indices_K, prepend=np.int64(-1)) - 1
    if gaps_K.min() < 0 or indices_K[-1] >= numel:
        raise InvalidIndicesError("indices must be strictly increasing and below the tensor's numel")
    gaps_K = gaps_K.astype(np.uint64)
    k, rice_bits = _best_rice_k(gaps_K)
    if (rice_bits + 7) // 8 + 1 >= (numel + 7) // 8:
        mask_N = np.zeros(numel, dtype=np.uint8)
        mask_N[indices_K] = 1
        return IndexCode("bitmask", 0, np.packbits(mask_N).tobytes())
    quotients_K = (gaps_K >> np.uint64(k)).astype(np.int64)
    unary_bits = np.zeros(int(quotients_K.sum()) + count, dtype=np.uint8)
    unary_bits[np.cumsum(quotients_K + 1) - 1] = 1
    unary = np.packbits(unary_bits).tobytes()
    remainders = _pack_fixed(gaps_K & np.uint64((1 << k) - 1), k)
    return IndexCode("rice", k, unary + remainders)


def decode_indices(code: IndexCode, count: int, numel: int) -> np.ndarray:
    """Decode ``count`` flat indices of a tensor with ``numel`` elements, validating everything.

    Raises :class:`InvalidIndicesError` when the stream does not hold exactly ``count`` strictly increasing
    indices below ``numel`` (or nonzero padding bits), and :class:`PayloadSizeError` for a stream of the
    wrong length. Returns an int64 array.
    """
    data = code.data
    if code.method == "empty":
        if count != 0 or data:
            raise PayloadSizeError(f"index method 'empty' with count={count} and {len(data)} bytes")
        return np.zeros(0, dtype=np.int64)
    if code.method == "all":
        if count != numel or data:
            raise PayloadSizeError(f"index method 'all' needs count == numel ({count} != {numel}) and no bytes")
        return np.arange(numel, dtype=np.int64)
    if code.method == "bitmask":
        if len(data) != (numel + 7) // 8:
            raise PayloadSizeError(f"bitmask of {len(data)} bytes for a tensor of {numel} elements")
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        if bits[numel:].any():
            raise InvalidIndicesError("bitmask has bits set past the end of the tensor")
        indices_K = np.flatnonzero(bits[:numel].view(bool))  # 0/1 bytes: the bool fast path
        if indices_K.size != count:
            raise InvalidIndicesError(f"bitmask holds {indices_K.size} indices, header says {count}")
        return indices_K.astype(np.int64)
    if code.method != "rice":
        raise InvalidIndicesError(f"unknown index method {code.method!r}")
    k = code.k
    if not 0 <= k <= MAX_RICE_K:
        raise InvalidIndicesError(f"rice parameter k={k} outside 0..{MAX_RICE_K}")
    if count == 0:
        raise PayloadSizeError("rice stream for 0 indices; the encoder uses method 'empty'")
    rem_bytes = (count * k + 7) // 8
    unary_bytes = len(data) - rem_bytes
    if unary_bytes < (count + 7) // 8:
        raise PayloadSizeError(f"rice stream of {len(data)} bytes is too short for {count} indices")
    unary = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=unary_bytes))
    ones = np.flatnonzero(unary.view(bool))  # 0/1 bytes: the bool fast path
    if ones.size != count:
        raise InvalidIndicesError(f"rice stream holds {ones.size} codes, header says {count}")
    if ones[-1] < unary.size - 8:
        raise PayloadSizeError("rice unary stream has trailing bytes")
    # The i-th one sits at ones[i] = (q_0 + ... + q_i) + i, so the quotients' prefix sums are ones - i and
    # index_i = ((ones_i - i) << k) + (r_0 + ... + r_i) + i: no per-gap pass. Every step adds a gap plus one,
    # so the indices are strictly increasing as long as nothing overflows, which the two bounds below ensure
    # (both sums are at most the last index, which must be below numel <= 2**40).
    if int(ones[-1]) - (count - 1) > (numel >> k):
        raise InvalidIndicesError(f"index gap exceeds the tensor's {numel} elements")
    remainders_K = _unpack_fixed(data[unary_bytes:], count, k)
    pad_bits = -(count * k) % 8
    if pad_bits and data[-1] & ((1 << pad_bits) - 1):
        raise InvalidIndicesError("rice remainder stream has nonzero padding bits")
    if k and float(remainders_K.sum(dtype=np.float64)) >= numel:
        raise InvalidIndicesError(f"index gap exceeds the tensor's {numel} elements")
    steps = np.arange(count, dtype=np.int64)
    indices_K = ones - steps
    indices_K <<= k
    if k:
        indices_K += np.cumsum(remainders_K.astype(np.int64))
    indices_K += steps
    if int(indices_K[-1]) >= numel:
        raise InvalidIndicesError(f"index {int(indices_K[-1])} out of range for a tensor of {numel} elements")
    return indices_K
