"""Two baseline codecs of sparse BF16 updates, to measure PULSESync's patch codec against
(experiments/codec/bench_codec.py).

- ``naive``: per tensor, a u64 count and flat int32 indices, then the raw BF16 values;
- ``authors``: the PULSE authors' production codec as docs/design.md section 6.2 describes it: per tensor viewed 2-D,
  row gaps, per-row counts and per-row column gaps narrowed to u8/u16(/u32), then the raw BF16 values.

Both go tensor by tensor in sorted-name order with zstd level 1 over the whole payload; decoding needs the base
state (for names and shapes), as applying an update does anyway. A state is a ``{name: BF16 tensor}`` dict. Both
are lossless bit for bit (a changed element is one whose int16 bit pattern differs, so -0.0/+0.0 count).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

State = dict[str, torch.Tensor]
ZSTD_LEVEL = 1


def _changed(base: torch.Tensor, new: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Bitwise diff of two BF16 tensors: (flat int64 indices, int16 bit patterns of new values)."""
    b = base.view(torch.int16).reshape(-1)
    n = new.view(torch.int16).reshape(-1)
    idx = torch.nonzero(b != n).squeeze(1)
    return idx.numpy(), n[idx].numpy()


def _as_2d(shape: torch.Size) -> tuple[int, int]:
    """(rows, cols) of a tensor viewed 2-D: dim 0 by the rest; 0-D and 1-D tensors are one row."""
    if len(shape) <= 1:
        return 1, int(math.prod(shape))
    return int(shape[0]), int(math.prod(shape[1:]))


def _narrow(a: np.ndarray) -> np.ndarray:
    """Narrow a non-negative integer array to the smallest of u8/u16/u32 that holds all of it."""
    top = int(a.max()) if a.size else 0
    for dt in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dt).max:
            return a.astype(dt)
    raise ValueError(f"value {top} does not fit u32")


_DTYPE_CODE: dict[np.dtype[Any], int] = {
    np.dtype(np.uint8): 1,
    np.dtype(np.uint16): 2,
    np.dtype(np.uint32): 4,
}
_CODE_DTYPE: dict[int, np.dtype[Any]] = {v: k for k, v in _DTYPE_CODE.items()}


def _apply_changes(t: torch.Tensor, idx: np.ndarray, vals: np.ndarray) -> None:
    """Scatter int16 bit patterns into a BF16 tensor in place."""
    if idx.size:
        flat = t.view(torch.int16).view(-1)
        flat[torch.from_numpy(idx)] = torch.from_numpy(vals)


@dataclass(frozen=True)
class Baseline:
    """A baseline codec: ``index_parts`` turns one tensor's changes into byte chunks for the index
    stream, ``parse_index`` reads them back; values are raw BF16 after the index chunks."""

    name: str
    index_parts: Callable[[np.ndarray, torch.Size], list[bytes]]
    parse_index: Callable[[memoryview, int, torch.Size], tuple[np.ndarray, int]]

    def _parts(self, base: State, new: State) -> Iterable[tuple[list[bytes], bytes]]:
        for name in sorted(new):
            idx, vals = _changed(base[name], new[name])
            yield self.index_parts(idx, new[name].shape), vals.tobytes()

    def encode(self, base: State, new: State) -> bytes:
        """The payload that turns ``base`` into ``new`` (same names and shapes; KeyError for a name ``base``
        lacks)."""
        chunks: list[bytes] = []
        for idx_chunks, val_bytes in self._parts(base, new):
            chunks += idx_chunks
            chunks.append(val_bytes)
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(chunks))

    def index_bytes(self, base: State, new: State) -> int:
        """Size of the index stream alone (all tensors' index chunks) after zstd-1."""
        chunks = [c for idx_chunks, _ in self._parts(base, new) for c in idx_chunks]
        return len(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(chunks)))

    def apply(self, state: State, payload: bytes) -> int:
        """Decode ``payload`` and scatter it into ``state`` in place; returns the number of changes. Raises
        ValueError for trailing bytes, zstandard.ZstdError for a payload that is not zstd."""
        # bytearray: torch.from_numpy wants writable arrays.
        buf = memoryview(bytearray(zstandard.ZstdDecompressor().decompress(payload)))
        off = 0
        total = 0
        for name in sorted(state):
            t = state[name]
            idx, off = self.parse_index(buf, off, t.shape)
            vals = np.frombuffer(buf, dtype=np.int16, count=idx.size, offset=off)
            off += 2 * idx.size
            _apply_changes(t, idx, vals)
            total += idx.size
        if off != len(buf):
            raise ValueError(f"{self.name}: {len(buf) - off} trailing bytes")
        return total


def _naive_index_parts(idx: np.ndarray, shape: torch.Size) -> list[bytes]:
    """Naive: u64 count, then flat int32 indices."""
    return [struct.pack("<Q", idx.size), idx.astype(np.int32).tobytes()]


def _naive_parse_index(buf: memoryview, off: int, shape: torch.Size) -> tuple[np.ndarray, int]:
    (count,) = struct.unpack_from("<Q", buf, off)
    off += 8
    idx = np.frombuffer(buf, dtype=np.int32, count=count, offset=off).astype(np.int64)
    return idx, off + 4 * count


_AUTHORS_HEADER = struct.Struct("<QQBBB")  # num_changed, num_rows_nonempty, row-gap/count/col-gap widths


def _authors_index_parts(idx: np.ndarray, shape: torch.Size) -> list[bytes]:
    """Authors' codec, index part of one tensor viewed 2-D.

    For each non-empty row: the gap since the previous non-empty row (first one absolute), the number of
    changes in that row, and column gaps that restart at each row (first column absolute). Row gaps and
    counts are narrowed to u8/u16/u32 per tensor; column gaps are u16 (u32 only for > 65536 columns).
    """
    _, ncols = _as_2d(shape)
    rows = idx // ncols
    cols = idx - rows * ncols
    if idx.size:
        starts = np.concatenate(([0], np.flatnonzero(np.diff(rows)) + 1))
    else:
        starts = np.zeros(0, dtype=np.int64)
    row_ids = rows[starts]
    row_gaps = _narrow(np.diff(row_ids, prepend=0))
    counts = _narrow(np.diff(np.append(starts, idx.size)))
    col_gaps = np.empty_like(cols)
    col_gaps[1:] = cols[1:] - cols[:-1]
    col_gaps[starts] = cols[starts]
    col_gaps = col_gaps.astype(np.uint16 if ncols <= 65536 else np.uint32)
    header = _AUTHORS_HEADER.pack(
        idx.size,
        starts.size,
        _DTYPE_CODE[row_gaps.dtype],
        _DTYPE_CODE[counts.dtype],
        _DTYPE_CODE[col_gaps.dtype],
    )
    return [header, row_gaps.tobytes(), counts.tobytes(), col_gaps.tobytes()]


def _authors_parse_index(buf: memoryview, off: int, shape: torch.Size) -> tuple[np.ndarray, int]:
    _, ncols = _as_2d(shape)
    count, num_rows, rw, cw, gw = _AUTHORS_HEADER.unpack_from(buf, off)
    off += _AUTHORS_HEADER.size
    row_gaps = np.frombuffer(buf, dtype=_CODE_DTYPE[rw], count=num_rows, offset=off)
    off += rw * num_rows
    counts = np.frombuffer(buf, dtype=_CODE_DTYPE[cw], count=num_rows, offset=off).astype(np.int64)
    off += cw * num_rows
    col_gaps = np.frombuffer(buf, dtype=_CODE_DTYPE[gw], count=count, offset=off).astype(np.int64)
    off += gw * count
    row_ids = np.cumsum(row_gaps, dtype=np.int64)
    # Column = running sum of gaps within the row: a global cumsum minus its value before each row.
    csum = np.cumsum(col_gaps)
    starts = np.cumsum(counts) - counts
    before_row = csum[starts] - col_gaps[starts] if count else np.zeros(0, dtype=np.int64)
    cols = csum - np.repeat(before_row, counts)
    idx = np.repeat(row_ids, counts) * ncols + cols
    return idx, off


BASELINES = {
    "naive": Baseline("naive", _naive_index_parts, _naive_parse_index),
    "authors": Baseline("authors", _authors_index_parts, _authors_parse_index),
}
