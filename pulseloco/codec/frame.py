"""The pulseloco sparse payload frame: named sparse tensors in one versioned, self-describing frame.

Layout (all integers little-endian)::

    magic "PLCO" | format u16 | flags u16 | header_len u32 | header (UTF-8 JSON) | index section
    | value section | xxh3-64 of everything before (8 bytes)

With flag bit 0 set (:data:`FLAG_HEADER_ZSTD`), the ``header_len`` bytes of the header are its JSON as one zstd frame
(declaring its size) compressed against the format's fixed dictionary of header text (:data:`HEADER_DICTIONARY`);
the encoder sets it where that is shorter: a frame of the trainers' exchange then carries a 65-75 byte header
instead of about 290, and a peer of a group of R sends and receives some 2R frames a round.

The header names every tensor (name, shape, dtype, count, index method and size), the value mode, the
patch's ``version`` / ``base_version``, the digests of the base and resulting states, and for each section
its stored size, its decompressed size and whether it is zstd-compressed. Index codes of all tensors are
concatenated into the index section (see :mod:`pulseloco.codec.indices`). Values are transformed for
compressibility (:func:`pulseloco.codec.bits.to_wire_values`) and stored as byte planes: byte 0 of every
value of every tensor, then byte 1, and so on, so that exponent bytes sit together; the value section is then
compressed with zstd (level 1 by default, multithreaded for large sections).

Decoding trusts nothing: every declared size is checked against the frame length and against limits before
anything is allocated or decompressed, and each problem raises a specific :class:`PayloadError` subclass.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np
import torch
import xxhash
import zstandard

from pulseloco.codec.bits import bit_format, from_wire_values, to_wire_values
from pulseloco.codec.indices import IndexCode, decode_indices, encode_indices, max_code_bytes
from pulseloco.codec.lut import LUT_BITS, decode_lut, encode_lut, lut_value_bytes
from pulseloco.errors import (
    BadMagicError,
    ChecksumError,
    InvalidIndicesError,
    PayloadError,
    PayloadSizeError,
    TruncatedPayloadError,
    UnsupportedVersionError,
)
from pulseloco.parallel import num_threads, parallel_map

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "FORMAT_VERSION",
    "MAGIC",
    "VALUE_MODES",
    "DecodedPayload",
    "FrameHeader",
    "SparseTensor",
    "decode_payload",
    "encode_payload",
    "peek_header",
]

MAGIC = b"PLCO"
#: 2: digests are the chunked scheme of :mod:`pulseloco.digest` (version 1 hashed each state in one stream), so
#: a peer of another release reports the format instead of failing a digest check. 3: the header leaves out
#: ``base_version``, the digests and ``meta`` where they are empty (a frame of the trainers' exchange carries none
#: of them, and a peer of a large group sends and receives hundreds of frames a round).
#: 4: the header may be zstd-compressed against :data:`HEADER_DICTIONARY` (flag bit 0), and unknown flags are refused.
FORMAT_VERSION = 4
#: The formats this release decodes: version 2 frames (every header field present) and 3 read as before.
READABLE_FORMATS = (2, 3, 4)
#: Flag bit 0 (format 4): the header is zstd-compressed against :data:`HEADER_DICTIONARY`.
FLAG_HEADER_ZSTD = 1
#: The text that compressed headers are coded against: typical header JSON of the trainers' exchange and of
#: PULSESync patches. Part of format 4: changing one byte of it makes every compressed header unreadable, so a
#: new dictionary needs a new format version.
HEADER_DICTIONARY = (
    b'"meta":{"squashed_versions":[]},"base_digest":"","result_digest":"","index_section":{"codec":"zstd","raw":'
    b'"size":},"value_section":{"codec":"raw","raw":,"size":}}{"version":1,"base_version":0,"values":"delta",'
    b'"tensors":[{"name":"model.layers.0.self_attn.q_proj.weight","shape":[],"dtype":"bfloat16","count":,'
    b'"index":{"method":"bitmask","k":0,"size":}},{"name":"model.embed_tokens.weight","dtype":"float16","index":'
    b'{"method":"all","k":0,"size":0}},{"name":"lm_head.weight","index":{"method":"empty","k":0,"size":0}}],'
    b'{"version":0,"values":"float32","tensors":[{"name":"pseudo_gradient_sum","shape":[],"dtype":"float32","count":'
    b',"index":{"method":"rice","k":4,"size":},"bits":1,"groups":[]}],"index_section":{"codec":"raw","raw":,"size":}'
    b',"value_section":{"codec":"raw","raw":,"size":}}{"version":0,"values":"lut","tensors":[{"name":"pseudo_gradient'
    b'","shape":[],"dtype":"float32","count":,"index":{"method":"rice","k":5,"size":},"bits":2,"groups":[]}],'
    b'"index_section":{"codec":"raw","raw":,"size":},"value_section":{"codec":"raw","raw":,"size":}}'
)
#: zstd level for headers: a patch's header of 300 tensors (43 kB of JSON) codes in 0.3 ms to 1.2 kB (level 19:
#: 11 ms, and larger); an exchange frame's header to about 65 bytes.
_HEADER_LEVEL = 9
_HEADER_DICT = zstandard.ZstdCompressionDict(HEADER_DICTIONARY, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
_HEADER_DICT.precompute_compress(level=_HEADER_LEVEL)  # once, not per frame
_PREFIX = struct.Struct("<4sHHI")
_CHECKSUM_BYTES = 8
#: Header JSON above this size is rejected before parsing.
MAX_HEADER_BYTES = 16 << 20
#: Default bound on the number of changed elements a receiver accepts in one payload (2**31).
DEFAULT_MAX_ELEMENTS = 1 << 31
#: Bound on a single tensor's element count accepted from the wire.
MAX_NUMEL = 1 << 40
#: Tensors with fewer entries are coded in the calling thread (their numpy calls are too short to share cores).
_POOLED_COUNT = 1 << 16
#: Sections above this size are compressed with zstd worker threads.
_THREADED_BYTES = 8 << 20

#: ``absolute``: new values in the tensor's dtype; ``delta``: modular difference of the bit patterns
#: (tensor dtype width); ``float32``: FP32 values for tensors of any dtype (sparse pseudo-gradients); ``lut``:
#: quantized FP32 values as per-group tables and packed codes (:mod:`pulseloco.codec.lut`).
VALUE_MODES = ("absolute", "delta", "float32", "lut")


@dataclass(frozen=True)
class SparseTensor:
    """One named tensor's sparse entries.

    ``indices`` are sorted, strictly increasing flat int64 offsets into a tensor of ``shape`` and ``dtype``;
    ``values`` hold one entry per index: floats of ``dtype`` (absolute mode), FP32 (float32 mode) or the
    signed-integer view of the modular bit-pattern difference (delta mode). ``groups`` (lut mode only): the
    entries cut into consecutive groups of these sizes, each with its own table of values.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor
    values: torch.Tensor
    groups: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        """Number of elements of the dense tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class FrameHeader:
    """The validated header of a payload, with the byte accounting of its sections."""

    version: int
    base_version: int | None
    base_digest: str
    result_digest: str
    value_mode: str
    tensors: tuple[Mapping[str, Any], ...]
    meta: Mapping[str, Any]
    header_bytes: int
    index_bytes: int
    value_bytes: int
    total_bytes: int
    index_section: Mapping[str, Any] = field(repr=False)
    value_section: Mapping[str, Any] = field(repr=False)

    @property
    def num_changed(self) -> int:
        """Total number of sparse entries over all tensors."""
        return sum(int(t["count"]) for t in self.tensors)


@dataclass(frozen=True)
class DecodedPayload:
    """A fully decoded and validated payload."""

    header: FrameHeader
    entries: tuple[SparseTensor, ...]


def _value_format(mode: str, dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """The dtype in which values of ``mode`` for a tensor of ``dtype`` travel, and its width in bytes."""
    fmt = bit_format(dtype)
    if mode in ("float32", "lut"):
        return torch.float32, 4
    if mode == "delta":
        return fmt.int_dtype, fmt.width
    return fmt.dtype, fmt.width


def _compress(raw: bytes, level: int) -> tuple[bytes, str]:
    """zstd-compress ``raw`` if that makes it smaller, else keep it raw."""
    if not raw:
        return b"", "raw"
    # zstd's multithreaded mode gives the same bytes for any number of workers >= 1 (not the same as 0).
    threads = num_threads() if len(raw) >= _THREADED_BYTES else 0
    packed = zstandard.ZstdCompressor(level=level, threads=threads, write_content_size=True).compress(raw)
    if len(packed) < len(raw):
        return packed, "zstd"
    return raw, "raw"


def _decompress(
    stored: bytes | memoryview, codec: str, raw_size: int, dict_data: zstandard.ZstdCompressionDict | None = None
) -> bytes | memoryview:
    """Inverse of :func:`_compress` (``dict_data``: the dictionary it was compressed against), bounded: output
    larger than the declared ``raw_size`` is refused. A raw section comes back as given (a view stays a view)."""
    if codec == "raw":
        if len(stored) != raw_size:
            raise PayloadSizeError(f"raw section is {len(stored)} bytes, header says {raw_size}")
        return stored
    if codec != "zstd":
        raise PayloadError(f"unknown section codec {codec!r}; expected 'raw' or 'zstd'")
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise PayloadError(f"section is not a zstd frame: {exc}") from None
    if declared != raw_size:
        raise PayloadSizeError(f"zstd frame declares {declared} bytes, header says {raw_size}")
    try:
        out = zstandard.ZstdDecompressor(dict_data=dict_data).decompress(
            stored, max_output_size=raw_size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise PayloadError(f"corrupt zstd section: {exc}") from None
    if len(out) != raw_size:
        raise PayloadSizeError(f"section decompressed to {len(out)} bytes, header says {raw_size}")
    return out


def encode_payload(
    entries: Sequence[SparseTensor],
    *,
    value_mode: str,
    version: int,
    base_version: int | None,
    base_digest: str = "",
    result_digest: str = "",
    level: int = 1,
    meta: Mapping[str, Any] | None = None,
) -> bytes:
    """Encode sparse tensors into one frame.

    Raises :class:`ValueError` (never a partial frame) for an unknown ``value_mode``, duplicate names,
    values of the wrong dtype or length, or indices that are not strictly increasing and in range.
    """
    if value_mode not in VALUE_MODES:
        raise ValueError(f"value_mode must be one of {VALUE_MODES}, got {value_mode!r}")
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in payload")

    def encode_entry(entry: SparseTensor) -> tuple[dict[str, Any], bytes, list[bytes]]:
        value_dtype, width = _value_format(value_mode, entry.dtype)
        indices_K = entry.indices.detach().to("cpu", torch.int64).numpy()
        values_K = entry.values.detach().cpu()
        if values_K.dtype != value_dtype or values_K.numel() != indices_K.size:
            raise ValueError(
                f"tensor {entry.name!r}: {value_mode} mode needs {indices_K.size} values of {value_dtype}, "
                f"got {values_K.numel()} of {values_K.dtype}"
            )
        code = encode_indices(indices_K, entry.numel)
        info: dict[str, Any] = {
            "name": entry.name,
            "shape": list(entry.shape),
            "dtype": bit_format(entry.dtype).name,
            "count": int(indices_K.size),
            "index": {"method": code.method, "k": code.k, "size": len(code.data)},
        }
        if value_mode == "lut":
            if entry.groups is None:
                raise ValueError(f"tensor {entry.name!r}: lut mode needs the value groups")
            lut_bytes, info["bits"] = encode_lut(values_K.reshape(-1), entry.groups)
            info["groups"] = [int(g) for g in entry.groups]
            return info, code.data, [lut_bytes]
        wire_K = to_wire_values(values_K.reshape(-1), value_mode)
        byte_planes = wire_K.view(np.uint8).reshape(-1, width)
        planes = [np.ascontiguousarray(byte_planes[:, j]).tobytes() for j in range(width)]
        return info, code.data, planes

    encoded = parallel_map(encode_entry, entries, cost=lambda entry: entry.indices.numel(), inline_below=_POOLED_COUNT)
    tensors = [info for info, _, _ in encoded]
    index_raw = b"".join(data for _, data, _ in encoded)
    num_planes = max((len(entry_planes) for _, _, entry_planes in encoded), default=0)
    # Plane j of every tensor, then plane j + 1: joined once, and each input dropped as soon as it is consumed
    # (a frame's transient memory is a few copies of its values, not one per step).
    value_raw = b"".join(
        entry_planes[j] for j in range(num_planes) for _, _, entry_planes in encoded if j < len(entry_planes)
    )
    del encoded
    index_size, value_size = len(index_raw), len(value_raw)
    index_stored, index_codec = _compress(index_raw, level)
    del index_raw
    value_stored, value_codec = _compress(value_raw, level)
    del value_raw
    optional = {
        "base_version": None if base_version is None else int(base_version),
        "base_digest": base_digest,
        "result_digest": result_digest,
        "meta": dict(meta or {}),
    }
    header = {
        "version": int(version),
        **{key: value for key, value in optional.items() if value not in (None, "", {})},
        "values": value_mode,
        "tensors": tensors,
        "index_section": {"codec": index_codec, "raw": index_size, "size": len(index_stored)},
        "value_section": {"codec": value_codec, "raw": value_size, "size": len(value_stored)},
    }
    header_json = json.dumps(header, separators=(",", ":")).encode()
    stored_header, flags = header_json, 0
    packed = _header_compressor().compress(header_json)
    if len(packed) < len(header_json):
        stored_header, flags = packed, FLAG_HEADER_ZSTD
    pieces = [_PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(stored_header)), stored_header, index_stored, value_stored]
    checksum = xxhash.xxh3_64()  # over the body as it is joined below, without a second copy of it
    for piece in pieces:
        checksum.update(piece)
    pieces.append(checksum.digest())
    return b"".join(pieces)


def _header_compressor() -> zstandard.ZstdCompressor:
    """A compressor for header JSON against :data:`HEADER_DICTIONARY` (no dictionary id or zstd checksum: the
    format fixes the dictionary and the frame's xxh3 covers the bytes; the frame declares its size)."""
    return zstandard.ZstdCompressor(
        level=_HEADER_LEVEL, dict_data=_HEADER_DICT, write_content_size=True, write_checksum=False, write_dict_id=False
    )


def header_text(stored: bytes, flags: int) -> bytes:
    """The header JSON of a frame from the ``stored`` header bytes and the prefix's ``flags``: decompressed where
    :data:`FLAG_HEADER_ZSTD` is set (at most :data:`MAX_HEADER_BYTES`), else as stored. Raises
    :class:`PayloadError` for other flag bits, a zstd frame that does not declare its size or declares more
    than the limit, or one that does not decompress to what it declares; nothing larger than the limit is
    allocated."""
    if flags & ~FLAG_HEADER_ZSTD:
        raise PayloadError(f"frame flags {flags:#06x} name features this release does not know")
    if not flags & FLAG_HEADER_ZSTD:
        return stored
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise PayloadError(f"compressed header is not a zstd frame: {exc}") from None
    if declared < 0:
        raise PayloadSizeError("compressed header declares no size: a format 4 frame's header zstd frame must")
    if declared > MAX_HEADER_BYTES:
        raise PayloadSizeError(f"compressed header declares {declared} bytes; at most {MAX_HEADER_BYTES} are read")
    try:
        return bytes(_decompress(stored, "zstd", declared, _HEADER_DICT))
    except PayloadError as exc:
        raise type(exc)(f"corrupt compressed header: {exc}") from None


def _is_int(value: object, minimum: int = 0, maximum: int | None = None) -> TypeGuard[int]:
    """Whether ``value`` is an int (not a bool) in ``minimum..maximum``; narrows it to int for mypy when true."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= minimum
        and (maximum is None or value <= maximum)
    )


def _check_section(section: object, what: str) -> Mapping[str, Any]:
    if not isinstance(section, dict) or not _is_int(section.get("raw")) or not _is_int(section.get("size")):
        raise PayloadError(f"header field {what!r} must hold non-negative integers 'raw' and 'size'")
    if section.get("codec") not in ("raw", "zstd"):
        raise PayloadError(f"header field {what}.codec must be 'raw' or 'zstd'")
    return section


def _parse_header(payload: bytes) -> tuple[dict[str, Any], int]:
    """Check prefix, length and checksum; return the parsed header JSON and the offset of the body."""
    view = memoryview(payload)
    if len(view) < _PREFIX.size:
        raise TruncatedPayloadError(f"payload of {len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, fmt, flags, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BadMagicError(f"payload starts with {bytes(magic)!r}, not {MAGIC!r}: not a pulseloco payload")
    if fmt not in READABLE_FORMATS:
        raise UnsupportedVersionError(
            f"payload format version {fmt}, this pulseloco reads versions "
            f"{', '.join(map(str, READABLE_FORMATS))}: "
            "run the same pulseloco release on sender and receiver"
        )
    if header_len > MAX_HEADER_BYTES:
        raise PayloadSizeError(f"header of {header_len} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    body_start = _PREFIX.size + header_len
    if len(view) < body_start + _CHECKSUM_BYTES:
        raise TruncatedPayloadError(f"payload of {len(view)} bytes ends inside its {header_len}-byte header")
    checksum_ok = xxhash.xxh3_64_digest(view[: len(view) - _CHECKSUM_BYTES]) == bytes(view[-_CHECKSUM_BYTES:])
    try:
        text = header_text(bytes(view[_PREFIX.size : body_start]), flags if fmt >= 4 else 0)
        header = json.loads(text.decode("utf-8"))
    except PayloadError:
        if not checksum_ok:
            raise ChecksumError("payload checksum mismatch (corrupted header or flags)") from None
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limits
        if not checksum_ok:
            raise ChecksumError("payload checksum mismatch (corrupted header)") from None
        raise PayloadError(f"payload header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise PayloadError("payload header must be a JSON object")
    idx = _check_section(header.get("index_section"), "index_section")
    val = _check_section(header.get("value_section"), "value_section")
    declared = body_start + idx["size"] + val["size"] + _CHECKSUM_BYTES
    if len(view) < declared:
        raise TruncatedPayloadError(f"payload is {len(view)} bytes, its header declares {declared}: truncated")
    if len(view) > declared:
        raise PayloadSizeError(f"payload is {len(view)} bytes, its header declares {declared}: trailing bytes")
    if not checksum_ok:
        raise ChecksumError("payload checksum mismatch: corrupted in transit or on disk")
    return header, body_start


def _validate_header(header: dict[str, Any], body_start: int, total: int, max_elements: int) -> FrameHeader:
    """Check every header field's type and range and that sizes add up; build the :class:`FrameHeader`."""
    mode = header.get("values")
    if mode not in VALUE_MODES:
        raise PayloadError(f"unknown value mode {mode!r}; expected one of {VALUE_MODES}")
    version = header.get("version")
    base_version = header.get("base_version")
    if not _is_int(version) or not (base_version is None or _is_int(base_version)):
        raise PayloadError("header 'version' and 'base_version' must be non-negative integers")
    for key in ("base_digest", "result_digest"):
        header.setdefault(key, "")
        if not isinstance(header[key], str) or len(header[key]) > 256:
            raise PayloadError(f"header {key!r} must be a string of at most 256 characters")
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise PayloadError("header 'meta' must be an object")
    tensors = header.get("tensors")
    if not isinstance(tensors, list):
        raise PayloadError("header 'tensors' must be a list")
    names: set[str] = set()
    total_count = index_size = value_size = 0
    for t in tensors:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise PayloadError("each tensor entry needs a string 'name'")
        name = t["name"]
        if name in names:
            raise PayloadError(f"tensor {name!r} appears twice in the payload")
        names.add(name)
        shape = t.get("shape")
        if not isinstance(shape, list) or len(shape) > 16 or not all(_is_int(s, 0, MAX_NUMEL) for s in shape):
            raise PayloadError(f"tensor {name!r}: shape must be a list of at most 16 non-negative integers")
        numel = math.prod(shape)
        if numel > MAX_NUMEL:
            raise PayloadSizeError(f"tensor {name!r}: {numel} elements exceeds the {MAX_NUMEL} limit")
        if not isinstance(t.get("dtype"), str):
            raise PayloadError(f"tensor {name!r}: missing dtype")
        dtype = bit_format(t["dtype"]).dtype
        count = t.get("count")
        if not _is_int(count, 0, numel):
            raise InvalidIndicesError(f"tensor {name!r}: count {count!r} is not in 0..{numel}")
        index = t.get("index")
        if (
            not isinstance(index, dict)
            or not isinstance(index.get("method"), str)
            or not _is_int(index.get("k"))
            or not _is_int(index.get("size"))
        ):
            raise PayloadError(f"tensor {name!r}: index must hold 'method', 'k' and 'size'")
        bound = max_code_bytes(index["method"], index["k"], count, numel)
        if index["size"] > bound:
            raise PayloadSizeError(
                f"tensor {name!r}: {index['method']} index of {index['size']} bytes exceeds the {bound} bytes "
                f"{count} indices into {numel} elements can take"
            )
        total_count += count
        index_size += index["size"]
        if mode == "lut":
            value_size += _lut_size(t, name, count)
        else:
            value_size += count * _value_format(mode, dtype)[1]
    if total_count > max_elements:
        raise PayloadSizeError(f"payload carries {total_count} elements, above this receiver's limit of {max_elements}")
    idx, val = header["index_section"], header["value_section"]
    if idx["raw"] != index_size:
        raise PayloadSizeError(f"index section declares {idx['raw']} bytes, its tensors add up to {index_size}")
    if val["raw"] != value_size:
        raise PayloadSizeError(f"value section declares {val['raw']} bytes, its tensors need {value_size}")
    return FrameHeader(
        version=version,
        base_version=base_version,
        base_digest=header["base_digest"],
        result_digest=header["result_digest"],
        value_mode=mode,
        tensors=tuple(tensors),
        meta=meta,
        header_bytes=body_start,
        index_bytes=idx["size"],
        value_bytes=val["size"],
        total_bytes=total,
        index_section=idx,
        value_section=val,
    )


def _lut_size(t: Mapping[str, Any], name: str, count: int) -> int:
    """The value bytes of a ``lut`` tensor entry, after checking its ``groups`` and ``bits`` fields."""
    groups, bits = t.get("groups"), t.get("bits")
    if not isinstance(groups, list) or len(groups) > count or not all(_is_int(g, 1, count) for g in groups):
        raise PayloadError(f"tensor {name!r}: lut 'groups' must be a list of at most {count} positive sizes")
    if sum(groups) != count:
        raise PayloadError(f"tensor {name!r}: lut groups add up to {sum(groups)} entries, count is {count}")
    if not _is_int(bits) or bits not in LUT_BITS:
        raise PayloadError(f"tensor {name!r}: lut 'bits' must be one of {LUT_BITS}")
    return lut_value_bytes(count, len(groups), bits)


def peek_header(payload: bytes, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> FrameHeader:
    """Validate the frame (magic, format, sizes, checksum, header fields) and return its header.

    Sections are not decompressed. Raises a :class:`PayloadError` subclass on any problem.
    """
    header, body_start = _parse_header(payload)
    return _validate_header(header, body_start, len(payload), max_elements)


def decode_payload(
    payload: bytes, *, max_elements: int = DEFAULT_MAX_ELEMENTS, header: FrameHeader | None = None
) -> DecodedPayload:
    """Decode and fully validate a frame (tensors are decoded in parallel, :mod:`pulseloco.parallel`).

    ``header``: what :func:`peek_header` returned for these same bytes, to skip parsing them twice.

    Raises a :class:`PayloadError` subclass on truncation, wrong magic or format version, checksum mismatch,
    sizes that do not add up or exceed ``max_elements``, or indices out of range / not strictly increasing.
    Nothing larger than the header's (bounded) declared sizes is ever allocated.
    """
    if header is None:
        header = peek_header(payload, max_elements=max_elements)
    elif header.total_bytes != len(payload):
        raise PayloadSizeError(f"header describes a {header.total_bytes}-byte payload, got {len(payload)} bytes")
    view = memoryview(payload)
    start = header.header_bytes
    index = header.index_section
    index_raw = bytes(_decompress(view[start : start + header.index_bytes], index["codec"], index["raw"]))
    start += header.index_bytes
    # The value section is read where it lies (a raw one is not copied; a compressed one is decompressed from it).
    value_raw = _decompress(
        view[start : start + header.value_bytes], header.value_section["codec"], header.value_section["raw"]
    )
    mode = header.value_mode
    if mode == "lut":
        return _decode_lut_entries(header, index_raw, value_raw)
    formats = [_value_format(mode, bit_format(t["dtype"]).dtype) for t in header.tensors]
    # Byte planes: plane j holds byte j of every value of every tensor at least j+1 bytes wide.
    plane_offsets: list[list[int]] = []
    offset = 0
    for j in range(max((w for _, w in formats), default=0)):
        offsets = []
        for t, (_, width) in zip(header.tensors, formats, strict=True):
            offsets.append(offset)
            if width > j:
                offset += t["count"]
        plane_offsets.append(offsets)
    index_offsets = np.cumsum([0] + [t["index"]["size"] for t in header.tensors]).tolist()
    values_buf = np.frombuffer(value_raw, dtype=np.uint8)

    def decode_entry(i: int) -> SparseTensor:
        t = header.tensors[i]
        value_dtype, width = formats[i]
        count, shape = t["count"], tuple(t["shape"])
        code = IndexCode(t["index"]["method"], t["index"]["k"], index_raw[index_offsets[i] : index_offsets[i + 1]])
        indices_K = decode_indices(code, count, math.prod(shape))
        wire_K = np.empty((count, width), dtype=np.uint8)
        for j in range(width):
            wire_K[:, j] = values_buf[plane_offsets[j][i] : plane_offsets[j][i] + count]
        bits_K = from_wire_values(wire_K.reshape(-1).view(np.dtype(f"<u{width}")), mode)
        int_dtype = bit_format(value_dtype).int_dtype if value_dtype.is_floating_point else value_dtype
        values_K = torch.from_numpy(bits_K.view(np.dtype(f"<i{width}"))).view(int_dtype)
        if value_dtype.is_floating_point:
            values_K = values_K.view(value_dtype)
        return SparseTensor(
            name=t["name"],
            shape=shape,
            dtype=bit_format(t["dtype"]).dtype,
            indices=torch.from_numpy(indices_K),
            values=values_K,
        )

    entries = parallel_map(
        decode_entry, range(len(header.tensors)), cost=lambda i: header.tensors[i]["count"], inline_below=_POOLED_COUNT
    )
    return DecodedPayload(header=header, entries=tuple(entries))


def _decode_lut_entries(header: FrameHeader, index_raw: bytes, value_raw: bytes | memoryview) -> DecodedPayload:
    """The tensors of a ``lut`` frame: each tensor's value bytes follow the previous tensor's."""
    entries = []
    index_offset = value_offset = 0
    for t in header.tensors:
        count, shape = t["count"], tuple(t["shape"])
        code = IndexCode(
            t["index"]["method"], t["index"]["k"], index_raw[index_offset : index_offset + t["index"]["size"]]
        )
        index_offset += t["index"]["size"]
        indices_K = decode_indices(code, count, math.prod(shape))
        size = lut_value_bytes(count, len(t["groups"]), t["bits"])
        values_K = decode_lut(value_raw[value_offset : value_offset + size], count, t["groups"], t["bits"])
        value_offset += size
        entries.append(
            SparseTensor(
                name=t["name"],
                shape=shape,
                dtype=bit_format(t["dtype"]).dtype,
                indices=torch.from_numpy(indices_K),
                values=values_K,
                groups=tuple(t["groups"]),
            )
        )
    return DecodedPayload(header=header, entries=tuple(entries))
