"""Encoding and validation of the sparse FP32 payloads PULSELoCo peers exchange.

A contribution (a peer's selected entries in one shard) and an aggregate (an owner's sum of a shard) are each
one frame of the codec's ``float32`` value mode holding one tensor. Everything received is untrusted:
:func:`decode_sparse` checks the frame (magic, sizes, checksum, index ranges: see
:func:`pulseloco.codec.decode_payload`), the tensor's name and length, and that every value is finite;
:func:`screen_outliers` rejects contributions whose norm is far above the others' (or, in a group of two, above
the screening peer's own).
"""

from __future__ import annotations

import itertools
import logging
import statistics

import torch

from pulseloco.codec import SparseTensor, decode_payload, encode_payload
from pulseloco.digest import state_digest
from pulseloco.errors import NonFiniteValuesError, TensorMismatchError

logger = logging.getLogger(__name__)

__all__ = [
    "AGGREGATE_NAME",
    "CONTRIBUTION_NAME",
    "WIRE_FORMATS",
    "decode_sparse",
    "encode_parts",
    "encode_sparse",
    "lut_groups",
    "screen_outliers",
    "theta_digest",
]

CONTRIBUTION_NAME = "pseudo_gradient"
"""The tensor name of a member's part (a contribution frame)."""
AGGREGATE_NAME = "pseudo_gradient_sum"
"""The tensor name of a shard's sum (the frame an owner serves)."""


def theta_digest(theta_N: torch.Tensor) -> str:
    """xxh3-128 digest of the flat global parameters (:func:`pulseloco.digest.state_digest`)."""
    return state_digest({"theta": theta_N})


WIRE_FORMATS: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "float32"),
    "bfloat16": (torch.bfloat16, "absolute"),
    "quantized": (torch.float32, "lut"),
}
"""Value precision of a part or sum -> its tensor dtype and the codec's value mode on the wire (the keys are the
selectors' :data:`pulseloco.loco.selection.VALUE_DTYPES`)."""


def lut_groups(indices_K: torch.Tensor, group_starts: torch.Tensor) -> tuple[int, ...]:
    """The sizes of the non-empty runs of sorted ``indices_K`` that fall in the groups beginning at the sorted
    ``group_starts`` (indices before the first start count with the first group): the ``lut`` mode's groups."""
    if indices_K.numel() == 0:
        return ()
    cuts = torch.searchsorted(indices_K.cpu(), group_starts[1:].cpu()).tolist()
    bounds = [0, *cuts, int(indices_K.numel())]
    return tuple(b - a for a, b in itertools.pairwise(bounds) if b > a)


def encode_sparse(
    name: str,
    numel: int,
    indices_K: torch.Tensor,
    values_K: torch.Tensor,
    *,
    round_index: int,
    value_dtype: str = "float32",
    group_starts: torch.Tensor | None = None,
) -> bytes:
    """Encode sorted local ``indices_K`` (into a flat tensor of ``numel`` entries) and ``values_K``: FP32 values in
    the codec's ``float32`` mode; with ``value_dtype="bfloat16"``, values that are exact in BF16 as a BF16 tensor
    in the ``absolute`` mode (2 bytes a value; the caller rounded them, see :mod:`pulseloco.loco.selection`); with
    ``"quantized"``, values with few distinct numbers per group (the groups begin at ``group_starts``, local
    indices; default one group) in the ``lut`` mode.

    Raises :class:`ValueError` for unsorted or out-of-range indices, an unknown ``value_dtype``, or quantized
    values with more than 256 distinct numbers in a group (a caller bug).
    """
    if value_dtype not in WIRE_FORMATS:
        raise ValueError(f"value_dtype must be one of {', '.join(WIRE_FORMATS)}, got {value_dtype!r}")
    dtype, mode = WIRE_FORMATS[value_dtype]
    groups = None
    if mode == "lut":
        starts = group_starts if group_starts is not None else torch.zeros(1, dtype=torch.int64)
        groups = lut_groups(indices_K.to(torch.int64), starts)
    entry = SparseTensor(
        name=name,
        shape=(int(numel),),
        dtype=dtype,
        indices=indices_K.to(torch.int64),
        values=values_K.to(dtype),
        groups=groups,
    )
    return encode_payload([entry], value_mode=mode, version=int(round_index), base_version=None)


def encode_parts(
    indices_K: torch.Tensor,
    values_K: torch.Tensor,
    bounds: list[tuple[int, int]] | tuple[tuple[int, int], ...],
    *,
    round_index: int,
    value_dtype: str = "float32",
    group_starts: torch.Tensor | None = None,
) -> list[bytes]:
    """A selection (sorted global ``indices_K``, FP32 ``values_K``) cut at the shards ``bounds`` (contiguous
    ``[start, stop)`` ranges in order) into one contribution frame per shard (:data:`CONTRIBUTION_NAME`, local
    indices; :func:`encode_sparse`, the quantization groups ``group_starts`` global): the parts a member pushes.
    Raises as :func:`encode_sparse` does."""
    stops = torch.tensor([stop for _, stop in bounds], dtype=torch.int64)
    offsets = [0, *torch.searchsorted(indices_K, stops).tolist()]
    return [
        encode_sparse(
            CONTRIBUTION_NAME,
            stop - start,
            indices_K[offsets[j] : offsets[j + 1]] - start,
            values_K[offsets[j] : offsets[j + 1]],
            round_index=round_index,
            value_dtype=value_dtype,
            group_starts=None if group_starts is None else group_starts - start,
        )
        for j, (start, stop) in enumerate(bounds)
    ]


def decode_sparse(payload: bytes, name: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a frame holding one sparse tensor ``name`` of ``numel`` entries, FP32 values (``float32`` mode), BF16
    ones (``absolute`` mode, a ``bfloat16`` tensor) or quantized ones (``lut`` mode); return (indices, FP32
    values).

    Raises a :class:`PayloadError` subclass for a malformed frame or indices out of range
    (:class:`InvalidIndicesError`), another tensor name, shape, dtype or value mode (:class:`TensorMismatchError`),
    or NaN/infinite values (:class:`NonFiniteValuesError`).
    """
    decoded = decode_payload(payload, max_elements=numel)
    mode = decoded.header.value_mode
    expected = next((dtype for dtype, wire_mode in WIRE_FORMATS.values() if wire_mode == mode), None)
    if expected is None:
        raise TensorMismatchError(f"expected value mode 'float32', 'absolute' or 'lut', got {mode!r}")
    if len(decoded.entries) != 1:
        raise TensorMismatchError(f"expected one tensor, got {len(decoded.entries)}")
    entry = decoded.entries[0]
    if entry.name != name or entry.shape != (numel,):
        raise TensorMismatchError(f"expected tensor {name!r} of shape ({numel},), got {entry.name!r} {entry.shape}")
    if entry.dtype != expected:
        raise TensorMismatchError(f"tensor {name!r} in {mode} mode must be {expected}, got {entry.dtype}")
    values = entry.values.to(torch.float32)
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteValuesError(f"tensor {name!r} carries non-finite values")
    return entry.indices, values


def screen_outliers(norms: dict[str, float], max_norm_ratio: float, reference: float | None = None) -> dict[str, str]:
    """Peers whose norm (a size per peer, the caller's choice of norm) exceeds ``max_norm_ratio`` times a trusted
    bar, with a reason.

    With three or more contributions the bar is the median norm of the *other* peers (the leave-one-out median
    keeps one huge payload from raising its own bar). With fewer there is no majority, so the bar is
    ``reference``, the norm of the screening peer's own contribution (the one it can trust); without a
    reference, or when the bar is zero (the others sent nothing here), nothing is rejected.
    """
    rejected: dict[str, str] = {}
    for peer, norm in norms.items():
        if len(norms) >= 3:
            bar, what = statistics.median(n for p, n in norms.items() if p != peer), "the group median"
        elif reference is not None:
            bar, what = reference, "the screening peer's own contribution"
        else:
            continue
        if bar > 0.0 and norm > max_norm_ratio * bar:
            rejected[peer] = f"norm {norm:.3e} exceeds {max_norm_ratio:g}x {what} {bar:.3e}"
    return rejected
