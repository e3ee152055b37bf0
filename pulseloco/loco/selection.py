"""Selection rules: which entries of the error-corrected pseudo-gradient a peer sends in one outer round.

Every rule maps the global parameters ``theta_N`` and the signal ``signal_N = residual_N + pseudo_gradient_N``
(both FP32, one entry per parameter) to a :class:`Selection`: the sorted flat indices to send, the FP32 signal
values there, and the new residual (the signal everywhere else, zero at sent entries). The conservation
invariant ``sent + residual == signal`` holds exactly, element by element, for every rule: a sent entry
carries the raw FP32 signal (never a rounded change) and the residual keeps exactly what was not sent.

The pulse rule can also send BF16 values (``values="bfloat16"``, 2 bytes a value instead of 4): a sent entry then
carries ``bf16(s)``, the signal rounded to nearest, and the residual keeps ``s - bf16(s)``, which error feedback
delivers in a later round. ``s - bf16(s)`` is exact in FP32 (it is the low bits of ``s``), so the invariant still
holds bit for bit.

Rules (docs/design.md section 2.2):

- ``pulse``: the compute-visibility gate. An entry fires when applying the signal would change the BF16 bit
  pattern of the parameter: ``bits(bf16(theta)) != bits(bf16(theta - signal))``.
- ``dense``: DiLoCo. Every entry, so the residual is all zeros.
- ``topk``: SparseLoCo-style. In each contiguous chunk of ``chunk_size`` entries, the ``k`` largest by
  magnitude, with ``k = ceil(density * chunk_size)``; the rest stays in the residual.

Legend: ``*_N`` has one entry per parameter element, ``*_K`` one per selected element.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch

from pulseloco.errors import ConfigError
from pulseloco.loco.validation import WIRE_FORMATS

logger = logging.getLogger(__name__)

__all__ = [
    "SELECTORS",
    "VALUE_DTYPES",
    "DenseSelector",
    "PulseSelector",
    "Selection",
    "Selector",
    "TopKSelector",
    "ValueDType",
    "compute_visible_mask",
    "make_selector",
    "select_in_place",
]

SelectorName = Literal["pulse", "dense", "topk"]
#: Names accepted by :func:`make_selector`.
SELECTORS: tuple[SelectorName, ...] = get_args(SelectorName)

ValueDType = Literal["float32", "bfloat16"]
#: Value precisions of the pulse rule: the dtype in which sent values are exact (and travel on the wire); the
#: wire formats of :mod:`pulseloco.loco.validation` (checked at import).
VALUE_DTYPES: tuple[ValueDType, ...] = get_args(ValueDType)
if set(VALUE_DTYPES) != set(WIRE_FORMATS):
    raise ImportError(f"pulse value dtypes {VALUE_DTYPES} differ from the wire formats {tuple(WIRE_FORMATS)}")


@dataclass(frozen=True)
class Selection:
    """The outcome of a selection rule for one outer round.

    ``indices_K`` are sorted, strictly increasing int64 flat indices; ``values_K`` the FP32 values sent at them
    (exactly representable in ``value_dtype``, the precision they travel in); ``residual_N`` the signal minus
    what was sent: the signal at every entry that was not selected, zero (or, for BF16 values, the rounding
    remainder) at the selected ones.
    """

    indices_K: torch.Tensor
    values_K: torch.Tensor
    residual_N: torch.Tensor
    value_dtype: str = "float32"

    @property
    def num_sent(self) -> int:
        """Number of selected entries."""
        return int(self.indices_K.numel())


class Selector(Protocol):
    """A selection rule. ``select`` never modifies its arguments."""

    name: str

    def select(self, theta_N: torch.Tensor, signal_N: torch.Tensor) -> Selection:
        """Select the entries of ``signal_N`` to send; see the module docstring."""
        ...


def _check_inputs(theta_N: torch.Tensor, signal_N: torch.Tensor) -> None:
    if theta_N.dtype != torch.float32 or signal_N.dtype != torch.float32:
        raise TypeError(f"selection needs FP32 tensors, got theta {theta_N.dtype} and signal {signal_N.dtype}")
    if theta_N.dim() != 1 or theta_N.shape != signal_N.shape:
        raise ValueError(
            f"selection needs flat tensors of one shape, got {tuple(theta_N.shape)} and {tuple(signal_N.shape)}"
        )


def _from_mask(mask_N: torch.Tensor, signal_N: torch.Tensor, value_dtype: str = "float32") -> Selection:
    indices_K = torch.nonzero(mask_N, as_tuple=False).reshape(-1)
    signal_K = signal_N[indices_K]
    if value_dtype == "bfloat16":
        values_K = signal_K.to(torch.bfloat16).to(torch.float32)
        residual_N = signal_N.clone()
        residual_N[indices_K] = signal_K - values_K  # exact: the bits of s that BF16 dropped
    else:
        values_K = signal_K
        residual_N = torch.where(mask_N, torch.zeros((), dtype=signal_N.dtype, device=signal_N.device), signal_N)
    return Selection(indices_K=indices_K, values_K=values_K, residual_N=residual_N, value_dtype=value_dtype)


def compute_visible_mask(theta_N: torch.Tensor, signal_N: torch.Tensor) -> torch.Tensor:
    """The PULSE gate: True where ``bf16(theta - signal)`` differs bitwise from ``bf16(theta)``.

    Compared as int16 bit patterns, so ``-0.0`` vs ``+0.0`` counts as a change and NaN payloads compare
    exactly. Raises :class:`TypeError` / :class:`ValueError` for non-FP32 or mismatched inputs.
    """
    _check_inputs(theta_N, signal_N)
    before = theta_N.to(torch.bfloat16).view(torch.int16)
    after = (theta_N - signal_N).to(torch.bfloat16).view(torch.int16)
    return before != after


class PulseSelector:
    """Compute-visibility gate with error feedback (PULSELoCo); ``values`` is the precision of the sent values
    (:data:`VALUE_DTYPES`; see the module docstring). Raises :class:`ConfigError` for another precision."""

    name = "pulse"

    def __init__(self, values: str = "float32") -> None:
        if values not in VALUE_DTYPES:
            raise ConfigError(f"pulse_values must be one of {', '.join(VALUE_DTYPES)}, got {values!r}")
        self.values = values

    def select(self, theta_N: torch.Tensor, signal_N: torch.Tensor) -> Selection:
        """Select the entries whose update is visible after the BF16 cast."""
        return _from_mask(compute_visible_mask(theta_N, signal_N), signal_N, self.values)


class DenseSelector:
    """Every entry (DiLoCo); the residual is zero."""

    name = "dense"

    def select(self, theta_N: torch.Tensor, signal_N: torch.Tensor) -> Selection:
        """Select every entry."""
        _check_inputs(theta_N, signal_N)
        indices_K = torch.arange(signal_N.numel(), dtype=torch.int64, device=signal_N.device)
        return Selection(indices_K=indices_K, values_K=signal_N.clone(), residual_N=torch.zeros_like(signal_N))


class TopKSelector:
    """Chunked top-k by magnitude with error feedback (SparseLoCo-style baseline).

    ``density`` in (0, 1] is the fraction kept per chunk of ``chunk_size`` entries (rounded up, at least one
    per chunk); the last, shorter chunk keeps the same ``k`` or all of its entries if it has fewer. Raises
    :class:`ConfigError` for a density outside (0, 1] or a chunk size below 1.
    """

    name = "topk"

    def __init__(self, density: float = 0.01, chunk_size: int = 4096) -> None:
        if not 0.0 < density <= 1.0:
            raise ConfigError(f"topk_density must be in (0, 1], got {density}")
        if chunk_size < 1:
            raise ConfigError(f"topk_chunk_size must be at least 1, got {chunk_size}")
        self.density = float(density)
        self.chunk_size = int(chunk_size)
        self.k = max(1, math.ceil(self.density * self.chunk_size))

    def select(self, theta_N: torch.Tensor, signal_N: torch.Tensor) -> Selection:
        """Select the ``k`` largest-magnitude entries of each chunk."""
        _check_inputs(theta_N, signal_N)
        numel = signal_N.numel()
        num_chunks = -(-numel // self.chunk_size)
        # Pad with -1 magnitudes so padding never wins against a real entry (magnitudes are >= 0 or NaN).
        magnitude = torch.full((num_chunks * self.chunk_size,), -1.0, dtype=torch.float32, device=signal_N.device)
        magnitude[:numel] = signal_N.abs()
        magnitude = magnitude.nan_to_num_(nan=float("inf")).view(num_chunks, self.chunk_size)
        k = min(self.k, self.chunk_size)
        # Ties at the k-th largest magnitude go to the lowest indices, so that every device selects the same
        # entries (torch.topk breaks ties differently on CPU and CUDA; BF16 signals tie often).
        kth_C1 = torch.topk(magnitude, k, dim=1, sorted=False).values.min(dim=1, keepdim=True).values
        above_CS = magnitude > kth_C1
        at_CS = magnitude == kth_C1
        room_C1 = k - above_CS.sum(dim=1, keepdim=True)
        keep_CS = above_CS | (at_CS & (at_CS.cumsum(dim=1) <= room_C1))
        return _from_mask(keep_CS.view(-1)[:numel], signal_N)


def make_selector(
    name: str, *, topk_density: float = 0.01, topk_chunk_size: int = 4096, pulse_values: str = "float32"
) -> Selector:
    """Build the selection rule called ``name`` (one of :data:`SELECTORS`).

    Raises :class:`ConfigError` for an unknown name, invalid top-k settings or an unknown ``pulse_values``
    (the pulse rule's value precision; the other rules send FP32).
    """
    if name == "pulse":
        return PulseSelector(pulse_values)
    if pulse_values != "float32":
        raise ConfigError(f"pulse_values={pulse_values!r} needs selector 'pulse', got {name!r}")
    if name == "dense":
        return DenseSelector()
    if name == "topk":
        return TopKSelector(topk_density, topk_chunk_size)
    raise ConfigError(f"selector must be one of {SELECTORS}, got {name!r}")


def select_in_place(
    selector: Selector, theta_N: torch.Tensor, signal_N: torch.Tensor, *, chunk_numel: int
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Run ``selector`` block by block and overwrite ``signal_N`` with the residual; returns ``(indices_K,
    values_K, value_dtype)`` as :class:`Selection` has them.

    The result is bit-identical to ``selector.select(theta_N, signal_N)`` (every rule decides each entry from
    that entry alone, or, for ``topk``, from its own chunk: blocks are whole multiples of ``chunk_size``), but
    the temporaries are bounded by one block of about ``chunk_numel`` entries plus the selected entries, not by
    the model. Raises as ``selector.select`` does (:class:`TypeError` / :class:`ValueError` for non-FP32 or
    mismatched inputs) and :class:`ValueError` for ``chunk_numel < 1``; on an error ``signal_N`` may be partly
    overwritten.
    """
    _check_inputs(theta_N, signal_N)
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be at least 1, got {chunk_numel}")
    multiple = selector.chunk_size if isinstance(selector, TopKSelector) else 1
    block = max(multiple, chunk_numel // multiple * multiple)
    numel = signal_N.numel()
    indices: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    value_dtype = "float32"
    for start in range(0, numel, block):
        stop = min(start + block, numel)
        selection = selector.select(theta_N[start:stop], signal_N[start:stop])
        signal_N[start:stop].copy_(selection.residual_N)
        indices.append(selection.indices_K + start)
        values.append(selection.values_K)
        value_dtype = selection.value_dtype
    if not indices:
        empty = torch.zeros(0, dtype=torch.int64, device=signal_N.device)
        return empty, torch.zeros(0, dtype=torch.float32, device=signal_N.device), value_dtype
    if len(indices) == 1:
        return indices[0], values[0], value_dtype
    return torch.cat(indices), torch.cat(values), value_dtype
