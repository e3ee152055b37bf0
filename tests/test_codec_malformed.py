"""Malformed frames: every case raises a specific ``PayloadError`` subclass and leaves the state as it was.

Most frames here are rebuilt with a correct checksum after the change (``codec_helpers.Frame``), so the
checksum does not catch them and the deeper validation (sizes, indices, header fields) must.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
import zstandard
from codec_helpers import (
    Frame,
    address_space_limit,
    assert_state_bits_equal,
    changed_copy,
    gaps_of,
    random_bits,
    random_mask,
    rechecksum,
    rice_stream,
    snapshot,
    zstd_frame_declaring,
)

from pulseloco.codec import DEFAULT_MAX_ELEMENTS, SparseTensor, decode_payload, encode_payload, peek_header
from pulseloco.codec.frame import FLAG_HEADER_ZSTD, READABLE_FORMATS, header_text
from pulseloco.errors import (
    BadMagicError,
    ChecksumError,
    DigestMismatchError,
    InvalidIndicesError,
    PatchError,
    PayloadError,
    PayloadSizeError,
    PulseLocoError,
    TensorMismatchError,
    TruncatedPayloadError,
    UnsupportedVersionError,
)
from pulseloco.sync import apply_patch, make_patch, state_digest


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Base and new states whose patch uses three index methods: rice (a), bitmask (b), all (c)."""
    gen = torch.Generator().manual_seed(1234)
    base = {
        "a": random_bits((300,), torch.bfloat16, gen),
        "b": random_bits((8, 8), torch.float32, gen),
        "c": random_bits((5,), torch.float16, gen),
    }
    masks = {
        "a": torch.zeros(300, dtype=torch.bool).index_fill_(0, torch.tensor([3, 17, 18, 120, 299]), True),
        "b": random_mask((8, 8), 0.5, gen),
        "c": torch.ones(5, dtype=torch.bool),
    }
    new = {k: changed_copy(v, masks[k], gen) for k, v in base.items()}
    return base, new


BASE, NEW = _states()


def _payload(mode: str = "absolute") -> bytes:
    return make_patch(BASE, NEW, version=7, base_version=6, values=mode)


def _fresh_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in BASE.items()}


def assert_rejected(
    payload: bytes,
    error: type[PayloadError] | tuple[type[PayloadError], ...],
    match: str | None = None,
    state: dict[str, torch.Tensor] | None = None,
    *,
    decode: bool = True,
) -> None:
    """``decode_payload`` (when ``decode``) and ``apply_patch`` both raise ``error``; the state is unchanged."""
    for e in error if isinstance(error, tuple) else (error,):
        assert issubclass(e, PayloadError) and issubclass(e, ValueError)
    if decode:
        with pytest.raises(error, match=match) as info:
            decode_payload(payload)
        assert str(info.value), "the message must say what is wrong"
    state = _fresh_state() if state is None else state
    before, digest = snapshot(state), state_digest(state)
    with pytest.raises(error, match=match):
        apply_patch(state, payload)
    assert state_digest(state) == digest
    assert_state_bits_equal(state, before)


def _frame(mode: str = "absolute") -> Frame:
    frame = Frame.parse(_payload(mode))
    frame.decompress_sections()
    return frame


def test_fixture_covers_rice_bitmask_and_all() -> None:
    methods = {t["name"]: t["index"]["method"] for t in peek_header(_payload()).tensors}
    assert methods == {"a": "rice", "b": "bitmask", "c": "all"}
    # the re-assembled frame with raw sections is still valid and applies
    state = _fresh_state()
    apply_patch(state, _frame().assemble())
    assert_state_bits_equal(state, NEW)


# ------------------------------------------------------------------------------- truncation and flips


def test_every_truncation_is_rejected() -> None:
    payload = _payload()
    state = _fresh_state()
    for length in range(len(payload)):
        with pytest.raises(TruncatedPayloadError):
            decode_payload(payload[:length])
        with pytest.raises(TruncatedPayloadError):
            apply_patch(state, payload[:length])
    assert_state_bits_equal(state, BASE)


@pytest.mark.parametrize("mode", ["absolute", "delta"])
@pytest.mark.parametrize("xor", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_is_rejected(mode: str, xor: int) -> None:
    payload = _payload(mode)
    header_len = int.from_bytes(payload[8:12], "little")
    body_start = 12 + header_len
    state = _fresh_state()
    for pos in range(len(payload)):
        corrupt = bytearray(payload)
        corrupt[pos] ^= xor
        with pytest.raises(PayloadError) as info:
            apply_patch(state, bytes(corrupt))
        if pos < 4:
            assert isinstance(info.value, BadMagicError), pos
        elif pos < 6:  # a flip to another format this release reads (3 -> 2) is caught by the checksum
            expected = ChecksumError if int.from_bytes(corrupt[4:6], "little") in READABLE_FORMATS else None
            assert isinstance(info.value, expected or UnsupportedVersionError), pos
        elif 6 <= pos < 8 or pos >= body_start:
            # flags, sections and the checksum itself: only the checksum can tell
            assert isinstance(info.value, ChecksumError), pos
    assert_state_bits_equal(state, BASE)


@pytest.mark.parametrize("mode", ["absolute", "delta"])
def test_value_flip_with_valid_checksum_raises_digest_mismatch_and_restores(mode: str) -> None:
    frame = _frame(mode)
    value_bytes = bytearray(frame.value_stored)
    state = _fresh_state()
    for pos in range(len(value_bytes)):
        corrupt = frame.copy()
        flipped = bytearray(value_bytes)
        flipped[pos] ^= 0x01
        corrupt.value_stored = bytes(flipped)
        with pytest.raises(DigestMismatchError, match="restored"):
            apply_patch(state, corrupt.assemble())
        assert state_digest(state) == state_digest(BASE)
    assert_state_bits_equal(state, BASE)


def test_digest_mismatch_restores_tied_and_noncontiguous_tensors() -> None:
    gen = torch.Generator().manual_seed(5)
    emb = random_bits((6, 9), torch.bfloat16, gen)
    base = {"emb": emb, "head": emb, "emb_t": emb.t(), "x": random_bits((4, 4), torch.float32, gen).t()}
    new_emb = changed_copy(emb, random_mask((6, 9), 0.4, gen), gen)
    new = {
        "emb": new_emb,
        "head": new_emb,
        "emb_t": new_emb.t(),
        "x": changed_copy(base["x"], random_mask((4, 4), 0.5, gen), gen),
    }
    for mode in ("absolute", "delta"):
        frame = Frame.parse(make_patch(base, new, version=1, base_version=0, values=mode))
        frame.decompress_sections()
        raised = 0
        for pos in range(len(frame.value_stored)):
            corrupt = frame.copy()
            flipped = bytearray(frame.value_stored)
            flipped[pos] ^= 0x40
            corrupt.value_stored = bytes(flipped)
            state_emb = emb.clone()
            state = {"emb": state_emb, "head": state_emb, "emb_t": state_emb.t(), "x": base["x"].t().clone().t()}
            try:
                apply_patch(state, corrupt.assemble())
            except DigestMismatchError:
                raised += 1
                assert_state_bits_equal(state, base)
            else:
                # the flipped value belonged to an alias that a later alias overwrote: the state is the
                # announced one, which is what the digest check guarantees
                assert_state_bits_equal(state, new)
            assert state["head"] is state_emb
            assert state["emb_t"].data_ptr() == state_emb.data_ptr()
        assert raised >= len(frame.value_stored) // 3, (mode, raised)


def test_appended_bytes_are_rejected() -> None:
    payload = _payload()
    assert_rejected(payload + b"\0", PayloadSizeError, "trailing")
    assert_rejected(rechecksum(payload[:-8] + b"\0" * 9), PayloadSizeError, "trailing")
    frame = _frame()
    frame.extra = b"junk"
    assert_rejected(frame.assemble(), PayloadSizeError, "trailing")


# --------------------------------------------------------------------------------------------- prefix


@pytest.mark.parametrize("magic", [b"PLC0", b"\0\0\0\0", b"plco", b"PK\x03\x04"])
def test_wrong_magic(magic: bytes) -> None:
    frame = _frame()
    frame.magic = magic
    assert_rejected(frame.assemble(), BadMagicError, "not a pulseloco payload")


@pytest.mark.parametrize("fmt", [0, 1, 5, 255, 65535])
def test_unknown_format_version(fmt: int) -> None:
    frame = _frame()
    frame.fmt = fmt
    assert_rejected(frame.assemble(), UnsupportedVersionError, f"version {fmt}")


@pytest.mark.parametrize("header_len", [2**32 - 1, (16 << 20) + 1])
def test_huge_header_len_is_refused_before_reading(header_len: int) -> None:
    frame = _frame()
    assert_rejected(frame.assemble(header_len=header_len), PayloadSizeError, "header of")


def test_headers_travel_compressed_and_read_back() -> None:
    payload = _payload()
    frame = Frame.parse(payload)
    assert int.from_bytes(payload[6:8], "little") == FLAG_HEADER_ZSTD
    stored = int.from_bytes(payload[8:12], "little")
    assert stored < len(frame.header_json()) / 2
    assert json.loads(header_text(payload[12 : 12 + stored], FLAG_HEADER_ZSTD)) == frame.header
    # the same frame with its header as plain JSON (flag clear) reads the same
    plain = frame.assemble()
    assert int.from_bytes(plain[6:8], "little") == 0
    assert peek_header(plain).tensors == peek_header(payload).tensors


@pytest.mark.parametrize("flags", [2, 0x8000, FLAG_HEADER_ZSTD | 4])
def test_unknown_flags_are_refused(flags: int) -> None:
    frame = _frame()
    frame.flags = flags
    assert_rejected(frame.assemble(), PayloadError, "flags")


def _compressed(frame: Frame, stored: bytes) -> bytes:
    """``frame`` with ``stored`` as its compressed header (flag set) and a correct checksum."""
    frame.flags = FLAG_HEADER_ZSTD
    return frame.assemble(header_json=stored)


@pytest.mark.parametrize(
    ("stored", "error", "match"),
    [
        (zstd_frame_declaring((16 << 20) + 1), PayloadSizeError, "declares"),
        (zstd_frame_declaring(40), PayloadError, "corrupt compressed header"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"{}"), PayloadSizeError, "declares no size"),
        (b"not zstd at all", PayloadError, "not a zstd frame"),
        (zstandard.ZstdCompressor().compress(b"{not json"), PayloadError, "not valid JSON"),
    ],
    ids=["bomb", "short", "no-size", "garbage", "not-json"],
)
def test_bad_compressed_headers_are_refused(stored: bytes, error: type[PayloadError], match: str) -> None:
    assert_rejected(_compressed(_frame(), stored), error, match)


def test_a_compressed_header_is_never_read_past_its_limit() -> None:
    frame = _frame()
    bomb = zstandard.ZstdCompressor().compress(b" " * ((16 << 20) + 1))  # 16 MiB of spaces: a few hundred bytes
    payload = _compressed(frame, bomb)
    with address_space_limit(8 << 20):
        assert_rejected(payload, PayloadSizeError, "declares")


@pytest.mark.parametrize("delta", [-1, 1, 1000])
def test_header_len_that_does_not_match_the_header(delta: int) -> None:
    frame = _frame()
    payload = frame.assemble(header_len=len(frame.header_json()) + delta)
    with pytest.raises(PayloadError):
        decode_payload(payload)
    state = _fresh_state()
    with pytest.raises(PayloadError):
        apply_patch(state, payload)
    assert_state_bits_equal(state, BASE)


# -------------------------------------------------------------------------------------------- header


@pytest.mark.parametrize(
    "header_json",
    [
        b"{not json",
        b"",
        b'{"a": 1',
        b"\xff\xfe\x00",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"meta": ' + b'{"x":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    ],
    ids=["garbage", "empty", "unterminated", "not-utf8", "deep-list", "deep-object"],
)
def test_bad_header_json(header_json: bytes) -> None:
    frame = _frame()
    assert_rejected(frame.assemble(header_json=header_json), PayloadError)


def test_header_that_is_not_an_object() -> None:
    frame = _frame()
    assert_rejected(frame.assemble(header_json=b"[1, 2, 3]"), PayloadError, "JSON object")


def test_header_with_a_huge_integer_literal_is_a_payload_error() -> None:
    """Python refuses to parse integers of more than 4300 digits with a plain ``ValueError``, which is not
    a ``JSONDecodeError``: the header parser must turn it into a ``PayloadError`` too."""
    frame = _frame()
    header_json = frame.header_json().replace(b'"version":7', b'"version":' + b"7" * 5000)
    assert header_json != frame.header_json()
    assert_rejected(frame.assemble(header_json=header_json), PayloadError)


HeaderEdit = Callable[[dict], None]


def _set(path: tuple, value: object) -> HeaderEdit:
    def edit(header: dict) -> None:
        node = header
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _delete(path: tuple) -> HeaderEdit:
    def edit(header: dict) -> None:
        node = header
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


# tensors are in name order: 0 = "a" (rice, bf16, 300), 1 = "b" (bitmask, fp32, 8x8), 2 = "c" (all, fp16, 5)
HEADER_CASES: list[tuple[str, HeaderEdit, type[PayloadError], str | None]] = [
    ("values-unknown", _set(("values",), "relative"), PayloadError, "value mode"),
    ("values-missing", _delete(("values",)), PayloadError, "value mode"),
    ("values-float32-sizes", _set(("values",), "float32"), PayloadSizeError, "value section"),
    ("version-negative", _set(("version",), -1), PayloadError, "version"),
    ("version-string", _set(("version",), "7"), PayloadError, "version"),
    ("version-bool", _set(("version",), True), PayloadError, "version"),
    ("version-float", _set(("version",), 7.0), PayloadError, "version"),
    ("base-version-negative", _set(("base_version",), -3), PayloadError, "version"),
    ("base-digest-int", _set(("base_digest",), 5), PayloadError, "base_digest"),
    ("result-digest-long", _set(("result_digest",), "f" * 257), PayloadError, "result_digest"),
    ("meta-list", _set(("meta",), [1]), PayloadError, "meta"),
    ("tensors-missing", _delete(("tensors",)), PayloadError, "tensors"),
    ("tensors-object", _set(("tensors",), {"a": 1}), PayloadError, "tensors"),
    ("tensor-not-object", _set(("tensors", 0), "a"), PayloadError, "name"),
    ("tensor-name-missing", _delete(("tensors", 1, "name")), PayloadError, "name"),
    ("tensor-name-int", _set(("tensors", 1, "name"), 3), PayloadError, "name"),
    ("tensor-name-duplicate", _set(("tensors", 1, "name"), "a"), PayloadError, "twice"),
    ("shape-missing", _delete(("tensors", 0, "shape")), PayloadError, "shape"),
    ("shape-int", _set(("tensors", 0, "shape"), 300), PayloadError, "shape"),
    ("shape-negative", _set(("tensors", 0, "shape"), [-300]), PayloadError, "shape"),
    ("shape-float", _set(("tensors", 0, "shape"), [300.0]), PayloadError, "shape"),
    ("shape-17-dims", _set(("tensors", 0, "shape"), [300] + [1] * 16), PayloadError, "shape"),
    ("numel-above-limit", _set(("tensors", 0, "shape"), [2**21, 2**20, 2]), PayloadSizeError, "elements"),
    ("dtype-missing", _delete(("tensors", 0, "dtype")), PayloadError, "dtype"),
    ("dtype-int8", _set(("tensors", 0, "dtype"), "int8"), PayloadError, "dtype"),
    ("dtype-fp8", _set(("tensors", 0, "dtype"), "float8_e4m3fn"), PayloadError, "dtype"),
    ("dtype-torch-prefix", _set(("tensors", 0, "dtype"), "torch.bfloat16"), PayloadError, "dtype"),
    ("dtype-wider", _set(("tensors", 0, "dtype"), "float32"), PayloadSizeError, "value section"),
    ("count-above-numel", _set(("tensors", 2, "count"), 6), InvalidIndicesError, "count"),
    ("count-negative", _set(("tensors", 0, "count"), -1), InvalidIndicesError, "count"),
    ("count-string", _set(("tensors", 0, "count"), "5"), InvalidIndicesError, "count"),
    ("count-float", _set(("tensors", 0, "count"), 5.0), InvalidIndicesError, "count"),
    ("count-missing", _delete(("tensors", 0, "count")), InvalidIndicesError, "count"),
    ("count-off-by-one", _set(("tensors", 0, "count"), 4), PayloadSizeError, "bytes"),
    ("index-missing", _delete(("tensors", 0, "index")), PayloadError, "index"),
    ("index-k-negative", _set(("tensors", 0, "index", "k"), -1), PayloadError, "index"),
    ("index-size-string", _set(("tensors", 0, "index", "size"), "3"), PayloadError, "index"),
    ("index-method-int", _set(("tensors", 0, "index", "method"), 1), PayloadError, "index"),
    ("index-size-plus-one", _set(("tensors", 1, "index", "size"), 9), PayloadSizeError, "bytes"),
    ("index-section-missing", _delete(("index_section",)), PayloadError, "index_section"),
    ("index-section-codec", _set(("index_section", "codec"), "lz4"), PayloadError, "codec"),
    ("index-section-raw-negative", _set(("index_section", "raw"), -1), PayloadError, "index_section"),
    ("value-section-size-string", _set(("value_section", "size"), "9"), PayloadError, "value_section"),
    ("value-section-missing", _delete(("value_section",)), PayloadError, "value_section"),
]


@pytest.mark.parametrize(("edit", "error", "match"), [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES])
def test_bad_header_field(edit: HeaderEdit, error: type[PayloadError], match: str | None) -> None:
    frame = _frame()
    edit(frame.header)
    assert_rejected(frame.assemble(), error, match)


def test_section_raw_sizes_that_do_not_add_up() -> None:
    for section, delta in [("index_section", 1), ("index_section", -1), ("value_section", 1), ("value_section", -2)]:
        frame = _frame()
        frame.header[section]["raw"] += delta
        assert_rejected(frame.assemble(), PayloadSizeError, "section declares")


def test_raw_section_whose_stored_size_differs_from_its_raw_size() -> None:
    frame = _frame()
    frame.index_stored += b"\0"
    frame.header["index_section"]["size"] += 1
    assert_rejected(frame.assemble(), PayloadSizeError, "raw section")
    frame = _frame()
    frame.value_stored = frame.value_stored[:-1]
    frame.header["value_section"]["size"] -= 1
    assert_rejected(frame.assemble(), PayloadSizeError, "raw section")


def test_sections_stored_longer_than_declared_are_truncated_or_trailing() -> None:
    frame = _frame()
    frame.header["value_section"]["size"] += 5
    assert_rejected(frame.assemble(), TruncatedPayloadError, "truncated")
    frame = _frame()
    frame.header["value_section"]["size"] -= 1
    frame.header["value_section"]["raw"] -= 1
    assert_rejected(frame.assemble(), PayloadSizeError)


# ---------------------------------------------------------------------------------------------- zstd


def _zstd_value_frame(stored: bytes, raw: int | None = None) -> bytes:
    frame = _frame()
    frame.value_stored = stored
    frame.header["value_section"].update(codec="zstd", size=len(stored))
    if raw is not None:
        frame.header["value_section"]["raw"] = raw
    return frame.assemble()


def test_zstd_frame_declaring_another_size_than_the_header() -> None:
    raw = _frame().value_stored
    bomb = zstd_frame_declaring(2**40)
    assert_rejected(_zstd_value_frame(bomb), PayloadSizeError, "declares")
    small = zstandard.ZstdCompressor(write_content_size=True).compress(raw[:-1])
    assert_rejected(_zstd_value_frame(small), PayloadSizeError, "declares")


def test_zstd_frame_without_content_size() -> None:
    raw = _frame().value_stored
    stored = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    assert_rejected(_zstd_value_frame(stored), PayloadSizeError)


def test_zstd_section_that_is_not_zstd_or_is_corrupt() -> None:
    raw = _frame().value_stored
    assert_rejected(_zstd_value_frame(b"\x00" * len(raw)), PayloadError, "zstd")
    assert_rejected(_zstd_value_frame(b""), PayloadError, "zstd")
    corrupt = zstd_frame_declaring(len(raw), block=b"\0" * 3)  # declares the right size, holds 3 bytes
    assert_rejected(_zstd_value_frame(corrupt), PayloadError, "zstd")


def test_zstd_section_with_extra_data_after_its_frame() -> None:
    """The stored section must be exactly one zstd frame: bytes after it make its sizes not add up (and make
    the frame malleable: two different byte strings decode to the same payload)."""
    raw = _frame().value_stored
    packed = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    assert_rejected(_zstd_value_frame(packed + b"junk"), PayloadError)
    assert_rejected(_zstd_value_frame(packed + packed), PayloadError)


# ------------------------------------------------------------------------------ decompression bombs


def _bomb_frame(tensors: list[dict], index_section: dict, value_section: dict, index: bytes, value: bytes) -> bytes:
    frame = _frame()
    frame.header["tensors"] = tensors
    frame.header["index_section"] = index_section
    frame.header["value_section"] = value_section
    frame.index_stored, frame.value_stored = index, value
    return frame.assemble()


def _tensor(name: str, shape: list[int], count: int, method: str = "all", size: int = 0) -> dict:
    return {
        "name": name,
        "shape": shape,
        "dtype": "bfloat16",
        "count": count,
        "index": {"method": method, "k": 0, "size": size},
    }


def test_huge_count_is_refused_before_allocating() -> None:
    payload = _bomb_frame(
        [_tensor("a", [2**40], 2**40)],
        {"codec": "raw", "raw": 0, "size": 0},
        {"codec": "zstd", "raw": 2**41, "size": 30},
        b"",
        zstd_frame_declaring(2**41)[:30],
    )
    with address_space_limit(256 << 20):
        with pytest.raises(PayloadSizeError, match="limit"):
            peek_header(payload)
        with pytest.raises(PayloadSizeError, match="limit"):
            decode_payload(payload)
    assert_rejected(payload, PayloadSizeError, "limit")


def test_counts_summed_over_tensors_are_bounded() -> None:
    half = DEFAULT_MAX_ELEMENTS // 2 + 1
    payload = _bomb_frame(
        [_tensor("a", [half], half), _tensor("b", [half], half)],
        {"codec": "raw", "raw": 0, "size": 0},
        {"codec": "zstd", "raw": 4 * half, "size": 30},
        b"",
        zstd_frame_declaring(4 * half)[:30],
    )
    with address_space_limit(256 << 20), pytest.raises(PayloadSizeError, match="limit"):
        decode_payload(payload)


def test_receiver_limit_max_elements() -> None:
    payload = _payload()
    total = peek_header(payload).num_changed
    decode_payload(payload, max_elements=total)
    with pytest.raises(PayloadSizeError, match="limit"):
        decode_payload(payload, max_elements=total - 1)
    state = _fresh_state()
    with pytest.raises(PayloadSizeError, match="limit"):
        apply_patch(state, payload, max_elements=total - 1)
    assert_state_bits_equal(state, BASE)


def test_index_section_bomb_is_refused_before_allocating() -> None:
    """One changed element of a (declared) 2**40-element tensor, coded as a bitmask: the index section's raw
    size is 2**37 bytes (128 GiB), declared by a tiny zstd frame. The decoder must bound it before allocating.

    The index size of a tensor is determined by its method (0 for empty/all, ceil(numel/8) for a bitmask,
    at most about (count*(k+1) + numel/2**k)/8 + 1 for rice), and, when applying, the receiver's own tensor.
    """
    size = 2**37
    stored = zstd_frame_declaring(size)
    payload = _bomb_frame(
        [_tensor("a", [2**40], 1, "bitmask", size)],
        {"codec": "zstd", "raw": size, "size": len(stored)},
        {"codec": "raw", "raw": 2, "size": 2},
        stored,
        b"\0\0",
    )
    with address_space_limit(1 << 30):
        with pytest.raises(PayloadError):
            decode_payload(payload)
        state = _fresh_state()
        with pytest.raises(PayloadError):
            apply_patch(state, payload)
    assert_state_bits_equal(state, BASE)


def test_rice_index_size_beyond_what_its_counts_allow_is_refused_before_allocating() -> None:
    size = 2**36
    stored = zstd_frame_declaring(size)
    payload = _bomb_frame(
        [_tensor("a", [300], 1, "rice", size)],
        {"codec": "zstd", "raw": size, "size": len(stored)},
        {"codec": "raw", "raw": 2, "size": 2},
        stored,
        b"\0\0",
    )
    with address_space_limit(1 << 30), pytest.raises(PayloadError):
        decode_payload(payload)


def test_value_bomb_for_a_tensor_the_receiver_does_not_have() -> None:
    """2**30 changed elements (within the default max_elements) of a tensor the receiver does not have:
    apply_patch must reject the name before decompressing 2 GiB of values for it."""
    count = 2**30
    stored = zstd_frame_declaring(2 * count)
    payload = _bomb_frame(
        [_tensor("ghost", [count], count)],
        {"codec": "raw", "raw": 0, "size": 0},
        {"codec": "zstd", "raw": 2 * count, "size": len(stored)},
        b"",
        stored,
    )
    state = _fresh_state()
    with address_space_limit(1 << 30), pytest.raises(TensorMismatchError, match="ghost"):
        apply_patch(state, payload)
    assert_state_bits_equal(state, BASE)


# ------------------------------------------------------------------------------- index streams


def _single(shape: tuple[int, ...], method: str, k: int, index: bytes, count: int) -> tuple[bytes, dict]:
    """A valid single-tensor patch ``w`` (bf16) re-coded with the given index method, ``k`` and bytes, and
    ``count`` values; returns the re-checksummed frame and a matching state."""
    base = {"w": torch.zeros(shape, dtype=torch.bfloat16)}
    new = {"w": torch.ones(shape, dtype=torch.bfloat16)}
    frame = Frame.parse(make_patch(base, new, version=1, base_version=0))
    values = np.zeros((count, 2), dtype=np.uint8)
    frame.tensors[0]["index"].update(method=method, k=k)
    frame.set_sections([index], [values])
    return frame.assemble(), base


def test_reference_rice_stream_decodes() -> None:
    """Sanity check of the test's own Rice coder against the library's decoder."""
    indices = [3, 10, 11, 500, 999]
    for k in (7, 8, 9):
        payload, _ = _single((1000,), "rice", k, rice_stream(gaps_of(indices), k), len(indices))
        (entry,) = decode_payload(payload).entries
        assert entry.indices.tolist() == indices


def test_rice_stream_longer_than_the_encoder_can_write_is_refused() -> None:
    """A decodable Rice stream with a far-from-optimal k is larger than any stream the encoder writes (its
    unary part holds at most 3 bits per index); the size bound refuses it before decompressing."""
    indices = [3, 10, 11, 500, 999]
    payload, state = _single((1000,), "rice", 0, rice_stream(gaps_of(indices), 0), len(indices))
    assert_rejected(payload, PayloadSizeError, "exceeds", state)


INDEX_CASES = [
    # name, shape, method, k, index bytes, count, error, match
    (
        "rice-last-index-out-of-range",
        (1000,),
        "rice",
        9,
        rice_stream(gaps_of([3, 10, 1000]), 9),
        3,
        InvalidIndicesError,
        "out of range",
    ),
    ("rice-gap-beyond-numel", (1000,), "rice", 9, rice_stream([1000], 9), 1, InvalidIndicesError, "out of range"),
    (
        "rice-quotient-beyond-numel",
        (1000,),
        "rice",
        0,
        rice_stream([5000], 0),
        1,
        (InvalidIndicesError, PayloadSizeError),  # a 626-byte stream cannot code 1 index of 1000 elements
        "exceeds|bytes",
    ),
    ("rice-more-codes-than-count", (1000,), "rice", 0, rice_stream([1, 2, 3, 4], 0), 3, InvalidIndicesError, "codes"),
    ("rice-fewer-codes-than-count", (1000,), "rice", 0, rice_stream([1, 2], 0), 3, InvalidIndicesError, "codes"),
    (
        "rice-nonzero-remainder-padding",
        (1000,),
        "rice",
        3,
        rice_stream([1, 2, 3], 3, remainder_pad=1),
        3,
        InvalidIndicesError,
        "padding",
    ),
    (
        "rice-nonzero-unary-padding",
        (1000,),
        "rice",
        0,
        rice_stream([1, 2, 3], 0)[:-1] + b"\x9f",
        3,
        InvalidIndicesError,
        "codes",
    ),
    (
        "rice-trailing-unary-bytes",
        (1000,),
        "rice",
        3,
        rice_stream([1, 2, 3], 3, unary_tail=b"\0"),
        3,
        PayloadSizeError,
        "trailing",
    ),
    ("rice-too-short", (1000,), "rice", 8, b"\xff", 3, PayloadSizeError, "too short"),
    ("rice-empty-stream", (1000,), "rice", 0, b"", 3, PayloadSizeError, "too short"),
    ("rice-k-too-large", (1000,), "rice", 41, rice_stream([1], 41), 1, InvalidIndicesError, "k=41"),
    (
        "rice-index-past-numel-after-shrink",
        (18,),
        "rice",
        2,
        rice_stream(gaps_of([3, 17, 18]), 2),
        3,
        InvalidIndicesError,
        "out of range|exceeds",
    ),
    ("bitmask-bits-past-end", (20,), "bitmask", 0, b"\x80\x00\x01", 2, InvalidIndicesError, "past the end"),
    ("bitmask-too-long", (20,), "bitmask", 0, b"\x80\x00\x00\x00", 1, PayloadSizeError, "bitmask"),
    ("bitmask-too-short", (20,), "bitmask", 0, b"\x80\x00", 1, PayloadSizeError, "bitmask"),
    ("bitmask-count-mismatch", (20,), "bitmask", 0, b"\xc0\x00\x00", 1, InvalidIndicesError, "header says"),
    ("all-count-not-numel", (20,), "all", 0, b"", 19, PayloadSizeError, "count == numel"),
    ("all-with-bytes", (20,), "all", 0, b"\x00", 20, PayloadSizeError, "bytes"),
    ("empty-with-count", (20,), "empty", 0, b"", 1, PayloadSizeError, "empty"),
    ("empty-with-bytes", (20,), "empty", 0, b"\x00", 0, PayloadSizeError, "empty"),
    ("unknown-method", (20,), "golomb", 0, b"\x00", 1, InvalidIndicesError, "golomb"),
]


@pytest.mark.parametrize(
    ("shape", "method", "k", "index", "count", "error", "match"),
    [c[1:] for c in INDEX_CASES],
    ids=[c[0] for c in INDEX_CASES],
)
def test_bad_index_stream(
    shape: tuple[int, ...], method: str, k: int, index: bytes, count: int, error: type[PayloadError] | tuple, match: str
) -> None:
    payload, state = _single(shape, method, k, index, count)
    assert_rejected(payload, error, match, state)


@pytest.mark.parametrize("index", [b"", b"\x00"], ids=["no-bytes", "zero-byte"])
def test_rice_stream_with_zero_count(index: bytes) -> None:
    """A rice-coded tensor with count 0 must be refused (the encoder uses 'empty'), not crash the decoder."""
    payload, state = _single((1000,), "rice", 0, index, 0)
    assert_rejected(payload, PayloadError, None, state)


def test_indices_not_strictly_increasing_cannot_be_expressed() -> None:
    """Gaps are unsigned in both index codes, so a decoded index set is always strictly increasing; the encoder
    refuses to write any other (checked in test_codec_roundtrip), and the decoder's range checks are
    exercised above. Here: every decodable rice stream of a small tensor is strictly increasing and in range."""
    numel = 12
    for k in (0, 1, 2):
        for gaps in ([0, 0, 0], [0, 11], [11], [3, 0, 4], [2, 2, 2, 2]):
            payload, _ = _single((numel,), "rice", k, rice_stream(gaps, k), len(gaps))
            try:
                (entry,) = decode_payload(payload).entries
            except PayloadSizeError:
                continue  # a wasteful k: refused by the size bound
            except PayloadError:
                assert sum(g + 1 for g in gaps) > numel
                continue
            idx = entry.indices
            assert bool((idx[1:] > idx[:-1]).all()) and int(idx[0]) >= 0 and int(idx[-1]) < numel


# -------------------------------------------------------------------------------- tensor mismatch


def test_patch_names_a_tensor_the_receiver_does_not_have() -> None:
    state = _fresh_state()
    del state["b"]
    assert_rejected(_payload(), TensorMismatchError, "'b'", state, decode=False)


@pytest.mark.parametrize(
    "replace",
    [
        lambda t: t.reshape(30, 10),
        lambda t: torch.cat([t, t[:1]]),
        lambda t: t.float(),
        lambda t: t.view(torch.float16),
    ],
    ids=["reshaped", "longer", "other-dtype", "same-width-other-dtype"],
)
def test_patch_shape_or_dtype_differs_from_the_receiver(replace: Callable[[torch.Tensor], torch.Tensor]) -> None:
    state = _fresh_state()
    state["a"] = replace(state["a"])
    assert_rejected(_payload(), TensorMismatchError, "'a'", state, decode=False)


def test_renamed_tensor_in_a_valid_frame() -> None:
    frame = _frame()
    frame.header["tensors"][0]["name"] = "a.weight"
    assert_rejected(frame.assemble(), TensorMismatchError, "a.weight", decode=False)


def test_every_error_is_a_value_error_family() -> None:
    for error in (
        BadMagicError,
        ChecksumError,
        InvalidIndicesError,
        PayloadSizeError,
        TensorMismatchError,
        TruncatedPayloadError,
        UnsupportedVersionError,
    ):
        assert issubclass(error, PayloadError)
        assert issubclass(error, PulseLocoError)
        assert issubclass(error, ValueError)


def test_non_patch_payload_is_not_applied() -> None:
    """A float32 (pseudo-gradient) payload is well formed but not a patch."""
    payload = encode_payload(
        [SparseTensor("a", (300,), torch.bfloat16, torch.tensor([1]), torch.tensor([0.5]))],
        value_mode="float32",
        version=1,
        base_version=0,
        base_digest=state_digest(BASE),
        result_digest=state_digest(BASE),
    )
    state = _fresh_state()
    with pytest.raises(PatchError, match="float32"):
        apply_patch(state, payload)
    assert_state_bits_equal(state, BASE)
