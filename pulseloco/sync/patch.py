"""PULSESync patches: lossless sparse updates between two versions of a model state.

A patch for version ``t`` against base ``t-1`` lists, per tensor, the flat indices whose bit patterns differ
and either the new absolute values there (default: applying is a scatter, no arithmetic, so no drift) or the
modular difference of the bit patterns (``delta``: most changes are one unit in the last place, so it is far
smaller, but it is only correct on the exact base, which the base digest enforces). Every patch names its base
version and the digests of its base state and of the state it produces; :func:`apply_patch` is atomic.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import torch

from pulseloco.codec import DEFAULT_MAX_ELEMENTS, SparseTensor, decode_payload, encode_payload, peek_header
from pulseloco.codec.bits import bit_format, bit_view, changed_indices, modular_add, modular_delta
from pulseloco.digest import DIGEST_CHUNK_BYTES, chunk_spans, combine_digest, hash_chunk, state_chunk_digests
from pulseloco.errors import DigestMismatchError, PatchError, StalePatchError, TensorMismatchError
from pulseloco.parallel import parallel_map

logger = logging.getLogger(__name__)

__all__ = ["PATCH_VALUE_MODES", "PatchInfo", "apply_patch", "make_patch", "squash"]

#: Value modes a patch may use (``float32`` payloads carry signals, not states).
PatchValueMode = Literal["absolute", "delta"]
PATCH_VALUE_MODES: tuple[PatchValueMode, ...] = get_args(PatchValueMode)


@dataclass(frozen=True)
class PatchInfo:
    """What :func:`apply_patch` did. ``changed``: the flat indices (int64) the patch wrote, per tensor name (an
    engine that keeps its own copy of the weights, such as vLLM's, reloads exactly these elements)."""

    version: int
    base_version: int | None
    num_changed: int
    value_mode: str
    digest: str
    num_bytes: int
    already_applied: bool = False
    changed: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False)


def _check_same_layout(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    if set(base) != set(new):
        missing, extra = sorted(set(base) - set(new)), sorted(set(new) - set(base))
        raise PatchError(f"base and new states differ in tensor names: only in base {missing}, only in new {extra}")
    for name in base:
        b, n = base[name], new[name]
        if b.shape != n.shape or b.dtype != n.dtype:
            raise PatchError(f"tensor {name!r}: base is {b.dtype}{tuple(b.shape)}, new is {n.dtype}{tuple(n.shape)}")


@dataclass
class _Diff:
    """What one job of :func:`make_patch` found in one tensor (or one digest chunk of it)."""

    indices_K: np.ndarray
    new_K: np.ndarray  # new bit patterns (signed-integer view)
    base_K: np.ndarray | None  # base bit patterns, for delta values
    base_hashes: list[bytes] | None
    new_hashes: list[bytes] | None


def _on_cpu(tensor: torch.Tensor) -> bool:
    """Whether the numpy chunk path handles ``tensor`` (contiguous CPU memory); others take the torch path."""
    return tensor.device.type == "cpu" and tensor.is_contiguous()


_scratch = threading.local()


def _scratch_mask(size: int) -> np.ndarray:
    """A reused per-thread bool buffer of ``size`` (at most one digest chunk's elements): a fresh mask per chunk
    would be a fresh mapping and its page faults on every call (glibc maps large allocations)."""
    buf: np.ndarray | None = getattr(_scratch, "mask", None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, DIGEST_CHUNK_BYTES), dtype=bool)
        _scratch.mask = buf
    return buf[:size]


def _diff_chunk(
    base_bits: np.ndarray, new_bits: np.ndarray, start: int, end: int, hash_base: bool, hash_new: bool, delta: bool
) -> _Diff:
    """Compare, gather and hash one digest chunk of a CPU tensor while it is in cache."""
    b, n = base_bits[start:end], new_bits[start:end]
    base_hashes = [hash_chunk(b.view(np.uint8))] if hash_base else None
    new_hashes = [hash_chunk(n.view(np.uint8))] if hash_new else None
    mask = _scratch_mask(end - start)
    np.not_equal(b, n, out=mask)
    local = np.flatnonzero(mask)
    return _Diff(local + start, n[local], b[local] if delta else None, base_hashes, new_hashes)


def _diff_device(base: torch.Tensor, new: torch.Tensor, hash_base: bool, hash_new: bool, delta: bool) -> _Diff:
    """The torch path (a GPU, or a non-contiguous tensor): change detection and the gather run on the tensors'
    device; only the indices and values cross to the host, and the hashes stream one chunk at a time."""
    indices_K = changed_indices(base, new)
    new_K = bit_view(new).index_select(0, indices_K).cpu().numpy()
    base_K = bit_view(base).index_select(0, indices_K).cpu().numpy() if delta else None
    base_hashes = state_chunk_digests({"t": base})["t"] if hash_base else None
    new_hashes = state_chunk_digests({"t": new})["t"] if hash_new else None
    return _Diff(indices_K.cpu().numpy(), new_K, base_K, base_hashes, new_hashes)


def _concat(parts: list[_Diff]) -> _Diff:
    if len(parts) == 1:
        return parts[0]

    def hashes(which: str) -> list[bytes] | None:
        found = [getattr(p, which) for p in parts]
        return None if found[0] is None else [h for hs in found for h in hs]

    base_parts = [p.base_K for p in parts if p.base_K is not None]
    return _Diff(
        np.concatenate([p.indices_K for p in parts]),
        np.concatenate([p.new_K for p in parts]),
        np.concatenate(base_parts) if len(base_parts) == len(parts) else None,
        hashes("base_hashes"),
        hashes("new_hashes"),
    )


def make_patch(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    version: int,
    base_version: int | None,
    values: str = "absolute",
    level: int = 1,
    meta: Mapping[str, Any] | None = None,
    base_digest: str | None = None,
    new_digest: str | None = None,
) -> bytes:
    """Encode the change from ``base`` to ``new`` (same names, shapes and floating dtypes) as a patch.

    One pass over both states, one digest chunk at a time on every core (:mod:`pulseloco.parallel`): each chunk
    is compared, its changed values gathered and, when the digests are not given, hashed while it is in cache.
    Tensors on a GPU are compared and gathered there; only indices and values cross to the host. The bytes do
    not depend on the number of threads.

    ``base_digest`` / ``new_digest`` skip hashing that state when the caller already knows its digest (a
    publisher knows the digest of the version it published last); they are trusted as given.

    ``values="absolute"`` stores the new values, ``values="delta"`` the modular bit-pattern differences.
    Neither state is modified. Raises :class:`PatchError` when the states' layouts differ, :class:`TypeError`
    for a non-floating tensor and :class:`ValueError` for an unknown ``values`` mode.
    """
    if values not in PATCH_VALUE_MODES:
        raise ValueError(f"values must be one of {PATCH_VALUE_MODES}, got {values!r}")
    _check_same_layout(base, new)
    names = sorted(new)
    for name in names:
        bit_format(new[name].dtype)  # raises TypeError for non-floating tensors
    hash_base, hash_new, delta = base_digest is None, new_digest is None, values == "delta"
    jobs: list[tuple[str, Callable[[], _Diff]]] = []
    for name in names:
        b, n = base[name].detach(), new[name].detach()
        if _on_cpu(b) and _on_cpu(n):
            base_bits, new_bits = bit_view(b).numpy(), bit_view(n).numpy()
            for start, end in chunk_spans(n.numel(), n.element_size()):
                jobs.append(
                    (name, functools.partial(_diff_chunk, base_bits, new_bits, start, end, hash_base, hash_new, delta))
                )
        else:
            jobs.append((name, functools.partial(_diff_device, b, n, hash_base, hash_new, delta)))
    found: dict[str, list[_Diff]] = {name: [] for name in names}
    for (name, _), part in zip(jobs, parallel_map(lambda job: job[1](), jobs), strict=True):
        found[name].append(part)
    per_tensor = {name: _concat(parts) if parts else None for name, parts in found.items()}
    entries = []
    for name in names:
        diff, n = per_tensor[name], new[name]
        if diff is None or diff.indices_K.size == 0:
            continue
        if delta and diff.base_K is not None:
            values_K = torch.from_numpy(modular_delta(diff.base_K, diff.new_K))
        else:
            values_K = torch.from_numpy(diff.new_K).view(n.dtype)
        entries.append(SparseTensor(name, tuple(n.shape), n.dtype, torch.from_numpy(diff.indices_K), values_K))

    def digest_of(state: Mapping[str, torch.Tensor], which: str) -> str:
        hashes = {}
        for name in names:
            diff = per_tensor[name]
            hashes[name] = getattr(diff, which) if diff is not None else []
        return combine_digest(state, hashes)

    return encode_payload(
        entries,
        value_mode=values,
        version=version,
        base_version=base_version,
        base_digest=base_digest if base_digest is not None else digest_of(base, "base_hashes"),
        result_digest=new_digest if new_digest is not None else digest_of(new, "new_hashes"),
        level=level,
        meta=meta,
    )


class _ChunkWrite:
    """One pending scatter into one digest chunk of a CPU tensor (or one whole tensor on the torch path), with
    what is needed to undo it exactly and the hashes of the chunks it wrote."""

    def __init__(
        self,
        tensor: torch.Tensor,
        indices_K: np.ndarray,
        values_K: torch.Tensor,
        delta: bool,
        span: tuple[int, int] | None,
    ) -> None:
        self.tensor = tensor
        self.indices_K = indices_K
        self.values_K = values_K
        self.delta = delta
        self.span = span
        self.old_K: torch.Tensor | None = None
        self.new_K = values_K
        self.written = False
        self.hashes: list[bytes] = []

    def _new_values(self, old_K: torch.Tensor) -> torch.Tensor:
        if not self.delta:
            return self.values_K.to(old_K.device)
        old_bits = old_K.cpu().view(bit_format(self.tensor.dtype).int_dtype).numpy()
        new_bits = modular_add(old_bits, self.values_K.numpy())
        return torch.from_numpy(new_bits).view(self.tensor.dtype).to(old_K.device)

    def prepare(self) -> None:
        """Read the values the write will replace and compute the new ones. When tensors share memory (tied
        weights), every write of a patch is prepared before any is applied, so that all of them see the base."""
        if self.span is not None:  # numpy path: one chunk of a contiguous CPU tensor
            self.old_K = torch.from_numpy(bit_view(self.tensor).numpy()[self.indices_K]).view(self.tensor.dtype)
        else:
            flat = self.tensor.reshape(-1)
            self.old_K = flat.index_select(0, torch.from_numpy(self.indices_K).to(flat.device))
        self.new_K = self._new_values(self.old_K)

    def _write(self, values_K: torch.Tensor) -> None:
        if self.span is not None:  # numpy path: one chunk of a contiguous CPU tensor
            int_dtype = bit_format(self.tensor.dtype).int_dtype
            bit_view(self.tensor).numpy()[self.indices_K] = values_K.view(int_dtype).numpy()
            return
        flat = self.tensor.view(-1) if self.tensor.is_contiguous() else self.tensor.reshape(-1).clone()
        flat.index_copy_(0, torch.from_numpy(self.indices_K).to(flat.device), values_K)
        if not self.tensor.is_contiguous():
            self.tensor.copy_(flat.view(self.tensor.shape))

    def apply(self) -> None:
        """Write the prepared values and hash what was written (the chunk, or every chunk of the tensor)."""
        self._write(self.new_K)
        self.written = True
        if self.span is not None:
            start, end = self.span
            self.hashes = [hash_chunk(bit_view(self.tensor).numpy()[start:end].view(np.uint8))]
        else:
            self.hashes = state_chunk_digests({"t": self.tensor})["t"]

    def prepare_and_apply(self) -> None:
        """:meth:`prepare` then :meth:`apply`, in one job (tensors that share no memory)."""
        self.prepare()
        self.apply()

    def undo(self) -> None:
        """Restore the values :meth:`apply` overwrote (a no-op when it never wrote)."""
        if self.written and self.old_K is not None:
            self._write(self.old_K)


def _plan_writes(
    state: Mapping[str, torch.Tensor], entries: Sequence[SparseTensor], delta: bool
) -> list[tuple[str, int | None, _ChunkWrite]]:
    """One write per digest chunk that the patch touches (CPU tensors), or per tensor (the torch path); each
    with its tensor name and chunk number (None: every chunk of the tensor)."""
    plan: list[tuple[str, int | None, _ChunkWrite]] = []
    for entry in entries:
        target = state[entry.name]
        indices_K = entry.indices.numpy()
        if not _on_cpu(target):
            plan.append((entry.name, None, _ChunkWrite(target, indices_K, entry.values, delta, None)))
            continue
        spans = chunk_spans(target.numel(), target.element_size())
        bounds = np.searchsorted(indices_K, [start for start, _ in spans] + [target.numel()])
        for i, span in enumerate(spans):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi > lo:
                plan.append((entry.name, i, _ChunkWrite(target, indices_K[lo:hi], entry.values[lo:hi], delta, span)))
    return plan


def _shares_memory(state: Mapping[str, torch.Tensor], names: Sequence[str]) -> bool:
    """Whether two of the named tensors share storage (tied weights): their writes must all be prepared from
    the base before any is applied."""
    storages = [state[name].untyped_storage().data_ptr() for name in names]
    return len(set(storages)) != len(storages)


def apply_patch(
    state: MutableMapping[str, torch.Tensor],
    payload: bytes,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> PatchInfo:
    """Apply a patch to ``state`` in place, atomically.

    Decodes and validates the whole payload first, checks every named tensor exists with the patch's shape
    and dtype (:class:`TensorMismatchError`), checks that ``state`` is the patch's base by digest
    (:class:`StalePatchError`; re-applying an ``absolute`` patch to a state already at its version is a
    no-op reported with ``already_applied=True``), scatters, and verifies the result digest; on a mismatch or
    any error during the scatter, the old values are restored and :class:`DigestMismatchError` (or the
    original error) is raised. Payload problems raise :class:`pulseloco.errors.PayloadError` subclasses.
    Nothing is written before the payload and the base digest have been verified.

    Decoding, hashing and the scatter run one digest chunk at a time on every core; a chunk the patch writes is
    hashed again right after its write, and the hashes of the chunks it does not touch are reused. Tensors on
    a GPU are scattered there (only the indices and values cross the bus).
    """
    # Check names, shapes and dtypes from the header before decompressing anything: a patch for tensors
    # this state does not have must not make the receiver allocate what its header declares.
    header = peek_header(payload, max_elements=max_elements)
    if header.value_mode not in PATCH_VALUE_MODES:
        raise PatchError(
            f"payload carries {header.value_mode} values, not a state patch; use decode_payload to read it"
        )
    for t in header.tensors:
        name = t["name"]
        if name not in state:
            raise TensorMismatchError(f"patch names tensor {name!r}, which this state does not have")
        target = state[name]
        if list(target.shape) != t["shape"] or str(target.dtype).removeprefix("torch.") != t["dtype"]:
            theirs, ours = f"{t['dtype']}{tuple(t['shape'])}", f"{target.dtype}{tuple(target.shape)}"
            raise TensorMismatchError(f"tensor {name!r}: patch has {theirs}, state has {ours}")
    decoded = decode_payload(payload, max_elements=max_elements, header=header)
    chunk_hashes = state_chunk_digests(state)
    digest = combine_digest(state, chunk_hashes)
    if digest != header.base_digest:
        if digest == header.result_digest and header.value_mode == "absolute":
            logger.debug("patch already applied version=%s", header.version)
            return PatchInfo(header.version, header.base_version, 0, header.value_mode, digest, len(payload), True)
        already = " (the state is already at this version)" if digest == header.result_digest else ""
        raise StalePatchError(
            f"patch for version {header.version} needs base version {header.base_version} "
            f"(digest {header.base_digest[:16]}), the state has digest {digest[:16]}{already}; "
            "fetch the missing versions or an anchor"
        )
    plan = _plan_writes(state, decoded.entries, header.value_mode == "delta")
    with torch.no_grad():
        try:
            if _shares_memory(state, [entry.name for entry in decoded.entries]):
                parallel_map(lambda item: item[2].prepare(), plan)
                parallel_map(lambda item: item[2].apply(), plan)
            else:  # each chunk read, written and re-hashed while it is in cache
                parallel_map(lambda item: item[2].prepare_and_apply(), plan)
            for name, chunk, write in plan:
                if chunk is None:
                    chunk_hashes[name] = write.hashes
                else:
                    chunk_hashes[name][chunk] = write.hashes[0]
            result = combine_digest(state, chunk_hashes)
            if result != header.result_digest:
                raise DigestMismatchError(
                    f"patch for version {header.version} produced digest {result[:16]}, "
                    f"expected {header.result_digest[:16]}; state restored, recover from an anchor"
                )
        except BaseException:
            for _, _, write in reversed(plan):
                write.undo()
            raise
    changed = {entry.name: entry.indices for entry in decoded.entries}
    return PatchInfo(
        header.version, header.base_version, header.num_changed, header.value_mode, result, len(payload), False, changed
    )


def _merge_absolute(indices: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of index sets, keeping the value from the latest patch at each index."""
    idx = torch.cat(indices)
    val = torch.cat(values)
    idx_sorted, order = torch.sort(idx, stable=True)
    last = torch.ones_like(idx_sorted, dtype=torch.bool)
    last[:-1] = idx_sorted[1:] != idx_sorted[:-1]
    return idx_sorted[last], val[order[last]]


def _merge_delta(indices: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of index sets with modular sums of the deltas; indices whose net delta is zero are dropped."""
    idx = torch.cat(indices).numpy()
    if idx.size == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=values[0].dtype)
    width = values[0].element_size()
    val = np.concatenate([v.numpy().view(f"<u{width}") for v in values])
    order = np.argsort(idx, kind="stable")
    idx, val = idx[order], val[order]
    starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
    sums = np.add.reduceat(val, starts, dtype=val.dtype)  # unsigned add in the value's width: modular
    keep = sums != 0
    return torch.from_numpy(idx[starts][keep]), torch.from_numpy(sums[keep].view(f"<i{width}")).view(values[0].dtype)


def squash(patches: Sequence[bytes], *, level: int = 1, max_elements: int = DEFAULT_MAX_ELEMENTS) -> bytes:
    """One patch equal to applying ``patches`` in order (from the first's base to the last's result).

    Exact for absolute values (the latest value wins) and for deltas (modular sums). Raises
    :class:`PatchError` if the list is empty, mixes value modes, or does not form a chain (each patch's base
    version and digest must be the previous patch's version and result digest), and
    :class:`TensorMismatchError` if a tensor changes shape or dtype along the chain.
    """
    if not patches:
        raise PatchError("squash needs at least one patch")
    decoded = [decode_payload(p, max_elements=max_elements) for p in patches]
    mode = decoded[0].header.value_mode
    for prev, cur in itertools.pairwise(decoded):
        h0, h1 = prev.header, cur.header
        if h1.value_mode != mode:
            raise PatchError(f"cannot squash {mode} and {h1.value_mode} patches together")
        if h1.base_version != h0.version or h1.base_digest != h0.result_digest:
            raise PatchError(
                f"patches do not form a chain: version {h1.version} has base {h1.base_version}, "
                f"previous patch is version {h0.version}"
            )
    if mode not in PATCH_VALUE_MODES:
        raise PatchError(f"cannot squash {mode} payloads; only patches ({PATCH_VALUE_MODES})")
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    parts: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d in decoded:
        for e in d.entries:
            if layout.setdefault(e.name, (e.shape, e.dtype)) != (e.shape, e.dtype):
                raise TensorMismatchError(f"tensor {e.name!r} changes shape or dtype along the chain")
            parts.setdefault(e.name, ([], []))
            parts[e.name][0].append(e.indices)
            parts[e.name][1].append(e.values)
    merge = _merge_absolute if mode == "absolute" else _merge_delta
    entries = []
    for name in sorted(parts):
        idx, val = merge(*parts[name])
        if idx.numel():
            entries.append(SparseTensor(name, layout[name][0], layout[name][1], idx, val))
    first, last = decoded[0].header, decoded[-1].header
    return encode_payload(
        entries,
        value_mode=mode,
        version=last.version,
        base_version=first.base_version,
        base_digest=first.base_digest,
        result_digest=last.result_digest,
        level=level,
        meta={"squashed_versions": [d.header.version for d in decoded]},
    )
