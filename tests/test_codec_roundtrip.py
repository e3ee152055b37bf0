"""Round trips of the codec and of patches, bit for bit, against a plain reference built in the test.

The reference for a changed state is ``torch.where(mask, other, base)``; every comparison is on integer views
of the bit patterns, so -0.0/+0.0 and NaN payloads count.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch
from codec_helpers import (
    Frame,
    assert_bits_equal,
    assert_state_bits_equal,
    bits,
    changed_copy,
    random_bits,
    random_mask,
    special_values,
)

from pulseloco.codec import (
    FORMAT_VERSION,
    MAGIC,
    SparseTensor,
    decode_payload,
    encode_payload,
    peek_header,
)
from pulseloco.sync import apply_patch, make_patch, state_digest

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(0,), (1,), (3, 5, 7), (40, 25), (2048,)]
DENSITIES = [0.0, 0.001, 0.01, 0.08, 0.5, 1.0]
MODES = ["absolute", "delta"]


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _dense_reference(shape: tuple[int, ...], dtype: torch.dtype, base: torch.Tensor, entry: SparseTensor):
    """Scatter decoded absolute values into a copy of ``base`` with plain indexing (the reference apply)."""
    out = base.detach().clone().reshape(-1)
    out[entry.indices] = entry.values
    return out.reshape(shape)


# ------------------------------------------------------------------------------------ encode/decode only


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("density", DENSITIES, ids=str)
def test_encode_decode_absolute_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...], density: float) -> None:
    gen = _gen("abs", dtype, shape, density)
    base = random_bits(shape, dtype, gen)
    mask = random_mask(shape, density, gen)
    new = changed_copy(base, mask, gen)
    indices = torch.nonzero(mask.reshape(-1)).reshape(-1)
    values = new.reshape(-1)[indices]
    entry = SparseTensor("w", shape, dtype, indices, values)

    payload = encode_payload([entry], value_mode="absolute", version=3, base_version=2)
    decoded = decode_payload(payload)

    (out,) = decoded.entries
    assert (out.name, out.shape, out.dtype) == ("w", shape, dtype)
    assert out.indices.dtype == torch.int64
    assert torch.equal(out.indices, indices)
    assert_bits_equal(out.values, values, "values")
    assert_bits_equal(_dense_reference(shape, dtype, base, out), torch.where(mask, new, base), "dense")
    header = decoded.header
    assert (header.version, header.base_version, header.value_mode) == (3, 2, "absolute")
    assert header.num_changed == int(mask.sum())
    assert header.total_bytes == len(payload)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0], ids=str)
def test_encode_decode_float32_mode_for_any_dtype(dtype: torch.dtype, density: float) -> None:
    """Sparse pseudo-gradients: FP32 values for tensors of any dtype."""
    gen = _gen("f32", dtype, density)
    shape = (17, 13)
    mask = random_mask(shape, density, gen)
    indices = torch.nonzero(mask.reshape(-1)).reshape(-1)
    values = random_bits((indices.numel(),), torch.float32, gen)
    payload = encode_payload(
        [SparseTensor("g", shape, dtype, indices, values)], value_mode="float32", version=0, base_version=None
    )
    (out,) = decode_payload(payload).entries
    assert out.dtype == dtype
    assert torch.equal(out.indices, indices)
    assert_bits_equal(out.values, values, "float32 values")
    assert decode_payload(payload).header.base_version is None


def test_encode_decode_many_tensors_of_mixed_dtypes_and_widths() -> None:
    """Byte planes interleave tensors of width 2, 4 and 8: each must get its own bytes back."""
    gen = _gen("mixed")
    entries = []
    for i, (dtype, shape) in enumerate(
        itertools.product([torch.bfloat16, torch.float32, torch.float16, torch.float64], [(0,), (1,), (9, 11)])
    ):
        base = random_bits(shape, dtype, gen)
        mask = random_mask(shape, 0.3, gen)
        new = changed_copy(base, mask, gen)
        idx = torch.nonzero(mask.reshape(-1)).reshape(-1)
        entries.append(SparseTensor(f"t{i:02d}", shape, dtype, idx, new.reshape(-1)[idx]))
    decoded = decode_payload(encode_payload(entries, value_mode="absolute", version=1, base_version=0))
    assert [e.name for e in decoded.entries] == [e.name for e in entries]
    for got, want in zip(decoded.entries, entries, strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        assert torch.equal(got.indices, want.indices)
        assert_bits_equal(got.values, want.values, want.name)


def test_special_bit_patterns_round_trip_in_every_mode() -> None:
    for dtype in DTYPES:
        values = special_values(dtype)
        idx = torch.arange(values.numel()) * 3
        entry = SparseTensor("s", (values.numel() * 3,), dtype, idx, values)
        (out,) = decode_payload(encode_payload([entry], value_mode="absolute", version=1, base_version=0)).entries
        assert_bits_equal(out.values, values, f"absolute {dtype}")
        as_f32 = SparseTensor("s", entry.shape, dtype, idx, values.float())
        (out,) = decode_payload(encode_payload([as_f32], value_mode="float32", version=1, base_version=0)).entries
        assert_bits_equal(out.values, values.float(), f"float32 {dtype}")


def test_empty_payload_and_meta_round_trip() -> None:
    payload = encode_payload([], value_mode="absolute", version=0, base_version=None, meta={"k": [1, "x"]})
    decoded = decode_payload(payload)
    assert decoded.entries == ()
    assert decoded.header.num_changed == 0
    assert dict(decoded.header.meta) == {"k": [1, "x"]}
    assert payload[:4] == MAGIC
    assert int.from_bytes(payload[4:6], "little") == FORMAT_VERSION


def test_every_index_method_is_exercised_and_decodes() -> None:
    """The densities above must reach every index code: empty, all, rice and bitmask."""
    numel = 4096
    methods = set()
    for count in [0, 1, 2, 40, 400, 2000, 4095, 4096]:
        idx = torch.from_numpy(np.sort(np.random.default_rng(count).choice(numel, count, replace=False)))
        vals = torch.zeros(count, dtype=torch.bfloat16)
        payload = encode_payload(
            [SparseTensor("w", (numel,), torch.bfloat16, idx, vals)], value_mode="absolute", version=1, base_version=0
        )
        methods.add(peek_header(payload).tensors[0]["index"]["method"])
        (out,) = decode_payload(payload).entries
        assert torch.equal(out.indices, idx.to(torch.int64))
    assert methods == {"empty", "all", "rice", "bitmask"}


def test_extreme_gaps_round_trip() -> None:
    """First and last elements only, adjacent runs, a single element at the end of a big tensor."""
    numel = 100_003
    for idx_list in ([0, numel - 1], [numel - 1], [0], [*range(10), numel - 1], [5, 6, 7, 50_000]):
        idx = torch.tensor(idx_list, dtype=torch.int64)
        vals = torch.arange(len(idx_list), dtype=torch.float32)
        payload = encode_payload(
            [SparseTensor("w", (numel,), torch.float32, idx, vals)], value_mode="absolute", version=1, base_version=0
        )
        (out,) = decode_payload(payload).entries
        assert torch.equal(out.indices, idx)
        assert_bits_equal(out.values, vals)


@pytest.mark.parametrize("level", [1, 3, 19])
def test_compressed_sections_round_trip(level: int) -> None:
    """A large, compressible tensor puts both sections through zstd."""
    gen = _gen("zstd", level)
    shape = (200_000,)
    base = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    mask = random_mask(shape, 0.01, gen)
    new = torch.where(mask, (base.view(torch.int16) + 1).view(torch.bfloat16), base)
    idx = torch.nonzero(mask).reshape(-1)
    payload = encode_payload(
        [SparseTensor("w", shape, torch.bfloat16, idx, new[idx])],
        value_mode="absolute",
        version=1,
        base_version=0,
        level=level,
    )
    frame = Frame.parse(payload)
    assert frame.header["value_section"]["codec"] == "zstd"
    (out,) = decode_payload(payload).entries
    assert torch.equal(out.indices, idx)
    assert_bits_equal(out.values, new[idx])


@pytest.mark.parametrize(
    "bad",
    [
        {"value_mode": "relative"},
        {"names": ["a", "a"]},
        {"values_dtype": torch.float32},
        {"values_len": 1},
        {"indices": [3, 2]},
        {"indices": [2, 2]},
        {"indices": [0, 99]},
        {"indices": [-1, 2]},
    ],
    ids=lambda d: next(iter(d)),
)
def test_encode_rejects_invalid_input(bad: dict) -> None:
    idx = torch.tensor(bad.get("indices", [1, 2]))
    n_vals = len(idx) + bad.get("values_len", 0)
    vals = torch.zeros(n_vals, dtype=bad.get("values_dtype", torch.bfloat16))
    entries = [SparseTensor(n, (10,), torch.bfloat16, idx, vals) for n in bad.get("names", ["a"])]
    with pytest.raises(ValueError):
        encode_payload(entries, value_mode=bad.get("value_mode", "absolute"), version=1, base_version=0)


def test_encode_rejects_integer_tensors() -> None:
    entry = SparseTensor("i", (4,), torch.int32, torch.tensor([1]), torch.tensor([7], dtype=torch.int32))
    with pytest.raises(TypeError):
        encode_payload([entry], value_mode="absolute", version=1, base_version=0)


# ------------------------------------------------------------------------------------------ patches


def _state_pair(shapes_dtypes: dict, density: float, seed: object) -> tuple[dict, dict, dict]:
    gen = _gen("state", seed, density)
    base, new, masks = {}, {}, {}
    for name, (shape, dtype) in shapes_dtypes.items():
        base[name] = random_bits(shape, dtype, gen)
        masks[name] = random_mask(shape, density, gen)
        new[name] = changed_copy(base[name], masks[name], gen)
    return base, new, masks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("density", DENSITIES, ids=str)
def test_patch_round_trip(mode: str, dtype: torch.dtype, shape: tuple[int, ...], density: float) -> None:
    base, new, masks = _state_pair({"w": (shape, dtype)}, density, (mode, dtype, shape))
    before = {k: v.clone() for k, v in base.items()}
    payload = make_patch(base, new, version=5, base_version=4, values=mode)
    assert_state_bits_equal(base, before)  # make_patch does not touch its inputs

    state = {k: v.clone() for k, v in base.items()}
    target = state["w"]
    info = apply_patch(state, payload)

    assert state["w"] is target, "apply_patch must write in place"
    reference = torch.where(masks["w"], new["w"], base["w"])
    assert_bits_equal(state["w"], reference, "patched")
    assert info.num_changed == int(masks["w"].sum())
    assert (info.version, info.base_version, info.value_mode) == (5, 4, mode)
    assert info.digest == state_digest(new) == state_digest(state)
    assert info.num_bytes == len(payload)
    assert not info.already_applied


@pytest.mark.parametrize("mode", MODES)
def test_mixed_state_with_tied_noncontiguous_empty_and_scalar_tensors(mode: str) -> None:
    gen = _gen("mixed-state", mode)
    emb = random_bits((11, 6), torch.bfloat16, gen)
    base = {
        "emb": emb,
        "lm_head": emb,  # tied: the same tensor under two names
        "emb_t": emb.t(),  # tied and non-contiguous
        "half": random_bits((3, 5, 7), torch.float16, gen),
        "full": random_bits((4, 9), torch.float32, gen),
        "strided": random_bits((8, 10), torch.float32, gen)[:, ::2],  # non-contiguous, not a transpose
        "step": random_bits((30,), torch.float16, gen)[::3],  # 1-D with stride 3
        "empty": torch.empty((0,), dtype=torch.bfloat16),
        "empty2d": torch.empty((3, 0), dtype=torch.float32),
        "one": random_bits((1,), torch.bfloat16, gen),
        "scalar": random_bits((), torch.float32, gen),
    }
    new_emb = changed_copy(emb, random_mask(emb.shape, 0.3, gen), gen)
    new = {
        "emb": new_emb,
        "lm_head": new_emb,
        "emb_t": new_emb.t(),
        "half": changed_copy(base["half"], random_mask((3, 5, 7), 0.2, gen), gen),
        "full": changed_copy(base["full"], random_mask((4, 9), 1.0, gen), gen),
        "strided": changed_copy(base["strided"], random_mask((8, 5), 0.5, gen), gen),
        "step": changed_copy(base["step"], random_mask((10,), 0.5, gen), gen),
        "empty": torch.empty((0,), dtype=torch.bfloat16),
        "empty2d": torch.empty((3, 0), dtype=torch.float32),
        "one": changed_copy(base["one"], torch.ones(1, dtype=torch.bool), gen),
        "scalar": changed_copy(base["scalar"], torch.ones((), dtype=torch.bool), gen),
    }
    payload = make_patch(base, new, version=1, base_version=0, values=mode)

    state_emb = emb.clone()
    strided_storage = torch.zeros((8, 10), dtype=torch.float32)
    strided_storage[:, ::2] = base["strided"]
    state = {
        **{k: v.clone() for k, v in base.items() if k not in ("emb", "lm_head", "emb_t", "strided")},
        "emb": state_emb,
        "lm_head": state_emb,
        "emb_t": state_emb.t(),
        "strided": strided_storage[:, ::2],
    }
    step_storage = torch.zeros(30, dtype=torch.float16)
    step_storage[::3] = base["step"]
    state["step"] = step_storage[::3]
    odd_columns = strided_storage[:, 1::2].clone()
    assert not state["emb_t"].is_contiguous() and not state["strided"].is_contiguous()
    objects = {k: id(v) for k, v in state.items()}

    info = apply_patch(state, payload)

    assert {k: id(v) for k, v in state.items()} == objects
    assert_state_bits_equal(state, new)
    assert state["lm_head"].data_ptr() == state["emb"].data_ptr() == state["emb_t"].data_ptr()
    assert_bits_equal(strided_storage[:, 1::2], odd_columns, "storage outside the strided view")
    assert bool((step_storage.view(torch.int16).reshape(10, 3)[:, 1:] == 0).all()), "storage outside the 1-D view"
    assert info.digest == state_digest(new)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_zero_sign_and_nan_payload_changes_are_patched(dtype: torch.dtype, mode: str) -> None:
    """A float ``!=`` misses -0.0 vs +0.0 and flags unchanged NaNs: the patch must be bitwise."""
    specials = special_values(dtype)
    n = specials.numel()
    # every ordered pair of distinct special patterns, plus every pattern against itself (unchanged)
    pairs = [(i, j) for i in range(n) for j in range(n)]
    base = torch.stack([specials[i] for i, _ in pairs])
    new = torch.stack([specials[j] for _, j in pairs])
    expected_changed = sum(1 for i, j in pairs if i != j)
    state = {"w": base.clone()}
    payload = make_patch({"w": base}, {"w": new}, version=1, base_version=0, values=mode)
    info = apply_patch(state, payload)
    assert info.num_changed == expected_changed
    assert_bits_equal(state["w"], new)


def test_unchanged_nan_is_not_sent() -> None:
    base = torch.full((16,), float("nan"), dtype=torch.bfloat16)
    payload = make_patch({"w": base}, {"w": base.clone()}, version=1, base_version=0)
    assert peek_header(payload).num_changed == 0


def test_every_element_changes_in_every_tensor() -> None:
    shapes = {f"t{i}": (s, d) for i, (s, d) in enumerate(itertools.product([(1,), (3, 5, 7), (300,)], DTYPES))}
    base, new, _ = _state_pair(shapes, 1.0, "all")
    for mode in MODES:
        payload = make_patch(base, new, version=1, base_version=0, values=mode)
        assert {t["index"]["method"] for t in peek_header(payload).tensors} == {"all"}
        state = {k: v.clone() for k, v in base.items()}
        apply_patch(state, payload)
        assert_state_bits_equal(state, new)


def test_no_change_patch_is_empty_and_applies() -> None:
    base, _, _ = _state_pair({"a": ((5, 5), torch.bfloat16), "b": ((0,), torch.float32)}, 0.0, "none")
    payload = make_patch(base, base, version=1, base_version=0)
    assert peek_header(payload).tensors == ()
    state = {k: v.clone() for k, v in base.items()}
    info = apply_patch(state, payload)
    assert info.num_changed == 0
    assert_state_bits_equal(state, base)


def test_empty_state_round_trip() -> None:
    payload = make_patch({}, {}, version=1, base_version=0)
    state: dict[str, torch.Tensor] = {}
    info = apply_patch(state, payload)
    assert info.digest == state_digest({})
    assert state == {}


def test_delta_is_modular_across_wraparound() -> None:
    """Deltas between extreme bit patterns (0x7FFF -> 0x8000 and back) wrap, but reconstruct exactly."""
    base = torch.tensor([0x7FFF, -0x8000, 0, -1], dtype=torch.int16).view(torch.bfloat16)
    new = torch.tensor([-0x8000, 0x7FFF, -1, 0], dtype=torch.int16).view(torch.bfloat16)
    state = {"w": base.clone()}
    apply_patch(state, make_patch({"w": base}, {"w": new}, version=1, base_version=0, values="delta"))
    assert torch.equal(bits(state["w"]), bits(new))


def test_chain_of_patches_reaches_the_latest_state() -> None:
    gen = _gen("chain")
    versions = [{"w": random_bits((64, 3), torch.bfloat16, gen), "b": random_bits((7,), torch.float32, gen)}]
    for _ in range(5):
        prev = versions[-1]
        versions.append({k: changed_copy(v, random_mask(v.shape, 0.1, gen), gen) for k, v in prev.items()})
    for mode in MODES:
        state = {k: v.clone() for k, v in versions[0].items()}
        for t in range(1, len(versions)):
            apply_patch(state, make_patch(versions[t - 1], versions[t], version=t, base_version=t - 1, values=mode))
            assert_state_bits_equal(state, versions[t])
