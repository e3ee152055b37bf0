"""SparseLoCo's compression primitives: top-k per tile of a parameter, and the lookup-table quantizer.

**Tiles.** A parameter is viewed as a matrix (``shape[0]`` rows, the rest as columns; a 1-D parameter is one row)
and cut into tiles of ``chunk x chunk`` entries (64 x 64 = 4096 by default; rows of ``chunk`` for 1-D
parameters, since such a matrix has one row). A tile keeps its ``ceil(k * n / chunk**2)`` entries of largest
magnitude, ``n`` its real entries (edge tiles are smaller): ``k`` in a full tile, one per row of 64 of a 1-D
parameter at ``k = 64``. Ties go to the tile's earlier entries (row-major), the same on every device.

**Quantizer** (SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706): the values one parameter sends are quantized
together to ``bits`` bits: subtract their mean, cut ``range_sigmas`` (6) standard deviations of the centred values
into ``2**bits`` bins (``code = clamp(round(c / scale + 2**bits / 2), 0, 2**bits - 1)``, ``scale = range_sigmas *
std / 2**bits``), and decode each code to the mean of the centred values in its bin plus the mean. The decoded
FP32 values are what is sent (the codec's ``lut`` mode carries them exactly, :mod:`pulseloco.codec.lut`), and the
error feedback keeps ``signal - decoded``, so the quantization error is sent in later rounds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RANGE_SIGMAS", "ParamLayout", "quantize_lut", "tile_topk_mask"]

DEFAULT_RANGE_SIGMAS = 6.0
"""Standard deviations of the centred values the quantizer's bins cover (the published setting)."""


def quantize_lut(values_K: torch.Tensor, bits: int = 2, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> torch.Tensor:
    """The decoded values of ``values_K`` (FP32, one group) quantized to ``bits`` bits (module docstring): at most
    ``2**bits`` distinct FP32 values. Deterministic: the same input gives the same bits on every peer of a device
    type. Raises :class:`ValueError` for ``bits`` outside 1..8 or a non-FP32 input."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if values_K.dtype != torch.float32:
        raise ValueError(f"quantize_lut needs FP32 values, got {values_K.dtype}")
    count = values_K.numel()
    if count == 0:
        return values_K.clone()
    bins = 1 << bits
    shift = values_K.mean()
    centred = values_K - shift
    std = float(torch.linalg.vector_norm(centred)) / math.sqrt(count - 1) if count > 1 else 0.0
    scale = range_sigmas * std / bins
    if not (scale > 0.0 and math.isfinite(scale)):
        scale = 1.0  # every value equal: one bin, decoded to the mean exactly
    codes = torch.clamp(torch.round(centred / scale + bins // 2), 0, bins - 1).to(torch.int64)
    sums = torch.zeros(bins, dtype=torch.float32, device=values_K.device).index_add_(0, codes, centred)
    counts = torch.bincount(codes, minlength=bins).clamp_(min=1).to(torch.float32)
    lookup = sums / counts
    return lookup[codes] + shift


class ParamLayout:
    """Where each parameter lies in the flat space and its matrix view: ``starts[i]`` its first flat index,
    ``shapes[i]`` its ``(rows, columns)``. Raises :class:`ValueError` for an empty list of shapes."""

    def __init__(self, shapes: Sequence[Sequence[int]]) -> None:
        if not shapes:
            raise ValueError("a parameter layout needs at least one shape")
        self.shapes: list[tuple[int, int]] = []
        self.starts: list[int] = []
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            rows = int(shape[0]) if len(shape) >= 2 else 1
            self.shapes.append((rows, numel // rows if rows else 0))
            self.starts.append(offset)
            offset += numel
        self.numel = offset

    def group_starts(self) -> torch.Tensor:
        """The parameters' first flat indices (int64): the quantizer's groups."""
        return torch.tensor(self.starts, dtype=torch.int64)


def tile_topk_mask(magnitude_RC: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """True at the entries each ``chunk x chunk`` tile of the matrix ``magnitude_RC`` keeps (module docstring):
    ``ceil(k * n / chunk**2)`` of its ``n`` entries, largest first, ties to earlier entries. Entries below 0 are
    never preferred to real magnitudes (callers mark excluded entries with -1 and drop them afterwards)."""
    rows, cols = magnitude_RC.shape
    tile_rows, tile_cols = -(-rows // chunk), -(-cols // chunk)
    padded = torch.full((tile_rows * chunk, tile_cols * chunk), -2.0, device=magnitude_RC.device)
    padded[:rows, :cols] = magnitude_RC.nan_to_num(nan=float("inf"))
    tiles_TS = padded.view(tile_rows, chunk, tile_cols, chunk).permute(0, 2, 1, 3).reshape(-1, chunk * chunk)
    in_rows = (rows - torch.arange(tile_rows, device=magnitude_RC.device) * chunk).clamp(max=chunk)
    in_cols = (cols - torch.arange(tile_cols, device=magnitude_RC.device) * chunk).clamp(max=chunk)
    numel_T = (in_rows[:, None] * in_cols[None, :]).reshape(-1)
    keep_T = torch.minimum(-(-(k * numel_T) // (chunk * chunk)), numel_T)
    # The keep_T-th largest magnitude of each tile; entries above it are kept, and of the entries equal to it the
    # earliest ones up to the budget (torch.topk breaks ties differently on CPU and CUDA).
    largest_TK = torch.topk(tiles_TS, int(keep_T.max()), dim=1, sorted=True).values
    kth_T1 = largest_TK.gather(1, (keep_T - 1).clamp(min=0)[:, None])
    above_TS = tiles_TS > kth_T1
    at_TS = tiles_TS == kth_T1
    room_T1 = keep_T[:, None] - above_TS.sum(dim=1, keepdim=True)
    keep_TS = above_TS | at_TS
    tied_T = at_TS.sum(dim=1) > room_T1[:, 0]
    if bool(tied_T.any()):  # more entries equal to the threshold than room for them: the earliest win
        at_tied = at_TS[tied_T]
        keep_TS[tied_T] = above_TS[tied_T] | (at_tied & (at_tied.cumsum(dim=1) <= room_T1[tied_T]))
    keep = keep_TS.view(tile_rows, tile_cols, chunk, chunk).permute(0, 2, 1, 3).reshape(tile_rows * chunk, -1)
    return keep[:rows, :cols]
