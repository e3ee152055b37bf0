"""Patch semantics: staleness, idempotence, atomicity, and squash == sequential application."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from codec_helpers import (
    Frame,
    assert_state_bits_equal,
    bits,
    changed_copy,
    random_bits,
    random_mask,
    snapshot,
    special_values,
)

from pulseloco.codec import SparseTensor, decode_payload, encode_payload, peek_header
from pulseloco.errors import (
    DigestMismatchError,
    PatchError,
    PayloadError,
    StalePatchError,
    TensorMismatchError,
)
from pulseloco.sync import PatchInfo, apply_patch, make_patch, squash, state_digest

MODES = ["absolute", "delta"]


def _chain(num_versions: int, seed: int = 0, density: float = 0.15) -> list[dict[str, torch.Tensor]]:
    """States v0..vN of a small mixed-dtype model. Changes overlap between versions, some elements go back
    to an earlier value (so a delta chain can sum to zero there), and special bit patterns appear."""
    gen = torch.Generator().manual_seed(seed)
    v0 = {
        "emb": random_bits((12, 8), torch.bfloat16, gen),
        "ln": random_bits((8,), torch.float32, gen),
        "mlp": random_bits((3, 5, 7), torch.float16, gen),
        "one": random_bits((1,), torch.bfloat16, gen),
        "empty": torch.empty((0,), dtype=torch.bfloat16),
    }
    v0["emb"].reshape(-1)[:9] = special_values(torch.bfloat16)
    versions = [v0]
    for t in range(1, num_versions + 1):
        prev = versions[-1]
        nxt = {k: changed_copy(v, random_mask(v.shape, density, gen), gen) for k, v in prev.items()}
        if t >= 2:  # revert a few elements to their value two versions ago
            two_back = versions[-2]
            for name in ("emb", "mlp"):
                mask = random_mask(nxt[name].shape, 0.1, gen)
                nxt[name] = torch.where(mask, two_back[name], nxt[name])
        versions.append(nxt)
    return versions


def _patches(versions: list[dict[str, torch.Tensor]], mode: str) -> list[bytes]:
    return [
        make_patch(versions[t - 1], versions[t], version=t, base_version=t - 1, values=mode)
        for t in range(1, len(versions))
    ]


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


@contextmanager
def _unchanged(state: dict[str, torch.Tensor]) -> Iterator[None]:
    """The block leaves ``state`` bit-identical (use around a call that must raise)."""
    before, digest = snapshot(state), state_digest(state)
    yield
    assert state_digest(state) == digest
    assert_state_bits_equal(state, before)


# ---------------------------------------------------------------------------------- apply semantics


def test_patch_info() -> None:
    v = _chain(1)
    payload = make_patch(v[0], v[1], version=1, base_version=0, meta={"step": 10})
    state = _copy(v[0])
    info = apply_patch(state, payload)
    assert isinstance(info, PatchInfo)
    assert info.version == 1 and info.base_version == 0
    assert info.value_mode == "absolute"
    assert info.num_changed == sum(int((bits(v[0][k]) != bits(v[1][k])).sum()) for k in v[0])
    assert info.digest == state_digest(v[1])
    assert info.num_bytes == len(payload)
    assert info.already_applied is False
    header = peek_header(payload)
    assert header.base_digest == state_digest(v[0]) and header.result_digest == state_digest(v[1])
    assert dict(header.meta) == {"step": 10}


def test_first_version_without_base_version() -> None:
    v = _chain(1)
    payload = make_patch(v[0], v[1], version=0, base_version=None)
    state = _copy(v[0])
    assert apply_patch(state, payload).base_version is None
    assert_state_bits_equal(state, v[1])


def test_reapplying_an_absolute_patch_is_a_no_op() -> None:
    v = _chain(1)
    payload = make_patch(v[0], v[1], version=1, base_version=0)
    state = _copy(v[0])
    apply_patch(state, payload)
    with _unchanged(state):
        info = apply_patch(state, payload)
    assert info.already_applied is True
    assert info.num_changed == 0
    assert info.digest == state_digest(v[1])
    assert_state_bits_equal(state, v[1])


def test_delta_patch_is_refused_twice() -> None:
    v = _chain(1)
    payload = make_patch(v[0], v[1], version=1, base_version=0, values="delta")
    state = _copy(v[0])
    apply_patch(state, payload)
    with _unchanged(state), pytest.raises(StalePatchError, match="already at this version"):
        apply_patch(state, payload)
    assert_state_bits_equal(state, v[1])


@pytest.mark.parametrize("mode", MODES)
def test_patch_on_another_version_is_stale(mode: str) -> None:
    v = _chain(3)
    p3 = make_patch(v[2], v[3], version=3, base_version=2, values=mode)
    for at in (0, 1):
        state = _copy(v[at])
        with _unchanged(state), pytest.raises(StalePatchError, match="base version 2"):
            apply_patch(state, p3)


@pytest.mark.parametrize("mode", MODES)
def test_state_with_an_extra_or_missing_untouched_tensor_is_stale(mode: str) -> None:
    v = _chain(1)
    payload = make_patch(v[0], v[1], version=1, base_version=0, values=mode)
    extra = {**_copy(v[0]), "bias": torch.zeros(3)}
    with _unchanged(extra), pytest.raises(StalePatchError):
        apply_patch(extra, payload)
    missing = _copy(v[0])
    del missing["empty"]
    with _unchanged(missing), pytest.raises(StalePatchError):
        apply_patch(missing, payload)


def test_state_with_a_missing_touched_tensor_is_a_mismatch() -> None:
    v = _chain(1)
    payload = make_patch(v[0], v[1], version=1, base_version=0)
    state = _copy(v[0])
    del state["emb"]
    with _unchanged(state), pytest.raises(TensorMismatchError, match="emb"):
        apply_patch(state, payload)


def test_state_with_one_flipped_bit_is_stale() -> None:
    v = _chain(1)
    payload = make_patch(v[0], v[1], version=1, base_version=0)
    state = _copy(v[0])
    state["ln"].view(torch.int32)[3] ^= 1
    with _unchanged(state), pytest.raises(StalePatchError):
        apply_patch(state, payload)


def test_float_patch_to_a_negative_zero_is_not_already_applied() -> None:
    """-0.0 and +0.0 compare equal, but the state at +0.0 is not at the version that has -0.0."""
    base = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    new = {"w": torch.tensor([0.0, -0.0, 0.0, 0.0], dtype=torch.bfloat16)}
    payload = make_patch(base, new, version=1, base_version=0)
    state = _copy(base)
    info = apply_patch(state, payload)
    assert not info.already_applied and info.num_changed == 1
    assert bits(state["w"]).tolist() == [0, -0x8000, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_model_parameters_are_patched_in_place(mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new = {
        k: changed_copy(v, random_mask(v.shape, 0.3, torch.Generator().manual_seed(1)), torch.Generator())
        for k, v in base.items()
    }
    payload = make_patch(base, new, version=1, base_version=0, values=mode)
    params = dict(model.named_parameters())  # leaves that require grad
    apply_patch(params, payload)
    assert_state_bits_equal({k: v.detach() for k, v in model.state_dict().items()}, new)
    assert all(p.requires_grad for p in model.parameters())


def test_error_during_the_scatter_restores_tensors_already_written() -> None:
    """The scatter of a later tensor fails (``b`` is an expanded view: writing one element would write them
    all, which torch refuses): ``a``, written before it, is restored and the error propagates."""
    gen = torch.Generator().manual_seed(3)
    base = {"a": random_bits((50,), torch.bfloat16, gen), "b": torch.full((50,), 1.5, dtype=torch.bfloat16)}
    new = {k: changed_copy(v, random_mask(v.shape, 0.5, gen), gen) for k, v in base.items()}
    payload = make_patch(base, new, version=1, base_version=0)
    state = {"a": base["a"].clone(), "b": torch.tensor([1.5], dtype=torch.bfloat16).expand(50)}
    assert state_digest(state) == state_digest(base)
    with _unchanged(state), pytest.raises(RuntimeError):
        apply_patch(state, payload)


# ---------------------------------------------------------------------------------------- make_patch


def test_make_patch_rejects_layout_differences() -> None:
    v = _chain(1)
    with pytest.raises(PatchError, match="names"):
        make_patch(v[0], {**v[1], "new": torch.zeros(2)}, version=1, base_version=0)
    with pytest.raises(PatchError, match="ln"):
        make_patch(v[0], {**v[1], "ln": torch.zeros(9)}, version=1, base_version=0)
    with pytest.raises(PatchError, match="ln"):
        make_patch(v[0], {**v[1], "ln": v[1]["ln"].double()}, version=1, base_version=0)
    with pytest.raises(ValueError, match="values"):
        make_patch(v[0], v[1], version=1, base_version=0, values="float32")
    ints = {"i": torch.arange(4)}
    with pytest.raises(TypeError):
        make_patch(ints, {"i": torch.arange(4) + 1}, version=1, base_version=0)


# ------------------------------------------------------------------------------------------- squash


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", [1, 2, 5])
def test_squash_equals_sequential_application(mode: str, length: int) -> None:
    versions = _chain(length, seed=length)
    patches = _patches(versions, mode)

    sequential = _copy(versions[0])
    for p in patches:
        apply_patch(sequential, p)
    assert_state_bits_equal(sequential, versions[-1])

    squashed = squash(patches)
    state = _copy(versions[0])
    info = apply_patch(state, squashed)
    assert_state_bits_equal(state, sequential)
    assert info.digest == state_digest(versions[-1])
    assert (info.version, info.base_version, info.value_mode) == (length, 0, mode)
    header = peek_header(squashed)
    assert list(header.meta["squashed_versions"]) == list(range(1, length + 1))

    differs = sum(int((bits(versions[0][k]) != bits(versions[-1][k])).sum()) for k in versions[0])
    touched = sum(
        int(torch.stack([bits(versions[t - 1][k]) != bits(versions[t][k]) for t in range(1, length + 1)]).any(0).sum())
        for k in versions[0]
    )
    if mode == "delta":
        assert header.num_changed == differs  # net-zero deltas are dropped
    else:
        assert header.num_changed == touched  # the union of the chain, with the latest values


@pytest.mark.parametrize("mode", MODES)
def test_squash_of_squashes(mode: str) -> None:
    versions = _chain(6, seed=9)
    patches = _patches(versions, mode)
    nested = squash([squash(patches[:2]), squash(patches[2:5]), patches[5]])
    state = _copy(versions[0])
    apply_patch(state, nested)
    assert_state_bits_equal(state, versions[-1])
    assert decode_payload(nested).header.version == 6


def test_squashed_absolute_patch_semantics_at_other_versions() -> None:
    versions = _chain(3, seed=4)
    squashed = squash(_patches(versions, "absolute"))
    at_last = _copy(versions[3])
    assert apply_patch(at_last, squashed).already_applied
    assert_state_bits_equal(at_last, versions[3])
    mid = _copy(versions[1])
    with _unchanged(mid), pytest.raises(StalePatchError):
        apply_patch(mid, squashed)


def test_squash_delta_change_and_revert_drops_the_index() -> None:
    base = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    v1 = {"w": base["w"].clone()}
    v1["w"][[1, 5]] = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    v2 = {"w": base["w"].clone()}
    v2["w"][5] = 3.0
    patches = [
        make_patch(base, v1, version=1, base_version=0, values="delta"),
        make_patch(v1, v2, version=2, base_version=1, values="delta"),
    ]
    squashed = decode_payload(squash(patches))
    (entry,) = squashed.entries
    assert entry.indices.tolist() == [5]
    state = _copy(base)
    apply_patch(state, squash(patches))
    assert_state_bits_equal(state, v2)


@pytest.mark.parametrize("mode", MODES)
def test_squash_with_an_empty_entry(mode: str) -> None:
    """A valid patch may list a tensor with no changed element (encode_payload allows it): squash must
    handle a tensor whose every part is empty."""
    gen = torch.Generator().manual_seed(2)
    base = {"w": random_bits((4,), torch.bfloat16, gen), "v": random_bits((6,), torch.bfloat16, gen)}
    d0 = state_digest(base)
    values_dtype = torch.bfloat16 if mode == "absolute" else torch.int16
    empty = SparseTensor(
        "w", (4,), torch.bfloat16, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=values_dtype)
    )
    p1 = encode_payload([empty], value_mode=mode, version=1, base_version=0, base_digest=d0, result_digest=d0)
    state = _copy(base)
    apply_patch(state, p1)  # a valid no-op patch
    new = {"w": base["w"].clone(), "v": changed_copy(base["v"], random_mask((6,), 0.5, gen), gen)}
    p2 = make_patch(base, new, version=2, base_version=1, values=mode)
    for chain in ([p1], [p1, p2]):
        squashed = squash(chain)
        state = _copy(base)
        apply_patch(state, squashed)
        assert_state_bits_equal(state, new if len(chain) == 2 else base)


def test_squash_rejects_bad_chains() -> None:
    versions = _chain(4, seed=5)
    absolute = _patches(versions, "absolute")
    delta = _patches(versions, "delta")
    with pytest.raises(PatchError, match="at least one"):
        squash([])
    with pytest.raises(PatchError, match="chain"):
        squash([absolute[0], absolute[2]])  # a version is missing
    with pytest.raises(PatchError, match="chain"):
        squash([absolute[1], absolute[0]])  # wrong order
    with pytest.raises(PatchError, match="chain"):
        squash([absolute[0], absolute[0]])  # the same patch twice
    with pytest.raises(PatchError, match="cannot squash"):
        squash([absolute[0], delta[1]])
    with pytest.raises(PatchError, match="cannot squash"):
        squash([delta[0], absolute[1], delta[2]])


def test_squash_rejects_a_fork_with_matching_version_numbers() -> None:
    """Version numbers chain but digests do not: patch 2 was made against another version 1."""
    versions = _chain(2, seed=6)
    other = _chain(2, seed=7)
    p1 = make_patch(versions[0], versions[1], version=1, base_version=0)
    p2_fork = make_patch(other[1], other[2], version=2, base_version=1)
    with pytest.raises(PatchError, match="chain"):
        squash([p1, p2_fork])


def test_squash_rejects_non_patch_payloads_and_layout_changes() -> None:
    d = [f"{i:032x}" for i in range(4)]
    sig = SparseTensor("g", (4,), torch.bfloat16, torch.tensor([1]), torch.tensor([0.5]))
    f32 = [
        encode_payload(
            [sig], value_mode="float32", version=t, base_version=t - 1, base_digest=d[t - 1], result_digest=d[t]
        )
        for t in (1, 2)
    ]
    with pytest.raises(PatchError, match="float32"):
        squash(f32)
    with pytest.raises(PatchError, match="float32"):
        squash(f32[:1])

    def entry(shape: tuple[int, ...], dtype: torch.dtype) -> SparseTensor:
        return SparseTensor("w", shape, dtype, torch.tensor([0]), torch.zeros(1, dtype=dtype))

    for second in (entry((8,), torch.bfloat16), entry((4,), torch.float16), entry((2, 2), torch.bfloat16)):
        chain = [
            encode_payload(
                [entry((4,), torch.bfloat16)],
                value_mode="absolute",
                version=1,
                base_version=0,
                base_digest=d[0],
                result_digest=d[1],
            ),
            encode_payload(
                [second], value_mode="absolute", version=2, base_version=1, base_digest=d[1], result_digest=d[2]
            ),
        ]
        with pytest.raises(TensorMismatchError, match="'w'"):
            squash(chain)


def test_squash_rejects_a_malformed_patch() -> None:
    versions = _chain(2, seed=8)
    patches = _patches(versions, "absolute")
    corrupt = bytearray(patches[1])
    corrupt[-20] ^= 0xFF
    with pytest.raises(PayloadError):
        squash([patches[0], bytes(corrupt)])
    with pytest.raises(PayloadError):
        squash([patches[0], patches[1][:-1]])


def test_squash_result_is_verified_on_apply() -> None:
    """A squash of tampered (re-checksummed) patches carries their announced digests: applying it fails
    with DigestMismatchError and leaves the state untouched."""
    versions = _chain(2, seed=10)
    patches = _patches(versions, "absolute")
    frame = Frame.parse(patches[1])
    frame.decompress_sections()
    flipped = bytearray(frame.value_stored)
    flipped[0] ^= 0x01
    frame.value_stored = bytes(flipped)
    squashed = squash([patches[0], frame.assemble()])
    state = _copy(versions[0])
    with _unchanged(state), pytest.raises(DigestMismatchError):
        apply_patch(state, squashed)
