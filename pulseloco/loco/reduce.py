"""The ``topk`` exchange: an owner keeps a budget of its shard's aggregate per tile and sends only that.

With the ``gather`` exchange every member receives every other member's part (``R - 1`` payloads a round), and with
``sums`` the union of the ``R`` selections in FP32: both grow with the group. Here, as in Ok-Topk (Li and Hoefler,
PPoPP 2022) and gTop-k, an owner aggregates the accepted parts of its shard (clipped, summed in sorted peer-id order,
divided per entry by its senders for SparseLoCo's mean), keeps per ``chunk x chunk`` tile of each parameter the
largest-magnitude entries of the aggregate, up to a budget, and sends those, in the parts' value precision, to every
member: a fixed number of payloads (the budget's multiple of one part), whatever ``R``. Nothing is lost:

- a member's sent entries that the owner did not keep go back into that member's residual, exactly (the value it sent
  is added back, as for any part not counted), and are sent again in a later round (Ok-Topk's rule: an entry
  leaves the residual only where it was selected locally and kept globally);
- the owner's rounding of the kept aggregate to the wire precision (:func:`pulseloco.loco.quantize.quantize_lut`
  for quantized values, BF16 rounding, none for FP32) is known only to the owner, so it goes into the owner's
  residual (``absorbed_K``): the swarm's total still holds every value once. In SparseLoCo's mean over senders the
  absorbed error is in the average's units (what theta missed), otherwise in the sum's (what the parts sent).

**Budget.** ``factor`` (``AveragingConfig.exchange_budget``, default :data:`DEFAULT_EXCHANGE_BUDGET`) times a part's:
with ``k`` (SparseLoCo's ``topk_k``, or the PULSE budget) ``ceil(factor k n / chunk**2)`` of a tile's ``n`` real
entries, the rule of each peer's selection (:func:`pulseloco.loco.quantize.tile_topk_mask`) scaled, so the aggregate
is about ``factor`` parts; without ``k`` (the PULSE gate, whose parts vary in size) ``factor`` times the mean number
of entries the accepted parts have in that tile, rounded up; at most the tile. A tile cut by a shard boundary is
budgeted by each owner for the entries of it that its shard holds (:meth:`TileMap.numel_in`), so the two owners of
a cut tile keep together at most one entry more than its budget. Ties in magnitude go to the earlier entry, so every
owner given the same parts keeps the same entries.

Failure behaviour: pure functions of their arguments; :func:`reduce_parts` raises :class:`ValueError` for a
``mean_over`` or ``value_dtype`` it does not know (a caller bug), never because of the parts' values (the owner
validated them, :mod:`pulseloco.loco.validation`). :func:`check_budget` raises :class:`PayloadError` for an aggregate
that keeps more entries in a tile than the budget allows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pulseloco.errors import PayloadError
from pulseloco.loco.quantize import ParamLayout, quantize_lut
from pulseloco.loco.robust import clip_split
from pulseloco.loco.validation import WIRE_FORMATS, lut_groups

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_EXCHANGE_BUDGET",
    "MAX_EXCHANGE_BUDGET",
    "ReduceSpec",
    "Reduced",
    "TileMap",
    "check_budget",
    "combine_parts",
    "local_group_starts",
    "reduce_parts",
]

DEFAULT_EXCHANGE_BUDGET = 2.0
"""The aggregate's budget per tile as a multiple of one part's (``AveragingConfig.exchange_budget``). With 1 (an
aggregate as large as one part, Ok-Topk's rule) SparseLoCo at 4 workers applied a third of the union of the parts a
round and learned less than with ``gather`` (docs/results.md, "Trainer exchange at scale"); 2 applies about two
thirds there and sends about ``3 (R - 1)/R`` payloads each way, under ``gather``'s ``R - 1`` from 4 peers on."""
MAX_EXCHANGE_BUDGET = 4096.0
"""The largest budget multiple accepted (a 64 x 64 tile has 4096 entries: above, every entry is kept)."""


@dataclass(frozen=True)
class ReduceSpec:
    """How an owner reduces its shard with the ``topk`` exchange: the parameters' ``layout``, the tile side
    ``chunk``, a part's budget ``k`` per full tile (None: the parts' mean count per tile), the aggregate's budget as
    a multiple ``factor`` of a part's, the wire precision ``value_dtype`` of the kept values and, for
    ``"quantized"``, their ``bits``. Raises :class:`ValueError` for values out of range (a caller bug)."""

    layout: ParamLayout
    chunk: int = 64
    k: int | None = None
    value_dtype: str = "float32"
    bits: int = 2
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.value_dtype not in WIRE_FORMATS:
            raise ValueError(f"value_dtype must be one of {', '.join(WIRE_FORMATS)}, got {self.value_dtype!r}")
        if (
            self.chunk < 1
            or (self.k is not None and self.k < 1)
            or not 1 <= self.bits <= 8
            or not 0.0 < self.factor <= MAX_EXCHANGE_BUDGET
        ):
            raise ValueError(f"bad reduce spec: chunk {self.chunk}, k {self.k}, bits {self.bits}, factor {self.factor}")

    def gathers_less(self, group_size: int) -> bool:
        """Whether ``gather`` sends no more than this ``topk`` in a group of ``group_size``: a worker sends about
        ``(R - 1)`` payloads with ``gather`` and ``(1 + factor) (R - 1)/R`` with ``topk``."""
        return group_size <= 1 + self.factor


@dataclass(frozen=True)
class Reduced:
    """An owner's reduced shard: the kept local ``indices_K`` (sorted), the FP32 ``values_K`` sent there (exact in
    the wire precision; a sum, or SparseLoCo's mean over senders), the local lut ``group_starts`` to encode them
    with, the owner's rounding error ``absorbed_K`` at ``indices_K`` (aggregate minus sent), and the size of the
    parts' union ``num_union``."""

    indices_K: torch.Tensor
    values_K: torch.Tensor
    group_starts: torch.Tensor
    absorbed_K: torch.Tensor
    num_union: int


class TileMap:
    """Tile of every flat index of a :class:`ParamLayout` cut into ``chunk x chunk`` tiles (rows of ``chunk`` for
    1-D parameters), numbered across parameters, with each tile's number of real entries."""

    def __init__(self, layout: ParamLayout, chunk: int) -> None:
        self.chunk = chunk
        self.starts = torch.tensor(layout.starts, dtype=torch.int64)
        rows = torch.tensor([r for r, _ in layout.shapes], dtype=torch.int64)
        cols = torch.tensor([c for _, c in layout.shapes], dtype=torch.int64)
        self.rows, self.cols = rows, cols.clamp(min=1)
        self.tile_cols = (cols + chunk - 1) // chunk
        tiles = ((rows + chunk - 1) // chunk) * self.tile_cols
        self.tile_offsets = torch.cumsum(tiles, 0) - tiles

    def tiles(self, indices_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For sorted global ``indices_K``: each one's tile id and that tile's number of real entries."""
        param = torch.searchsorted(self.starts, indices_K, right=True) - 1
        local = indices_K - self.starts[param]
        cols = self.cols[param]
        row, col = local // cols, local % cols
        tile_row, tile_col = row // self.chunk, col // self.chunk
        tile = self.tile_offsets[param] + tile_row * self.tile_cols[param] + tile_col
        in_rows = (self.rows[param] - tile_row * self.chunk).clamp(max=self.chunk)
        in_cols = (cols - tile_col * self.chunk).clamp(max=self.chunk)
        return tile, in_rows * in_cols

    def numel_in(self, tile_K: torch.Tensor, tile_numel_K: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """For the tiles ``tile_K`` (of entries in ``[start, end)``, with their real sizes ``tile_numel_K``): how
        many entries of each lie in ``[start, end)``. Only the tile rows that hold ``start`` and ``end`` are cut;
        their entries outside the range are counted and taken off."""
        outside = [self._row_before(start), self._row_after(end)]
        ranges = [torch.arange(lo, hi, dtype=torch.int64) for lo, hi in outside if hi > lo]
        if not ranges:
            return tile_numel_K
        outside_K = torch.cat(ranges)
        out_tile, _ = self.tiles(outside_K)
        cut, cut_counts = torch.unique(out_tile, return_counts=True)
        where = torch.searchsorted(cut, tile_K).clamp(max=cut.numel() - 1)
        return tile_numel_K - torch.where(cut[where] == tile_K, cut_counts[where], 0)

    def _tile_row(self, index: int) -> tuple[int, int]:
        """The flat range ``[first, last)`` of the tile row (``chunk`` rows of one parameter) holding ``index``;
        in a one-row parameter (a vector) only ``index``'s own tile, its tiles being ``chunk`` entries each."""
        param = int(torch.searchsorted(self.starts, torch.tensor(index), right=True)) - 1
        begin, cols, rows = int(self.starts[param]), int(self.cols[param]), int(self.rows[param])
        if rows == 1:
            first = begin + (index - begin) // self.chunk * self.chunk
            return first, min(begin + cols, first + self.chunk)
        first_row = (index - begin) // cols // self.chunk * self.chunk
        return begin + first_row * cols, begin + min(rows, first_row + self.chunk) * cols

    def _row_before(self, start: int) -> tuple[int, int]:
        """The entries of ``start``'s tile row before it (none where that tile row begins at ``start``)."""
        return (self._tile_row(start)[0], start) if start > 0 else (0, 0)

    def _row_after(self, end: int) -> tuple[int, int]:
        """The entries of the tile row of ``end - 1`` from ``end`` on (none where that row ends at ``end``)."""
        return (end, self._tile_row(end - 1)[1]) if end > 0 else (0, 0)


def _rank_in_tile(tile_K: torch.Tensor, magnitude_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The order that sorts entries by tile, then by falling magnitude, then by index (the input's order), and each
    entry's rank within its tile in that order."""
    by_magnitude = torch.sort(-magnitude_K, stable=True).indices
    order = by_magnitude[torch.sort(tile_K[by_magnitude], stable=True).indices]
    _, counts = torch.unique_consecutive(tile_K[order], return_counts=True)
    firsts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel()) - torch.repeat_interleave(firsts, counts)
    return order, rank


def _budget(spec: ReduceSpec, tile_K: torch.Tensor, tile_numel_K: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The budget of each entry's tile: ``ceil(factor k n / chunk**2)``, or without ``k`` ``factor`` times the
    parts' mean count there rounded up (``counts``: the parts' total count in the entry's tile, already divided);
    at most ``n``. In float64, the same operations on every peer."""
    if spec.k is not None:
        share = tile_numel_K.double() * (spec.factor * spec.k) / (spec.chunk * spec.chunk)
    else:
        share = counts.double() * spec.factor
    return torch.minimum(torch.ceil(share).to(torch.int64), tile_numel_K)


def _round_to_wire(
    spec: ReduceSpec, indices_K: torch.Tensor, values_K: torch.Tensor, group_starts: torch.Tensor
) -> torch.Tensor:
    """``values_K`` as the wire carries them: FP32 unchanged, BF16 rounded to nearest, or quantized per lut group."""
    if spec.value_dtype == "float32":
        return values_K.clone()
    if spec.value_dtype == "bfloat16":
        return values_K.to(torch.bfloat16).to(torch.float32)
    sizes = lut_groups(indices_K, group_starts)
    pieces = torch.split(values_K, list(sizes)) if sizes else []
    return torch.cat([quantize_lut(piece, spec.bits) for piece in pieces]) if pieces else values_K.clone()


def combine_parts(
    parts: list[tuple[tuple[torch.Tensor, torch.Tensor], float]], numel: int, mean_over: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The touched indices of a shard of ``numel`` entries and, there, the sum of the ``parts`` (each
    ``((indices, FP32 values), clip scale)``, clipped, added in the given order: sorted peer ids), divided entry by
    entry by the number of parts that sent it when ``mean_over`` is ``"senders"`` (``"peers"``: the plain sum, which
    the members divide by the number of parts). Every peer that combines the same parts in the same order gets the
    same bits."""
    sum_N = torch.zeros(numel, dtype=torch.float32)
    count_N = torch.zeros(numel, dtype=torch.int32)
    for (indices_K, values_K), scale in parts:
        kept_K, _ = clip_split(values_K, scale)
        sum_N[indices_K] += kept_K
        count_N[indices_K] += 1
    indices_K = torch.nonzero(count_N, as_tuple=False).reshape(-1)
    sum_K = sum_N[indices_K]
    if mean_over == "senders":
        sum_K = sum_K / count_N[indices_K].to(torch.float32)
    return indices_K, sum_K


def local_group_starts(layout: ParamLayout, start: int, numel: int) -> torch.Tensor:
    """The lut groups (parameters) of the shard ``[start, start + numel)`` as local starts, sorted and distinct."""
    starts = torch.tensor(layout.starts, dtype=torch.int64) - start
    return torch.unique(starts.clamp(min=0, max=max(0, numel - 1)))


def reduce_parts(
    parts: list[tuple[tuple[torch.Tensor, torch.Tensor], float]],
    *,
    start: int,
    numel: int,
    spec: ReduceSpec,
    mean_over: str,
) -> Reduced:
    """Reduce the accepted ``parts`` of the shard ``[start, start + numel)`` (each ``((local indices, FP32
    values), clip scale)``, in sorted peer-id order; :func:`combine_parts` sums them):
    keep the budget of the aggregate per tile (module docstring) and round it to the wire. Raises
    :class:`ValueError` for an unknown ``mean_over``."""
    if mean_over not in ("peers", "senders"):
        raise ValueError(f"mean_over must be peers or senders, got {mean_over!r}")
    group_starts = local_group_starts(spec.layout, start, numel)
    union_K, aggregate_K = combine_parts(parts, numel, mean_over)
    empty = torch.zeros(0, dtype=torch.int64)
    if union_K.numel() == 0:
        return Reduced(empty, torch.zeros(0), group_starts, torch.zeros(0), 0)
    tiles = TileMap(spec.layout, spec.chunk)
    tile_K, tile_numel_K = tiles.tiles(union_K + start)
    tile_numel_K = tiles.numel_in(tile_K, tile_numel_K, start, start + numel)
    counts = torch.zeros(0)
    if spec.k is None:  # the parts' mean count per tile, looked up for each union entry
        compact, inverse = torch.unique(tile_K, return_inverse=True)
        every_K = torch.cat([indices_K for (indices_K, _), _scale in parts]) + start  # one pass, not one per part
        every_tile, _ = tiles.tiles(every_K)
        total = torch.bincount(torch.searchsorted(compact, every_tile), minlength=compact.numel()).double()
        counts = (total / max(1, len(parts)))[inverse]
    order, rank = _rank_in_tile(tile_K, aggregate_K.abs())
    keep = rank < _budget(spec, tile_K, tile_numel_K, counts)[order]
    kept = torch.sort(order[keep]).values
    indices_K, exact_K = union_K[kept], aggregate_K[kept]
    values_K = _round_to_wire(spec, indices_K, exact_K, group_starts)
    return Reduced(indices_K, values_K, group_starts, exact_K - values_K, int(union_K.numel()))


def check_budget(spec: ReduceSpec, indices_K: torch.Tensor, start: int, numel: int) -> None:
    """Refuse an aggregate (kept local ``indices_K`` of the shard ``[start, start + numel)``) that keeps more
    entries in some tile than ``spec.k`` allows: raises :class:`PayloadError`. Without ``k`` only the codec's bounds
    apply."""
    if spec.k is None or indices_K.numel() == 0:
        return
    tiles = TileMap(spec.layout, spec.chunk)
    tile_K, tile_numel_K = tiles.tiles(indices_K + start)
    tile_numel_K = tiles.numel_in(tile_K, tile_numel_K, start, start + numel)
    tiles, inverse, counts = torch.unique(tile_K, return_inverse=True, return_counts=True)
    budget = _budget(spec, tile_K, tile_numel_K, torch.zeros(0))
    allowed = torch.zeros(tiles.numel(), dtype=torch.int64).scatter_(0, inverse, budget)
    over = counts > allowed
    if bool(over.any()):
        raise PayloadError(
            f"aggregate keeps more entries than the budget ({spec.factor:g} x k={spec.k} per {spec.chunk}x{spec.chunk} "
            "tile) in "
            f"{int(over.sum())} tile(s)"
        )
