"""The codec on every core and on the torch (GPU) path: the bytes and the states never depend on either.

``make_patch`` / ``apply_patch`` / ``state_digest`` split their work by digest chunk and by tensor over
:mod:`pulseloco.parallel` (sized by ``torch.get_num_threads``). These tests run the same inputs with one thread
(every job inline: the reference) and with several, and through the torch path that CUDA tensors take (forced
on CPU tensors here, so the same code runs on this machine), and compare payload bytes, digests and states.
With a CUDA device the last test runs the real GPU path against the CPU bytes.
"""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash
from codec_helpers import assert_state_bits_equal, changed_copy, random_bits, random_mask

import pulseloco.sync.patch as patch_module
from pulseloco.codec import decode_payload, peek_header
from pulseloco.digest import DIGEST_CHUNK_BYTES
from pulseloco.sync import apply_patch, make_patch, state_digest


def _states(density: float, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A state with tensors of several chunks (the largest is 2.5 chunks of BF16), small ones and tied ones."""
    gen = torch.Generator().manual_seed(seed)
    big = DIGEST_CHUNK_BYTES * 5 // 4  # BF16 elements: 2.5 chunks
    emb = random_bits((big // 64, 64), torch.bfloat16, gen)
    base = {
        "emb": emb,
        "lm_head": emb,  # tied
        "mlp": random_bits((1 << 20,), torch.float32, gen),  # exactly one FP32 chunk
        "norm": random_bits((77,), torch.bfloat16, gen),
        "half": random_bits((3, 1001), torch.float16, gen),
        "empty": torch.empty((0, 4), dtype=torch.bfloat16),
    }
    new_emb = changed_copy(emb, random_mask(emb.shape, density, gen), gen)
    new = {
        "emb": new_emb,
        "lm_head": new_emb,
        "mlp": changed_copy(base["mlp"], random_mask(base["mlp"].shape, density, gen), gen),
        "norm": base["norm"].clone(),  # unchanged
        "half": changed_copy(base["half"], random_mask(base["half"].shape, density, gen), gen),
        "empty": base["empty"].clone(),
    }
    return base, new


def _reference_digest(state: dict[str, torch.Tensor]) -> str:
    """The digest scheme of pulseloco.digest, written out from its description."""
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        chunks = [raw[i : i + DIGEST_CHUNK_BYTES] for i in range(0, len(raw), DIGEST_CHUNK_BYTES)]
        meta = f"{t.dtype}:{tuple(t.shape)}".encode()
        h.update(struct.pack("<I", len(name.encode())) + name.encode() + struct.pack("<I", len(meta)) + meta)
        h.update(struct.pack("<Q", len(chunks)))
        h.update(b"".join(xxhash.xxh3_128_digest(c) for c in chunks))
    return h.hexdigest()


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    emb = state["emb"].clone()
    return {k: (emb if k in ("emb", "lm_head") else v.clone()) for k, v in state.items()}


def test_state_digest_matches_the_documented_scheme(one_thread: None) -> None:
    base, new = _states(0.01, 0)
    for n in (1, 3):
        torch.set_num_threads(n)
        assert state_digest(base) == _reference_digest(base)
        assert state_digest(new) == _reference_digest(new) != state_digest(base)
    # A non-contiguous tensor hashes as its contiguous copy, under its own shape.
    t = base["half"].t()
    assert state_digest({"x": t}) == _reference_digest({"x": t.contiguous()})


@pytest.mark.parametrize("mode", ["absolute", "delta"])
@pytest.mark.parametrize("density", [0.01, 0.4])
def test_bytes_and_states_do_not_depend_on_the_thread_count(one_thread: None, mode: str, density: float) -> None:
    base, new = _states(density, 1)
    payloads, digests, applied = [], [], []
    for n in (1, 2, 4):
        torch.set_num_threads(n)
        payload = make_patch(base, new, version=1, base_version=0, values=mode)
        state = _clone(base)
        info = apply_patch(state, payload)
        payloads.append(payload)
        digests.append(info.digest)
        applied.append(state)
    assert payloads[0] == payloads[1] == payloads[2]
    assert digests[0] == digests[1] == digests[2] == state_digest(new)
    for state in applied:
        assert_state_bits_equal(state, new)
    header = peek_header(payloads[0])
    assert header.base_digest == _reference_digest(base) and header.result_digest == _reference_digest(new)
    # The digests the fused pass computed equal the ones given by a caller that knows them.
    given = make_patch(
        base, new, version=1, base_version=0, values=mode, base_digest=state_digest(base), new_digest=state_digest(new)
    )
    assert given == payloads[0]


def test_large_value_section_is_compressed_identically_on_any_thread_count(one_thread: None) -> None:
    """A value section above 8 MiB goes through zstd's multithreaded mode, whose output must not depend on the
    number of workers."""
    gen = torch.Generator().manual_seed(5)
    base = {"w": random_bits((3 << 20,), torch.float32, gen)}
    new = {"w": changed_copy(base["w"], random_mask(base["w"].shape, 0.8, gen), gen)}
    payloads = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        payloads.append(make_patch(base, new, version=1, base_version=0))
    assert peek_header(payloads[0]).value_section["raw"] > 8 << 20
    assert payloads[0] == payloads[1] == payloads[2]


@pytest.mark.parametrize("mode", ["absolute", "delta"])
def test_torch_path_gives_the_same_bytes_and_states(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The path CUDA tensors take (compare and gather with torch ops on the tensors' device, scatter with
    index_copy_, digests one chunk at a time), forced on CPU tensors: same payload, same state, same digest."""
    base, new = _states(0.05, 2)
    numpy_payload = make_patch(base, new, version=1, base_version=0, values=mode)
    numpy_state = _clone(base)
    apply_patch(numpy_state, numpy_payload)
    monkeypatch.setattr(patch_module, "_on_cpu", lambda tensor: False)
    torch_payload = make_patch(base, new, version=1, base_version=0, values=mode)
    assert torch_payload == numpy_payload
    torch_state = _clone(base)
    info = apply_patch(torch_state, torch_payload)
    assert info.digest == state_digest(new)
    assert_state_bits_equal(torch_state, numpy_state)
    assert {e.name for e in decode_payload(torch_payload).entries} == {"emb", "lm_head", "mlp", "half"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the torch path runs on CPU above")
@pytest.mark.parametrize("mode", ["absolute", "delta"])
def test_cuda_state_matches_the_cpu_path(mode: str) -> None:
    base, new = _states(0.05, 3)
    cpu_payload = make_patch(base, new, version=1, base_version=0, values=mode)
    gpu_base = {k: v.cuda() for k, v in base.items()}
    gpu_new = {k: v.cuda() for k, v in new.items()}
    assert state_digest(gpu_base) == state_digest(base)
    assert make_patch(gpu_base, gpu_new, version=1, base_version=0, values=mode) == cpu_payload
    state = {k: v.clone() for k, v in gpu_base.items()}
    info = apply_patch(state, cpu_payload)
    assert info.digest == state_digest(new)
    assert_state_bits_equal({k: v.cpu() for k, v in state.items()}, new)
