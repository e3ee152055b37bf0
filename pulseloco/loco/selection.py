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

Values can also be quantized (``values="quantized"``): each parameter's sent values are quantized together to
``bits`` bits (:func:`pulseloco.loco.quantize.quantize_lut`), the decoded FP32 values are sent (the codec's ``lut``
mode), and the residual keeps ``fl(s - q(s))``, the quantization error rounded once to FP32: ``sent + residual``
equals the signal up to that one rounding (half a unit in the last place of the residual), not bit for bit.

Rules (docs/design.md section 2.2):

- ``pulse``: the compute-visibility gate. An entry fires when applying the signal would change the BF16 bit
  pattern of the parameter: ``bits(bf16(theta)) != bits(bf16(theta - signal))``. With a budget
  (``pulse_budget``) or quantized values it is a :class:`ChunkedSelector`: at most ``k`` visible entries per tile,
  the largest.
- ``dense``: DiLoCo. Every entry, so the residual is all zeros.
- ``sparseloco``: SparseLoCo (Sarfi et al. 2025). Per ``chunk x chunk`` tile of each parameter (rows of
  ``chunk`` for 1-D ones) the ``k`` largest magnitudes, values quantized to 2 bits per parameter
  (:class:`ChunkedSelector`, :mod:`pulseloco.loco.quantize`).

Legend: ``*_N`` has one entry per parameter element, ``*_K`` one per selected element.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch

from pulseloco.errors import ConfigError
from pulseloco.loco.quantize import ParamLayout, quantize_lut, tile_topk_mask
from pulseloco.loco.validation import WIRE_FORMATS

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BITS",
    "DEFAULT_CHUNK",
    "SELECTORS",
    "VALUE_DTYPES",
    "ChunkedSelector",
    "DenseSelector",
    "PulseSelector",
    "Selection",
    "Selector",
    "ValueDType",
    "compute_visible_mask",
    "make_selector",
    "select_in_place",
]

SelectorName = Literal["pulse", "dense", "sparseloco"]
#: Names accepted by :func:`make_selector`.
SELECTORS: tuple[SelectorName, ...] = get_args(SelectorName)

ValueDType = Literal["float32", "bfloat16", "quantized"]
#: Value precisions: FP32, BF16 (the rounding remainder stays in the residual) or quantized per parameter
#: (:func:`~pulseloco.loco.quantize.quantize_lut`); the wire formats of :mod:`pulseloco.loco.validation` (checked
#: at import).
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


DEFAULT_CHUNK = 64
"""Side of a SparseLoCo tile: 64 x 64 = 4096 entries of a matrix, rows of 64 of a vector."""
DEFAULT_BITS = 2
"""Bits per quantized value (SparseLoCo's setting)."""


class PulseSelector:
    """Compute-visibility gate with error feedback (PULSELoCo), element by element; ``values`` is the precision of
    the sent values, ``float32`` or ``bfloat16`` (quantized values need the parameters: :class:`ChunkedSelector`).
    Raises :class:`ConfigError` for another precision."""

    name = "pulse"

    def __init__(self, values: str = "float32") -> None:
        if values not in ("float32", "bfloat16"):
            raise ConfigError(f"pulse_values must be float32 or bfloat16 here, got {values!r}")
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


class ChunkedSelector:
    """Selection per parameter, with SparseLoCo's compression (:mod:`pulseloco.loco.quantize`): per ``chunk x
    chunk`` tile the ``k`` entries of largest magnitude, among the pulse gate's visible entries when ``gate`` (the
    gate with a budget), or every visible entry when ``k`` is None; values sent in ``values`` precision, where
    ``"quantized"`` quantizes each parameter's sent values to ``bits`` bits (the quantization error stays in the
    residual). ``layout`` is the parameters' :class:`~pulseloco.loco.quantize.ParamLayout`.

    ``name`` is ``"sparseloco"`` for the published algorithm (no gate, ``k`` per tile, quantized values) and
    ``"pulse"`` for the gate's low-precision and budgeted forms. Raises :class:`ConfigError` for a ``k`` or
    ``chunk`` below 1, ``bits`` outside 1..8, an unknown ``values``, or neither a gate nor a ``k``.
    """

    def __init__(
        self,
        layout: ParamLayout,
        *,
        gate: bool,
        k: int | None,
        chunk: int = DEFAULT_CHUNK,
        values: str = "quantized",
        bits: int = DEFAULT_BITS,
    ) -> None:
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"the entries kept per chunk (topk_k / pulse_budget) must be at least 1, got {k!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"chunk_size must be an integer of at least 1, got {chunk!r}")
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ConfigError(f"quant_bits must be an integer in 1..8, got {bits!r}")
        if values not in VALUE_DTYPES:
            raise ConfigError(f"values must be one of {', '.join(VALUE_DTYPES)}, got {values!r}")
        if not gate and k is None:
            raise ConfigError("a chunked selection needs the pulse gate or a number of entries per chunk")
        self.name = "pulse" if gate else "sparseloco"
        self.layout = layout
        self.gate = gate
        self.k = k
        self.chunk = chunk
        self.values = values
        self.bits = bits

    def select(self, theta_N: torch.Tensor, signal_N: torch.Tensor) -> Selection:
        """The selection of the whole flat space (see :meth:`select_into`)."""
        _check_inputs(theta_N, signal_N)
        residual_N = signal_N.clone()
        indices_K, values_K = self.select_into(theta_N, residual_N, chunk_numel=max(1, residual_N.numel()))
        return Selection(indices_K=indices_K, values_K=values_K, residual_N=residual_N, value_dtype=self.values)

    def select_into(
        self, theta_N: torch.Tensor, signal_N: torch.Tensor, *, chunk_numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Select parameter by parameter, in bands of whole tile rows of about ``chunk_numel`` entries, overwrite
        ``signal_N`` with the residual and return the sorted indices and the values sent. Raises
        :class:`ValueError` when the flat space is not the layout's."""
        if signal_N.numel() != self.layout.numel:
            raise ValueError(f"the signal has {signal_N.numel()} entries, the parameter layout {self.layout.numel}")
        indices: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for start, (rows, cols) in zip(self.layout.starts, self.layout.shapes, strict=True):
            band = max(self.chunk, (chunk_numel // max(cols, 1)) // self.chunk * self.chunk)
            chosen: list[torch.Tensor] = []
            for row in range(0, rows, band):
                lo, hi = start + row * cols, start + min(rows, row + band) * cols
                signal_B = signal_N[lo:hi]
                visible_B = compute_visible_mask(theta_N[lo:hi], signal_B) if self.gate else None
                if self.k is None and visible_B is not None:  # the constructor refuses neither a gate nor a k
                    keep_B = visible_B
                else:
                    magnitude_B = signal_B.abs()
                    if visible_B is not None:
                        magnitude_B = torch.where(visible_B, magnitude_B, -1.0)
                    shape = (min(rows, row + band) - row, cols)
                    keep_B = tile_topk_mask(magnitude_B.view(shape), self.k or 1, self.chunk).reshape(-1)
                    if visible_B is not None:
                        keep_B &= visible_B
                chosen.append(torch.nonzero(keep_B, as_tuple=False).reshape(-1) + lo)
            indices_P = torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.int64, device=signal_N.device)
            signal_P = signal_N[indices_P]
            if self.values == "quantized":
                values_P = quantize_lut(signal_P, self.bits)
            elif self.values == "bfloat16":
                values_P = signal_P.to(torch.bfloat16).to(torch.float32)
            else:
                values_P = signal_P
            signal_N[indices_P] = signal_P - values_P  # 0, the BF16 remainder, or the quantization error
            indices.append(indices_P)
            values.append(values_P)
        return torch.cat(indices), torch.cat(values)


def make_selector(
    name: str,
    *,
    layout: ParamLayout | None = None,
    pulse_values: str = "float32",
    pulse_budget: int | None = None,
    topk_k: int = 64,
    chunk_size: int = DEFAULT_CHUNK,
    quant_bits: int = DEFAULT_BITS,
) -> Selector:
    """Build the selection rule called ``name`` (one of :data:`SELECTORS`) for the parameters of ``layout`` (the
    chunked rules need it; default: one vector of the tile's size, enough to check the settings).

    ``pulse`` is the element-wise :class:`PulseSelector` for FP32 or BF16 values without a budget, else a gated
    :class:`ChunkedSelector`; ``sparseloco`` keeps ``topk_k`` entries per tile with ``quant_bits``-bit values.
    Raises :class:`ConfigError` for an unknown name or an invalid setting, or ``pulse_values`` / ``pulse_budget``
    given to another rule.
    """
    if name not in SELECTORS:
        raise ConfigError(f"selector must be one of {SELECTORS}, got {name!r}")
    if name != "pulse" and (pulse_values != "float32" or pulse_budget is not None):
        raise ConfigError(f"pulse_values / pulse_budget need selector 'pulse', got {name!r}")
    if pulse_values not in VALUE_DTYPES:
        raise ConfigError(f"pulse_values must be one of {', '.join(VALUE_DTYPES)}, got {pulse_values!r}")
    layout = layout or ParamLayout([(chunk_size if isinstance(chunk_size, int) and chunk_size > 0 else 1,)])
    if name == "dense":
        return DenseSelector()
    if name == "sparseloco":
        return ChunkedSelector(layout, gate=False, k=topk_k, chunk=chunk_size, values="quantized", bits=quant_bits)
    if pulse_budget is None and pulse_values != "quantized":
        return PulseSelector(pulse_values)
    return ChunkedSelector(layout, gate=True, k=pulse_budget, chunk=chunk_size, values=pulse_values, bits=quant_bits)


def select_in_place(
    selector: Selector, theta_N: torch.Tensor, signal_N: torch.Tensor, *, chunk_numel: int
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Run ``selector`` block by block and overwrite ``signal_N`` with the residual; returns ``(indices_K,
    values_K, value_dtype)`` as :class:`Selection` has them.

    The result is bit-identical to ``selector.select(theta_N, signal_N)`` (the element-wise rules decide each entry
    from that entry alone; a :class:`ChunkedSelector` works in bands of whole tile rows and quantizes per
    parameter), but
    the temporaries are bounded by one block of about ``chunk_numel`` entries plus the selected entries, not by
    the model. Raises as ``selector.select`` does (:class:`TypeError` / :class:`ValueError` for non-FP32 or
    mismatched inputs) and :class:`ValueError` for ``chunk_numel < 1``; on an error ``signal_N`` may be partly
    overwritten.
    """
    _check_inputs(theta_N, signal_N)
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be at least 1, got {chunk_numel}")
    if isinstance(selector, ChunkedSelector):
        indices_K, values_K = selector.select_into(theta_N, signal_N, chunk_numel=chunk_numel)
        return indices_K, values_K, selector.values
    if isinstance(selector, DenseSelector):  # every entry: no blocks to select in and concatenate
        values_K = signal_N.clone()
        signal_N.zero_()
        return torch.arange(signal_N.numel(), dtype=torch.int64, device=signal_N.device), values_K, "float32"
    block = chunk_numel
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
