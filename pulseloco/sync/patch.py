"""PULSESync patches: lossless sparse updates between two versions of a model state.

A patch for version ``t`` against base ``t-1`` lists, per tensor, the flat indices whose bit patterns differ
and either the new absolute values there (default: applying is a scatter, no arithmetic, so no drift) or the
modular difference of the bit patterns (``delta``: most changes are one unit in the last place, so it is far
smaller, but it is only correct on the exact base, which the base digest enforces). Every patch names its base
version and the digests of its base state and of the state it produces; :func:`apply_patch` is atomic.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pulseloco.codec import DEFAULT_MAX_ELEMENTS, SparseTensor, decode_payload, encode_payload, peek_header
from pulseloco.codec.bits import bit_format, changed_indices, modular_delta
from pulseloco.digest import state_digest
from pulseloco.errors import DigestMismatchError, PatchError, StalePatchError, TensorMismatchError

logger = logging.getLogger(__name__)

__all__ = ["PATCH_VALUE_MODES", "PatchInfo", "apply_patch", "make_patch", "squash"]

#: Value modes a patch may use (``float32`` payloads carry signals, not states).
PATCH_VALUE_MODES = ("absolute", "delta")


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

    ``base_digest`` / ``new_digest`` skip recomputing :func:`state_digest` when the caller already knows them
    (a publisher knows the digest of the version it published last); they are trusted as given.

    ``values="absolute"`` stores the new values, ``values="delta"`` the modular bit-pattern differences.
    Neither state is modified. Raises :class:`PatchError` when the states' layouts differ and
    :class:`ValueError` for an unknown ``values`` mode.
    """
    if values not in PATCH_VALUE_MODES:
        raise ValueError(f"values must be one of {PATCH_VALUE_MODES}, got {values!r}")
    _check_same_layout(base, new)
    entries = []
    for name in sorted(new):
        b, n = base[name].detach(), new[name].detach()
        bit_format(n.dtype)  # raises TypeError for non-floating tensors
        indices_K = changed_indices(b, n)
        if indices_K.numel() == 0:
            continue
        new_K = n.reshape(-1).index_select(0, indices_K)
        if values == "absolute":
            values_K = new_K.cpu()
        else:
            delta_K = modular_delta(b.reshape(-1).index_select(0, indices_K), new_K)
            values_K = torch.from_numpy(delta_K.view(delta_K.dtype.str.replace("u", "i")))
        entries.append(SparseTensor(name, tuple(n.shape), n.dtype, indices_K.cpu(), values_K))
    return encode_payload(
        entries,
        value_mode=values,
        version=version,
        base_version=base_version,
        base_digest=base_digest if base_digest is not None else state_digest(base),
        result_digest=new_digest if new_digest is not None else state_digest(new),
        level=level,
        meta=meta,
    )


class _Scatter:
    """One tensor's pending in-place scatter, with what is needed to undo it exactly."""

    def __init__(
        self, tensor: torch.Tensor, indices_K: torch.Tensor, values_K: torch.Tensor, *, delta: bool = False
    ) -> None:
        self.tensor = tensor
        self.flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        self.indices_K = indices_K.to(tensor.device)
        self.old_K = self.flat.index_select(0, self.indices_K)
        if delta:
            # New bit patterns = old + delta modulo 2**bits; unsigned numpy addition wraps by definition.
            width = self.old_K.element_size()
            old_bits = self.old_K.cpu().view(bit_format(tensor.dtype).int_dtype).numpy().view(f"<u{width}")
            new_bits = old_bits + values_K.numpy().view(f"<u{width}")
            values_K = torch.from_numpy(new_bits.view(f"<i{width}")).view(tensor.dtype)
        self.values_K = values_K.to(tensor.device)

    def _write(self, values_K: torch.Tensor) -> None:
        if self.flat.device.type == "cpu":
            # numpy's scatter on the shared memory is ~3x faster than torch's index_copy_ on CPU.
            int_dtype = bit_format(self.flat.dtype).int_dtype
            self.flat.view(int_dtype).numpy()[self.indices_K.numpy()] = values_K.view(int_dtype).numpy()
        else:
            self.flat.index_copy_(0, self.indices_K, values_K)
        if not self.tensor.is_contiguous():
            self.tensor.copy_(self.flat.view(self.tensor.shape))

    def apply(self) -> None:
        self._write(self.values_K)

    def undo(self) -> None:
        self._write(self.old_K)


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
    decoded = decode_payload(payload, max_elements=max_elements)
    digest = state_digest(state)
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
    scatters = []
    with torch.no_grad():
        for entry in decoded.entries:
            target = state[entry.name]
            scatters.append(_Scatter(target, entry.indices, entry.values, delta=header.value_mode == "delta"))
        done: list[_Scatter] = []
        try:
            for s in scatters:
                s.apply()
                done.append(s)
            result = state_digest(state)
            if result != header.result_digest:
                raise DigestMismatchError(
                    f"patch for version {header.version} produced digest {result[:16]}, "
                    f"expected {header.result_digest[:16]}; state restored, recover from an anchor"
                )
        except Exception:
            for s in reversed(done):
                s.undo()
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
