"""How ``experiments/codec/bench_codec.py`` times a codec: every codec of :data:`CODECS` (pulseloco's absolute and delta
patches, and the baselines of :mod:`codec_baselines`) encodes one (base, new) pair of BF16 states and applies
the payload to a copy of the base, each call timed right after timed ``torch.clone``\\ s of the same state
(:func:`timed_with_clone`), so that a row's times are ratios to a clone measured under the same load; every round
trip is checked bit for bit (:func:`states_equal`). :func:`measure_input` gives one :class:`Row` per codec.

A baseline that does not reconstruct the new state raises ``AssertionError``; a pulseloco patch that does not is
reported (``roundtrip_ok`` False), the benchmark's verdict. ``ImportError`` when pulseloco is missing surfaces from
:func:`make_codec`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from codec_baselines import BASELINES, State
from harness.logs import progress

CODECS = ("pulseloco-abs", "pulseloco-delta", "naive", "authors")
CLONES_PER_RUN = 3
"""Timed clones of the state before each measured call (the clone is cheap: more samples, a robust median)."""

Encoder = Callable[[State, State], bytes]
Applier = Callable[[State, bytes], Any]
IndexSizer = Callable[[State, State, bytes], int]

log = progress("bench_codec")


def _apply_returning_state(apply: Applier, payload: bytes) -> Callable[[State], State]:
    """``apply(state, payload)`` as a function of the state that returns it (what :func:`timed_with_clone` times)."""

    def run(state: State) -> State:
        apply(state, payload)
        return state

    return run


def timed_with_clone(
    fn: Callable[..., Any], reps: int, setup: Callable[[], tuple[Any, ...]], reference: State
) -> tuple[list[float], list[float], Any]:
    """Time ``fn(*setup())`` ``reps`` times, each run right after CLONES_PER_RUN timed clones of ``reference``.

    Interleaving the clone with the measured call keeps their ratio meaningful on a shared, noisy machine
    (load from other processes hits both alike); the clone is cheap, so it gets more samples, which keeps
    its median robust to the odd stall. ``setup`` is not timed.
    Returns (fn seconds per run, clone seconds per clone, result of the last run).
    """
    fn_times, clone_times = [], []
    result = None
    for _ in range(reps):
        result = None  # let the previous result go before the next setup allocates
        args = setup()
        for _ in range(CLONES_PER_RUN):
            t0 = time.perf_counter()
            copy = clone_state(reference)
            clone_times.append(time.perf_counter() - t0)
            del copy
        t0 = time.perf_counter()
        result = fn(*args)
        fn_times.append(time.perf_counter() - t0)
        del args
    return fn_times, clone_times, result


def clone_state(state: State) -> State:
    """A clone of every tensor, on the tensors' device (waits for a GPU to finish, so it can be timed)."""
    out = {k: v.clone() for k, v in state.items()}
    if any(v.is_cuda for v in out.values()):
        torch.cuda.synchronize()
    return out


def to_device(state: State, device: str) -> State:
    """``state`` on ``device`` (itself on the CPU)."""
    return state if device == "cpu" else {k: v.to(device) for k, v in state.items()}


def states_equal(a: State, b: State) -> bool:
    """Bitwise equality of two BF16 states (a float == would miss -0.0/+0.0 and NaN payloads)."""
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def binary_entropy(p: float) -> float:
    """H(p) in bits."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -p * math.log2(p) - (1 - p) * math.log2(1 - p)


@dataclass
class Row:
    """One (input, codec) measurement."""

    input: str
    kind: str  # "real" or "random"
    codec: str
    num_elements: int
    num_changed: int
    density: float
    patch_bytes: int
    index_bytes: int | None
    bytes_per_changed: float
    ratio_vs_full_bf16: float
    index_bytes_per_changed: float | None
    index_vs_bound: float | None
    encode_s: float
    apply_s: float
    clone_s: float
    encode_x_clone: float
    apply_x_clone: float
    # min/min ratios: less sensitive than the medians to other load on a shared machine (JSON only).
    encode_x_clone_min: float
    apply_x_clone_min: float
    roundtrip_ok: bool
    encode_runs_s: list[float] = field(default_factory=list)
    apply_runs_s: list[float] = field(default_factory=list)
    clone_runs_s: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def make_codec(codec: str, base_digest: str | None = None) -> tuple[Encoder, Applier, IndexSizer]:
    """(encode, apply, index_bytes) for one entry of CODECS.

    A pulseloco encode is timed as the Publisher calls ``make_patch``: it knows the digest of the version it
    published last (``base_digest``, computed outside the timing) and has the new state's digest computed in
    the same pass as the comparison. Index bytes of a pulseloco patch come from its header; a baseline's index
    stream is compressed on its own for this column only (outside the timed encode).
    """
    if codec in BASELINES:
        bl = BASELINES[codec]
        return bl.encode, bl.apply, lambda base, new, payload: bl.index_bytes(base, new)

    from pulseloco.codec import peek_header
    from pulseloco.sync import apply_patch, make_patch

    values = {"pulseloco-abs": "absolute", "pulseloco-delta": "delta"}[codec]

    def encode(base: State, new: State) -> bytes:
        return make_patch(base, new, version=1, base_version=0, values=values, base_digest=base_digest)

    def index_bytes(base: State, new: State, payload: bytes) -> int:
        return int(peek_header(payload).index_bytes)

    return encode, apply_patch, index_bytes


def measure_input(
    label: str, kind: str, base: State, new: State, codecs: list[str], reps: int, meta: dict[str, Any]
) -> list[Row]:
    """Measure every codec on one (base, new) pair, plus a clone of ``new`` timed in the same run."""
    num_elements = sum(t.numel() for t in new.values())
    num_changed = sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in new)
    density = num_changed / num_elements
    bound = num_elements * binary_entropy(density) / 8
    full_bytes = 2 * num_elements
    rows = []
    for _ in range(2):  # untimed: let the allocator settle at this state size
        clone_state(new)
    from pulseloco.digest import state_digest

    base_digest = state_digest(base)
    for codec in codecs:
        encode, apply, index_bytes = make_codec(codec, base_digest)
        encode_t, clone_t1, payload = timed_with_clone(encode, reps, lambda: (base, new), new)
        apply_t, clone_t2, applied = timed_with_clone(
            _apply_returning_state(apply, payload), reps, lambda: (clone_state(base),), new
        )
        encode_s, apply_s = statistics.median(encode_t), statistics.median(apply_t)
        clone_s = statistics.median(clone_t1 + clone_t2)
        ok = states_equal(applied, new)
        del applied
        device = next(iter(new.values())).device
        if device.type == "cuda":  # what moving the patch's bytes off the GPU costs, for comparison
            blob = torch.empty(len(payload), dtype=torch.uint8, device=device)
            copies = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                blob.cpu()
                copies.append(time.perf_counter() - t0)
            meta = {**meta, "d2h_patch_s": statistics.median(copies)}
        if codec in BASELINES and not ok:
            raise AssertionError(f"baseline {codec} did not reconstruct {label} bit-identically")
        idx_bytes = index_bytes(base, new, payload)
        row = Row(
            input=label,
            kind=kind,
            codec=codec,
            num_elements=num_elements,
            num_changed=num_changed,
            density=density,
            patch_bytes=len(payload),
            index_bytes=idx_bytes,
            bytes_per_changed=len(payload) / max(num_changed, 1),
            ratio_vs_full_bf16=len(payload) / full_bytes,
            index_bytes_per_changed=None if idx_bytes is None else idx_bytes / max(num_changed, 1),
            index_vs_bound=None if idx_bytes is None or bound == 0 else idx_bytes / bound,
            encode_s=encode_s,
            apply_s=apply_s,
            clone_s=clone_s,
            encode_x_clone=encode_s / clone_s,
            apply_x_clone=apply_s / clone_s,
            encode_x_clone_min=min(encode_t) / min(clone_t1 + clone_t2),
            apply_x_clone_min=min(apply_t) / min(clone_t1 + clone_t2),
            roundtrip_ok=ok,
            encode_runs_s=encode_t,
            apply_runs_s=apply_t,
            clone_runs_s=clone_t1 + clone_t2,
            meta=meta,
        )
        log(
            f"{label} {codec}: {row.bytes_per_changed:.3f} B/changed enc={encode_s * 1e3:.0f}ms "
            f"apply={apply_s * 1e3:.0f}ms clone={clone_s * 1e3:.0f}ms roundtrip={'ok' if ok else 'FAILED'}"
        )
        rows.append(row)
    return rows
