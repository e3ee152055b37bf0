"""Test helpers for the codec and patch tests: reference states, bitwise comparison and frame surgery.

Nothing here imports pulseloco's private helpers: frames are parsed and re-assembled from the documented
layout (``<4sHHI`` prefix, JSON header, index section, value section, xxh3-64 of everything before), so a
test can change any field and still pass the checksum, which makes the deeper validation do the work.
"""

from __future__ import annotations

import copy
import json
import math
import resource
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from pulseloco.codec.frame import FLAG_HEADER_ZSTD, header_text

PREFIX = struct.Struct("<4sHHI")
CHECKSUM_BYTES = 8

INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
WIDTH = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8}
WIRE_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ----------------------------------------------------------------------------------------------- tensors


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Flat signed-integer view of a floating tensor's bit patterns (a contiguous copy when needed)."""
    return tensor.detach().contiguous().reshape(-1).view(INT_VIEW[tensor.dtype])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bitwise equality: same dtype, same shape, same bit pattern at every element (NaN payloads, -0.0)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = bits(actual), bits(expected)
    diff = torch.nonzero(a != e).reshape(-1)
    assert diff.numel() == 0, f"{what}: {diff.numel()} elements differ, first at flat index {diff[:5].tolist()}"


def assert_state_bits_equal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert_bits_equal(actual[name], expected[name], name)


def snapshot(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Independent copies of every tensor (ties are not preserved: this is for comparisons only)."""
    return {name: t.detach().clone() for name, t in state.items()}


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bit patterns are uniformly random: NaNs with any payload, infinities,
    subnormals and both zeros all occur."""
    int_dtype = INT_VIEW[dtype]
    info = torch.iinfo(int_dtype)
    raw = torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=gen).to(int_dtype)
    return raw.view(dtype)


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Bit patterns a float comparison gets wrong: both zeros, NaNs with different payloads and signs,
    infinities, the smallest subnormal."""
    patterns = {
        torch.bfloat16: [0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC0, 0x7F81, 0x7F80, 0xFF80, 0x0001],
        torch.float16: [0x0000, 0x8000, 0x7E00, 0x7E01, 0xFE00, 0x7C01, 0x7C00, 0xFC00, 0x0001],
        torch.float32: [
            0x00000000,
            0x80000000,
            0x7FC00000,
            0x7FC00001,
            0xFFC00000,
            0x7F800001,
            0x7F800000,
            0xFF800000,
            0x00000001,
        ],
    }[dtype]
    width = WIDTH[dtype]
    arr = np.array(patterns, dtype=f"<u{width}").view(f"<i{width}")
    return torch.from_numpy(arr.copy()).view(dtype)


def changed_copy(base: torch.Tensor, mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``torch.where(mask, other, base)`` where ``other`` differs bitwise from ``base`` at every element.

    The result is the golden reference: exactly the masked elements change bit pattern. Changes mix
    one-ulp steps (the common case in RL updates) with arbitrary bit patterns.
    """
    int_dtype = INT_VIEW[base.dtype]
    base_bits = base.detach().contiguous().view(int_dtype)
    ulp = base_bits + 1
    wild = random_bits(tuple(base.shape), base.dtype, gen).view(int_dtype)
    use_wild = torch.rand(tuple(base.shape), generator=gen) < 0.3
    other = torch.where(use_wild, wild, ulp)
    other = torch.where(other == base_bits, base_bits ^ 1, other)  # guarantee a different pattern
    return torch.where(mask, other, base_bits).view(base.dtype)


def random_mask(shape: tuple[int, ...], density: float, gen: torch.Generator) -> torch.Tensor:
    if density >= 1.0:
        return torch.ones(shape, dtype=torch.bool)
    if density <= 0.0:
        return torch.zeros(shape, dtype=torch.bool)
    return torch.rand(shape, generator=gen) < density


# ---------------------------------------------------------------------------------------------- frames


@dataclass
class Frame:
    """A parsed frame whose every part can be changed, then re-assembled with a correct checksum."""

    magic: bytes
    fmt: int
    flags: int
    header: dict[str, Any]
    index_stored: bytes
    value_stored: bytes
    extra: bytes = field(default=b"")

    @classmethod
    def parse(cls, payload: bytes) -> Frame:
        magic, fmt, flags, header_len = PREFIX.unpack_from(payload)
        start = PREFIX.size + header_len
        header = json.loads(header_text(payload[PREFIX.size : start], flags))
        flags &= ~FLAG_HEADER_ZSTD  # re-assembled with the header as plain JSON
        idx_size = header["index_section"]["size"]
        val_size = header["value_section"]["size"]
        index_stored = payload[start : start + idx_size]
        value_stored = payload[start + idx_size : start + idx_size + val_size]
        assert start + idx_size + val_size + CHECKSUM_BYTES == len(payload)
        assert xxhash.xxh3_64_digest(payload[:-CHECKSUM_BYTES]) == payload[-CHECKSUM_BYTES:]
        return cls(magic, fmt, flags, header, index_stored, value_stored)

    def copy(self) -> Frame:
        return copy.deepcopy(self)

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self.header["tensors"]

    def tensor(self, name: str) -> dict[str, Any]:
        return next(t for t in self.tensors if t["name"] == name)

    # --- sections, decompressed and split per tensor

    @staticmethod
    def _raw(stored: bytes, section: Mapping[str, Any]) -> bytes:
        if section["codec"] == "zstd":
            return zstandard.ZstdDecompressor().decompress(stored)
        return stored

    def index_parts(self) -> list[bytes]:
        raw = self._raw(self.index_stored, self.header["index_section"])
        parts, offset = [], 0
        for t in self.tensors:
            parts.append(raw[offset : offset + t["index"]["size"]])
            offset += t["index"]["size"]
        return parts

    def _widths(self) -> list[int]:
        mode = self.header["values"]
        if mode == "float32":
            return [4 for _ in self.tensors]
        return [WIDTH[WIRE_DTYPE[t["dtype"]]] for t in self.tensors]

    def value_parts(self) -> list[np.ndarray]:
        """Per tensor, its wire values as a ``(count, width)`` uint8 array (byte planes undone)."""
        raw = np.frombuffer(self._raw(self.value_stored, self.header["value_section"]), dtype=np.uint8)
        widths = self._widths()
        parts = [np.zeros((t["count"], w), dtype=np.uint8) for t, w in zip(self.tensors, widths)]
        offset = 0
        for j in range(max(widths, default=0)):
            for t, w, part in zip(self.tensors, widths, parts):
                if w > j:
                    part[:, j] = raw[offset : offset + t["count"]]
                    offset += t["count"]
        assert offset == raw.size
        return parts

    def set_sections(self, index_parts: list[bytes], value_parts: list[np.ndarray]) -> None:
        """Store both sections raw (uncompressed) from per-tensor parts; every size field is made consistent
        (tensor counts are taken from ``value_parts``), so only what a test changes afterwards is wrong."""
        widths = self._widths()
        for t, part, data in zip(self.tensors, value_parts, index_parts):
            t["count"] = int(part.shape[0])
            t["index"]["size"] = len(data)
        planes = []
        for j in range(max(widths, default=0)):
            for w, part in zip(widths, value_parts):
                if w > j:
                    planes.append(part[:, j].tobytes())
        self.index_stored = b"".join(index_parts)
        self.value_stored = b"".join(planes)
        self.header["index_section"] = {"codec": "raw", "raw": len(self.index_stored), "size": len(self.index_stored)}
        self.header["value_section"] = {"codec": "raw", "raw": len(self.value_stored), "size": len(self.value_stored)}

    def decompress_sections(self) -> None:
        """Re-store both sections raw, leaving every size consistent."""
        self.set_sections(self.index_parts(), self.value_parts())

    # --- assembly

    def header_json(self) -> bytes:
        return json.dumps(self.header, separators=(",", ":")).encode()

    def assemble(self, *, header_json: bytes | None = None, header_len: int | None = None) -> bytes:
        """The frame's bytes with a correct checksum; ``header_json`` / ``header_len`` override the encoded
        header and its declared length."""
        hj = self.header_json() if header_json is None else header_json
        hl = len(hj) if header_len is None else header_len
        body = PREFIX.pack(self.magic, self.fmt, self.flags, hl) + hj + self.index_stored + self.value_stored
        body += self.extra
        return body + xxhash.xxh3_64_digest(body)


def rechecksum(payload: bytes) -> bytes:
    """Replace the last 8 bytes with the correct checksum of everything before them."""
    body = payload[:-CHECKSUM_BYTES]
    return body + xxhash.xxh3_64_digest(body)


def rice_stream(gaps: list[int], k: int, *, remainder_pad: int = 0, unary_tail: bytes = b"") -> bytes:
    """Reference Rice code as documented in :mod:`pulseloco.codec.indices`: a unary stream (``q`` zeros then a
    one, zero-padded to a byte) followed by ``k``-bit remainders, most significant bit first, zero-padded.

    ``remainder_pad`` is OR-ed into the padding bits of the remainder stream and ``unary_tail`` appended to the
    unary stream, to build invalid streams.
    """
    unary_bits: list[int] = []
    for g in gaps:
        unary_bits += [0] * (g >> k) + [1]
    unary = np.packbits(np.array(unary_bits, dtype=np.uint8)).tobytes() + unary_tail
    rem_bits: list[int] = []
    for g in gaps:
        r = g & ((1 << k) - 1)
        rem_bits += [(r >> (k - 1 - b)) & 1 for b in range(k)]
    rem = bytearray(np.packbits(np.array(rem_bits, dtype=np.uint8)).tobytes()) if rem_bits else bytearray()
    if remainder_pad:
        assert len(rem_bits) % 8, "no padding bits to set"
        rem[-1] |= remainder_pad
    return unary + bytes(rem)


def gaps_of(indices: list[int]) -> list[int]:
    prev, out = -1, []
    for i in indices:
        out.append(i - prev - 1)
        prev = i
    return out


def zstd_frame_declaring(content_size: int, block: bytes = b"\0" * 16) -> bytes:
    """A zstd frame header that declares ``content_size`` bytes, followed by one small raw block: a
    decompression bomb's header without the bomb (decoding it fails, but only after allocating)."""
    descriptor = 0b1100_0000  # 8-byte frame content size, window descriptor present
    window = 0x58
    block_header = (len(block) << 3) | 1  # raw block, last
    return (
        struct.pack("<IBB", 0xFD2FB528, descriptor, window)
        + struct.pack("<Q", content_size)
        + block_header.to_bytes(3, "little")
        + block
    )


def numel(shape: list[int]) -> int:
    return math.prod(shape)


# ------------------------------------------------------------------------------------------------ memory


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextmanager
def address_space_limit(extra_bytes: int = 1 << 30) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``extra_bytes`` for the block.

    Used to prove a decoder bounds declared sizes *before* allocating: with the cap, allocating what a
    malicious header declares fails with ``MemoryError`` (a crash, not a ``PayloadError``) whatever the
    machine's overcommit policy, instead of quietly succeeding on a big machine.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
