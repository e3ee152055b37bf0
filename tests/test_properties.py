"""Property-based tests (hypothesis): random masks round-trip bit-exactly, random corruption is always
rejected cleanly with the state untouched, and squash equals sequential application on random chains.

Deterministic: ``derandomize=True`` draws the same examples on every run, and no example database is kept.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from codec_helpers import (
    Frame,
    assert_bits_equal,
    assert_state_bits_equal,
    changed_copy,
    random_bits,
    rechecksum,
    snapshot,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pulseloco.codec import decode_payload
from pulseloco.codec.indices import IndexCode, decode_indices, encode_indices
from pulseloco.errors import PayloadError, PulseLocoError
from pulseloco.sync import apply_patch, make_patch, squash, state_digest

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MODES = ["absolute", "delta"]

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@st.composite
def masks(draw: st.DrawFn, shape: tuple[int, ...]) -> torch.Tensor:
    """A boolean mask of ``shape``: empty, full, or random with a drawn density (bits AND-ed together)."""
    n = math.prod(shape)
    kind = draw(st.sampled_from(["random", "random", "random", "none", "all"]))
    if kind == "none" or n == 0:
        return torch.zeros(shape, dtype=torch.bool)
    if kind == "all":
        return torch.ones(shape, dtype=torch.bool)
    nbytes = (n + 7) // 8
    layers = draw(st.integers(0, 4))  # density about 2**-layers
    bits_n = np.unpackbits(np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), dtype=np.uint8))[:n]
    for _ in range(layers):
        more = np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), dtype=np.uint8)
        bits_n &= np.unpackbits(more)[:n]
    return torch.from_numpy(bits_n.astype(bool)).reshape(shape)


@st.composite
def state_pairs(draw: st.DrawFn, max_tensors: int = 3) -> tuple[dict, dict, dict]:
    num = draw(st.integers(1, max_tensors))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    base, new, mask_of = {}, {}, {}
    for i in range(num):
        shape = draw(shapes)
        dtype = draw(st.sampled_from(DTYPES))
        mask = draw(masks(shape))
        name = f"layer{i}.weight"
        base[name] = random_bits(shape, dtype, gen)
        new[name] = changed_copy(base[name], mask, gen)
        mask_of[name] = mask
    return base, new, mask_of


@SETTINGS
@given(pair=state_pairs(), mode=st.sampled_from(MODES))
def test_random_masks_round_trip(pair: tuple[dict, dict, dict], mode: str) -> None:
    base, new, mask_of = pair
    payload = make_patch(base, new, version=2, base_version=1, values=mode)

    decoded = decode_payload(payload)
    by_name = {e.name: e for e in decoded.entries}
    for name, mask in mask_of.items():
        expected_idx = torch.nonzero(mask.reshape(-1)).reshape(-1)
        if expected_idx.numel() == 0:
            assert name not in by_name
            continue
        assert torch.equal(by_name[name].indices, expected_idx)

    state = {k: v.clone() for k, v in base.items()}
    apply_patch(state, payload)
    reference = {k: torch.where(mask_of[k], new[k], base[k]) for k in base}
    assert_state_bits_equal(state, reference)
    assert state_digest(state) == decoded.header.result_digest


@SETTINGS
@given(data=st.data())
def test_index_codes_round_trip(data: st.DataObject) -> None:
    numel = data.draw(st.one_of(st.integers(0, 300), st.integers(0, 2**34)))
    if numel <= 300:
        idx = data.draw(st.lists(st.integers(0, max(numel - 1, 0)), unique=True, max_size=numel)) if numel else []
    else:
        idx = data.draw(st.lists(st.integers(0, numel - 1), unique=True, max_size=40))
    indices = np.array(sorted(idx), dtype=np.int64)
    code = encode_indices(indices, numel)
    assert isinstance(code, IndexCode)
    out = decode_indices(code, indices.size, numel)
    assert out.dtype == np.int64
    assert np.array_equal(out, indices)


# ------------------------------------------------------------------------------------------ corruption


def _fixture_patch(seed: int, mode: str) -> tuple[dict, bytes]:
    gen = torch.Generator().manual_seed(seed)
    base = {
        "a": random_bits((200,), torch.bfloat16, gen),
        "b": random_bits((6, 7), torch.float32, gen),
        "c": random_bits((3,), torch.float16, gen),
    }
    densities = {"a": 0.03, "b": 0.4, "c": 1.0}
    new = {k: changed_copy(v, torch.rand(v.shape, generator=gen) < densities[k], gen) for k, v in base.items()}
    return base, make_patch(base, new, version=1, base_version=0, values=mode)


_PATCHES = {(seed, mode): _fixture_patch(seed, mode) for seed in (0, 1) for mode in MODES}


@st.composite
def corruptions(draw: st.DrawFn, length: int) -> list[tuple[str, int, int]]:
    ops = st.one_of(
        st.tuples(st.just("flip"), st.integers(0, length - 1), st.integers(1, 255)),
        st.tuples(st.just("set"), st.integers(0, length - 1), st.integers(0, 255)),
        st.tuples(st.just("truncate"), st.integers(0, length - 1), st.just(0)),
        st.tuples(st.just("insert"), st.integers(0, length), st.integers(0, 255)),
        st.tuples(st.just("delete"), st.integers(0, length - 1), st.just(0)),
    )
    return draw(st.lists(ops, min_size=1, max_size=4))


def _corrupt(payload: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(payload)
    for op, pos, val in ops:
        pos = min(pos, len(out) - 1) if op != "insert" else min(pos, len(out))
        if pos < 0:
            break
        if op == "flip":
            out[pos] ^= val
        elif op == "set":
            out[pos] = val
        elif op == "truncate":
            del out[pos:]
        elif op == "insert":
            out.insert(pos, val)
        else:
            del out[pos]
    return bytes(out)


def _apply_checked(base: dict, payload: bytes, *, checksummed: bool) -> None:
    """Apply a corrupted payload: it raises a pulseloco error and leaves the state untouched, or (only when
    the checksum was recomputed) it succeeds and the state is the one the payload's header announces."""
    state = {k: v.clone() for k, v in base.items()}
    before, digest = snapshot(state), state_digest(state)
    try:
        info = apply_patch(state, payload)
    except PulseLocoError as exc:
        assert str(exc)
        assert state_digest(state) == digest
        assert_state_bits_equal(state, before)
        if not checksummed:
            assert isinstance(exc, PayloadError), exc
        return
    assert checksummed, "a corrupted payload was accepted"
    assert state_digest(state) == info.digest == decode_payload(payload).header.result_digest


@SETTINGS
@given(data=st.data(), key=st.sampled_from(sorted(_PATCHES)))
def test_random_corruption_is_rejected_cleanly(data: st.DataObject, key: tuple[int, str]) -> None:
    base, payload = _PATCHES[key]
    corrupt = _corrupt(payload, data.draw(corruptions(len(payload))))
    if corrupt == payload:
        return
    _apply_checked(base, corrupt, checksummed=False)


@SETTINGS
@given(data=st.data(), key=st.sampled_from(sorted(_PATCHES)), raw=st.booleans())
def test_random_corruption_past_the_checksum(data: st.DataObject, key: tuple[int, str], raw: bool) -> None:
    """The checksum is recomputed after corrupting, so header parsing, size checks, index validation and the
    digest check must catch everything; values changed by the corruption end in DigestMismatchError."""
    base, payload = _PATCHES[key]
    if raw:  # uncompressed sections: corruption reaches index streams and values directly
        frame = Frame.parse(payload)
        frame.decompress_sections()
        payload = frame.assemble()
    body = payload[:-8]
    corrupt_body = _corrupt(body, data.draw(corruptions(len(body))))
    if corrupt_body == body:
        return
    _apply_checked(base, rechecksum(corrupt_body + b"\0" * 8), checksummed=True)


@SETTINGS
@given(data=st.data(), key=st.sampled_from(sorted(_PATCHES)))
def test_random_header_edits_past_the_checksum(data: st.DataObject, key: tuple[int, str]) -> None:
    """Structured edits of header fields (replaced by values of other types and ranges)."""
    base, payload = _PATCHES[key]
    frame = Frame.parse(payload)
    frame.decompress_sections()
    json_values = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True),
        st.text(max_size=5),
        st.sampled_from(["rice", "bitmask", "all", "empty", "bfloat16", "float32", "delta", "absolute", "zstd"]),
        st.lists(st.integers(-2, 2**41), max_size=4),
        st.just({}),
    )
    for _ in range(data.draw(st.integers(1, 3))):
        node = frame.header
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key_ = data.draw(st.sampled_from(keys))
            child = node[key_]
            if isinstance(child, (dict, list)) and child and data.draw(st.booleans()):
                node = child
                continue
            node[key_] = data.draw(json_values)
            break
    _apply_checked(base, frame.assemble(), checksummed=True)


# ---------------------------------------------------------------------------------------------- squash


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    length=st.integers(1, 4),
    mode=st.sampled_from(MODES),
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    data=st.data(),
)
def test_squash_equals_sequential_on_random_chains(
    seed: int, length: int, mode: str, dtype: torch.dtype, shape: tuple[int, ...], data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(seed)
    versions = [{"w": random_bits(shape, dtype, gen), "fixed": random_bits((2,), torch.float32, gen)}]
    for _ in range(length):
        prev = versions[-1]
        nxt = {"w": changed_copy(prev["w"], data.draw(masks(shape)), gen), "fixed": prev["fixed"].clone()}
        if len(versions) >= 2 and data.draw(st.booleans()):  # go back to an older version where masked
            revert = data.draw(masks(shape))
            nxt["w"] = torch.where(revert, versions[-2]["w"], nxt["w"])
        versions.append(nxt)
    patches = [
        make_patch(versions[t - 1], versions[t], version=t, base_version=t - 1, values=mode)
        for t in range(1, length + 1)
    ]
    sequential = {k: v.clone() for k, v in versions[0].items()}
    for p in patches:
        apply_patch(sequential, p)
    squashed_state = {k: v.clone() for k, v in versions[0].items()}
    apply_patch(squashed_state, squash(patches))
    assert_state_bits_equal(squashed_state, sequential)
    assert_bits_equal(squashed_state["w"], versions[-1]["w"])
