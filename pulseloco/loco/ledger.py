"""Which contributions a theta contains, and how a peer's residual follows the theta it ends up with.

A round's sums count exactly the contributions on their owners' ``accepted`` lists, each at the scale its owner's
clip bar gives it (:mod:`pulseloco.loco.averaging`, :mod:`pulseloco.loco.robust`). A :class:`Ledger` keeps, for the
last ``keep_rounds`` rounds of the lineage of a peer's ``theta``, the group id and the accepted list and clip bar of
every shard (``None`` for a shard that was not applied). It travels with the state a peer serves, so a peer that
replaces its theta by a downloaded one also learns what that theta counted.

The peer also keeps its own recent contributions (``Pending``: the entries it sent, split by shard, its parts' norms,
and whether, and at which clip scale, it assumed each shard counted them; its scale under an adopted ledger's bar
follows from its part's norm, :func:`pulseloco.loco.robust.clip_scale`). :meth:`Ledger.reconcile` compares that
assumption with an adopted ledger and corrects the residual by exactly the difference: a part the adopted theta counted
but the peer had returned to its residual is taken out again (otherwise it would be sent, and counted, twice); a part
the peer thought counted but the adopted theta lacks goes back in (otherwise it would be lost); a part counted at a
scale goes in or out as the clipped part :func:`pulseloco.loco.robust.clip_split` gives. Corrections are additive, so
they hold even after the residual has changed in later rounds.

Invariant (docs/design.md, "Exactly-once contributions"): for every round in the ledger's window, each entry a
peer selected is either counted by the theta it holds, or in its residual, never both and never neither.
Rounds older than the window cannot be reconciled; that is logged (a peer that fell that far behind).
"""

from __future__ import annotations

import binascii
import logging
from base64 import b64decode, b64encode
from dataclasses import dataclass, field
from typing import Any

import torch

from pulseloco.codec.indices import IndexCode, decode_indices, encode_indices
from pulseloco.errors import PayloadError
from pulseloco.loco.robust import clip_scale, clip_split, parse_bar, part_norm
from pulseloco.loco.validation import CONTRIBUTION_NAME, decode_sparse

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KEEP_ROUNDS", "MAX_LEDGER_ROUNDS", "Ledger", "LedgerEntry", "Pending"]

DEFAULT_KEEP_ROUNDS = 8
"""Rounds of history kept (and served with the state) by default (``AveragingConfig.ledger_rounds``): how long two
lineages may diverge (or a peer fall behind) and still be reconciled exactly. The own contributions kept for it
cost what they cost on the wire (:class:`Pending`) per round of CPU memory."""

MAX_LEDGER_ROUNDS = 64
"""The most rounds a served ledger may hold (:meth:`Ledger.parse` refuses more)."""


@dataclass(frozen=True)
class LedgerEntry:
    """What one round applied to a theta: ``group`` is ``None`` when the round averaged nothing; ``bars``, when
    given, holds beside each accepted list the clip bar its owner reported (``None``, or none given: every part
    counted whole)."""

    group: str | None
    accepted: tuple[tuple[str, ...] | None, ...] = ()
    bars: tuple[float | None, ...] = ()
    kept: tuple[torch.Tensor | None, ...] = ()
    """Per shard served with the ``topk`` exchange, the global indices its owner kept (None elsewhere): a peer that
    never fetched that aggregate learns from them which of its entries the round counted."""

    def kept_in(self, shard: int) -> torch.Tensor | None:
        """The global indices ``shard``'s ``topk`` owner kept, or None (another exchange, or not recorded)."""
        return self.kept[shard] if shard < len(self.kept) else None

    def counted(self, group: str, shard: int, peer: str) -> bool:
        """Whether this round counted ``peer``'s part of ``shard`` in group ``group``."""
        if self.group != group or shard >= len(self.accepted):
            return False
        names = self.accepted[shard]
        return names is not None and peer in names

    def scale(self, group: str, shard: int, peer: str, norm: float) -> float | None:
        """The clip scale this round counted ``peer``'s part of ``shard`` in group ``group`` at (the part's
        :func:`~pulseloco.loco.robust.part_norm` is ``norm``), or ``None`` if it did not count it."""
        if not self.counted(group, shard, peer):
            return None
        return clip_scale(norm, self.bars[shard] if shard < len(self.bars) else None)

    def same_round(self, other: LedgerEntry) -> bool:
        """Whether ``other`` records the same round of the same lineage (the same group, accepting the same)."""
        return self.group == other.group and self.accepted == other.accepted

    def to_json(self, numel: int = 0) -> dict[str, Any]:
        """The JSON form; with ``numel`` (the flat space's size) the ``topk`` kept sets too, Rice-coded."""
        data: dict[str, Any] = {
            "group": self.group,
            "accepted": [None if a is None else list(a) for a in self.accepted],
            "bars": list(self.bars),
        }
        if numel and any(k is not None for k in self.kept):
            data["numel"] = numel
            data["kept"] = [None if k is None else _code_indices(k, numel) for k in self.kept]
        return data

    @classmethod
    def from_json(cls, data: Any) -> LedgerEntry:
        """Parse one entry received from a peer; raises :class:`PayloadError` for anything malformed."""
        if not isinstance(data, dict):
            raise PayloadError("ledger entry must be an object")
        group, accepted = data.get("group"), data.get("accepted", [])
        if group is not None and not isinstance(group, str):
            raise PayloadError("ledger group must be a string or null")
        if not isinstance(accepted, list) or len(accepted) > 4096:
            raise PayloadError("ledger accepted lists must be a list (at most 4096 shards)")
        shards: list[tuple[str, ...] | None] = []
        for names in accepted:
            if names is None:
                shards.append(None)
            elif isinstance(names, list) and len(names) <= 4096 and all(isinstance(n, str) for n in names):
                shards.append(tuple(names))
            else:
                raise PayloadError("ledger accepted list must be a list of peer ids or null")
        if "scales" in data:
            raise PayloadError(
                "ledger entry lists clip scales per contributor (a release before the clip bar): every peer of a run "
                "needs the same pulseloco release"
            )
        bars = data.get("bars", [])
        if not isinstance(bars, list) or len(bars) not in (0, len(shards)):
            raise PayloadError("ledger bars must be a list with one entry per shard")
        shard_bars: list[float | None] = []
        for names, value in zip(shards, bars):
            if names is None and value is not None:
                raise PayloadError("ledger clip bar given for a shard that was not applied")
            shard_bars.append(parse_bar(value, "ledger entry"))
        kept = data.get("kept", [])
        numel = data.get("numel", 0)
        if not isinstance(kept, list) or len(kept) not in (0, len(shards)):
            raise PayloadError("ledger kept sets must be a list with one entry per shard")
        if kept and (isinstance(numel, bool) or not isinstance(numel, int) or not 0 < numel <= 2**40):
            raise PayloadError("ledger kept sets need the flat space's numel")
        shard_kept = tuple(None if k is None else _decode_indices(k, numel) for k in kept)
        return cls(group, tuple(shards), tuple(shard_bars), shard_kept)


def _code_indices(indices_K: torch.Tensor, numel: int) -> dict[str, Any]:
    """Sorted global indices as JSON: their count and the codec's index code (Rice or bitmask), base64."""
    code = encode_indices(indices_K.numpy(), numel)
    return {"count": int(indices_K.numel()), "method": code.method, "k": code.k, "data": b64encode(code.data).decode()}


def _decode_indices(data: Any, numel: int) -> torch.Tensor:
    """The inverse of :func:`_code_indices`, validating everything (:class:`PayloadError`)."""
    if not isinstance(data, dict):
        raise PayloadError("ledger kept set must be an object")
    count, method, k, raw = data.get("count"), data.get("method"), data.get("k"), data.get("data")
    if not (isinstance(count, int) and isinstance(method, str) and isinstance(k, int) and isinstance(raw, str)):
        raise PayloadError("ledger kept set needs count, method, k and data")
    if not 0 <= count <= numel:
        raise PayloadError(f"ledger kept set of {count} indices in {numel} entries")
    try:
        indices = decode_indices(IndexCode(method, k, b64decode(raw, validate=True)), count, numel)
    except (ValueError, binascii.Error) as exc:
        raise PayloadError(f"ledger kept set does not decode: {exc}") from None
    return torch.from_numpy(indices)


@dataclass
class Pending:
    """This peer's contribution in one round, kept as it went on the wire: its encoded ``parts``, one contribution
    frame per shard (:func:`~pulseloco.loco.validation.encode_parts`: local indices into ``bounds[j]``), whether it
    assumed each shard counted its part, and at which clip scale (``scales``; ``None``: 1 everywhere).

    The frames are the ones the exchange already built (no copy): a sent entry costs what it cost on the wire (4
    bytes and a compressed index for an FP32 value, less for BF16 or quantized ones) for each round of the window,
    instead of 12 bytes of index and value tensors. :meth:`part` decodes one shard when a reconcile needs it."""

    group: str
    parts: list[bytes]
    bounds: list[tuple[int, int]]
    counted: list[bool]
    scales: list[float] | None = None
    kept: list[torch.Tensor | None] = field(default_factory=list)
    """Per shard, the global indices a ``topk`` owner kept (None: the whole part): of the part, only the entries it
    kept are pending; the others went back to the residual for good, as no lineage counted them."""
    kept_unknown: set[int] = field(default_factory=set)
    """Shards served with the ``topk`` exchange whose aggregate this peer did not fetch: which of its entries there
    the owner kept is unknown, so a state that counted them cannot be reconciled exactly (logged)."""
    absorbed: tuple[int, torch.Tensor, torch.Tensor] | None = None
    """As a ``topk`` owner: its shard, and the global indices and values of the aggregate's rounding error; they
    belong in its residual exactly when the theta this peer holds applied that shard in this group."""
    absorbed_counted: bool = True
    """Whether the residual holds the rounding error now (this peer applied its own shard, or a reconcile moved the
    error in since)."""
    norms: list[float] = field(default_factory=list)
    """Per shard, the :func:`~pulseloco.loco.robust.part_norm` of the part as it was sent (before a ``topk`` owner
    dropped any of it), from which an adopted ledger's clip bar gives the scale; none given: taken from the parts
    when the contribution is recorded."""

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.parts) or len(self.counted) != len(self.parts):
            raise ValueError(f"{len(self.parts)} parts need as many shard bounds and counted flags")
        if not self.kept:
            self.kept = [None] * len(self.parts)
        if not self.norms:  # now, before any kept set narrows the parts
            self.norms = [part_norm(self.part(j)[1]) for j in range(len(self.parts))]

    def part(self, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending entries of ``shard``: sorted global indices and FP32 values (decoded from the frame this
        peer built and sent; only those its owner kept when :attr:`kept` names them). Raises
        :class:`~pulseloco.errors.PayloadError` for a frame that does not decode (non-finite values, bad indices:
        a part every owner refused too)."""
        start, stop = self.bounds[shard]
        local_K, values_K = decode_sparse(self.parts[shard], CONTRIBUTION_NAME, stop - start)
        indices_K = local_K + start
        kept = self.kept[shard]
        if kept is not None:
            inside = torch.isin(indices_K, kept)
            indices_K, values_K = indices_K[inside], values_K[inside]
        return indices_K, values_K

    def assumed(self, shard: int) -> float | None:
        """The scale this peer assumed ``shard`` counted its part at, ``None`` for not counted."""
        if not self.counted[shard]:
            return None
        return 1.0 if self.scales is None else self.scales[shard]


class Ledger:
    """The ledger of one peer's theta and its own pending contributions (see the module docstring)."""

    def __init__(self, peer_id: str, keep_rounds: int = DEFAULT_KEEP_ROUNDS) -> None:
        self.peer_id = peer_id
        self.keep_rounds = keep_rounds
        self.entries: dict[int, LedgerEntry] = {}
        self.pending: dict[int, Pending] = {}

    def record(self, round_index: int, entry: LedgerEntry, pending: Pending | None) -> None:
        """What this peer's own round ``round_index`` applied, and what it sent in it."""
        self.entries[round_index] = entry
        if pending is not None:
            self.pending[round_index] = pending
        for old in [r for r in self.entries if r <= round_index - self.keep_rounds]:
            del self.entries[old]
        for old in [r for r in self.pending if r <= round_index - self.keep_rounds]:
            del self.pending[old]

    def to_json(self) -> dict[str, Any]:
        """The entries, for the state this peer serves (JSON object keys are strings)."""
        return {str(r): e.to_json() for r, e in sorted(self.entries.items())}

    @staticmethod
    def parse(data: Any) -> dict[int, LedgerEntry]:
        """Entries received with a state; raises :class:`PayloadError` for anything malformed."""
        if not isinstance(data, dict) or len(data) > MAX_LEDGER_ROUNDS:
            raise PayloadError(f"ledger must be an object of at most {MAX_LEDGER_ROUNDS} rounds")
        entries = {}
        for key, value in data.items():
            try:
                round_index = int(key)
            except (TypeError, ValueError):
                raise PayloadError(f"ledger round {key!r} is not an integer") from None
            entries[round_index] = LedgerEntry.from_json(value)
        return entries

    @staticmethod
    def _reconcile_absorbed(pending: Pending, entry: LedgerEntry, residual_N: torch.Tensor) -> int:
        """Keep an owner's absorbed rounding error in ``residual_N`` exactly when ``entry`` (the adopted theta's
        round) applied that shard in the same group; returns the number of entries moved."""
        if pending.absorbed is None:
            return 0
        shard, indices_K, values_K = pending.absorbed
        applied = entry.group == pending.group and shard < len(entry.accepted) and entry.accepted[shard] is not None
        if applied == pending.absorbed_counted:
            return 0
        sign = 1.0 if applied else -1.0
        residual_N.index_add_(0, indices_K.to(residual_N.device), (sign * values_K).to(residual_N.device))
        pending.absorbed_counted = applied
        return int(indices_K.numel())

    @staticmethod
    def _decoded(round_index: int, pending: Pending, shard: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``pending.part(shard)``, or None (logged) when this peer's own frame does not decode: a part with
        non-finite values or bad indices, which every owner refuses with the same check, so no lineage counted it and
        the residual already holds it (nothing to correct)."""
        try:
            return pending.part(shard)
        except PayloadError as exc:
            logger.warning(
                "round=%d shard=%d: this peer's own part does not decode (%s); every owner refused it, so no state "
                "counted it and the residual is left as it is",
                round_index,
                shard,
                exc,
            )
            return None

    @staticmethod
    def _count_kept(
        round_index: int, pending: Pending, shard: int, entry: LedgerEntry, scale: float, residual_N: torch.Tensor
    ) -> int:
        """The adopted state counted this peer's part of a ``topk`` shard whose aggregate the peer never fetched:
        take the entries its owner kept (``entry.kept``) out of the residual at the counted ``scale``, and keep only
        those in ``pending`` (the others were never counted by any lineage). Without the kept set (an older peer's
        ledger) nothing can be corrected exactly: logged, the residual keeps them. Returns the entries moved."""
        kept = entry.kept_in(shard)
        if kept is None:
            logger.warning(
                "cannot reconcile round=%d shard=%d exactly: the adopted state counted this peer's part of a topk "
                "aggregate it never fetched and does not say which entries were kept (the residual keeps them)",
                round_index,
                shard,
            )
            return 0
        decoded = Ledger._decoded(round_index, pending, shard)
        if decoded is None:
            return 0
        indices_K, values_K = decoded
        inside = torch.isin(indices_K, kept)
        counted_K = clip_split(values_K[inside], scale)[0]
        residual_N.index_add_(0, indices_K[inside].to(residual_N.device), -counted_K.to(residual_N.device))
        pending.kept[shard] = kept  # the entries its owner did not keep were never counted by any lineage
        pending.counted[shard] = True
        pending.scales = pending.scales or [1.0] * len(pending.counted)
        pending.scales[shard] = scale
        pending.kept_unknown.discard(shard)
        return int(inside.sum())

    def reconcile(self, adopted: dict[int, LedgerEntry], state_round: int, residual_N: torch.Tensor) -> int:
        """Adopt the ledger of a downloaded state of round ``state_round`` (it holds rounds ``< state_round``)
        and correct ``residual_N`` in place for every pending round it covers. Returns the number of entries
        moved into or out of the residual; rounds it does not cover are logged and dropped. When the adopted lineage
        already differs from this peer's at the oldest round a full window holds, it left this peer's lineage at or
        before that round: what the peer sent earlier and its own lineage counted is in neither the adopted theta
        nor the residual (logged as a warning; ``AveragingConfig.ledger_rounds`` sets the window)."""
        oldest = min(self.entries, default=None)
        if (
            oldest is not None
            and len(self.entries) >= self.keep_rounds
            and oldest < state_round
            and oldest in adopted
            and not adopted[oldest].same_round(self.entries[oldest])
        ):
            logger.warning(
                "the adopted state's lineage left this peer's at or before round=%d, the oldest of the %d rounds the "
                "ledger keeps: what this peer sent before that round and its own lineage counted is lost with its "
                "theta (a split of more than %d rounds; AveragingConfig.ledger_rounds sets the window)",
                oldest,
                self.keep_rounds,
                self.keep_rounds,
            )
        moved = 0
        for round_index, pending in sorted(self.pending.items()):
            if round_index >= state_round:
                entry: LedgerEntry | None = LedgerEntry(None)  # the adopted theta predates this round
            else:
                entry = adopted.get(round_index)
            if entry is None:
                logger.warning(
                    "cannot reconcile round=%d: the adopted state's ledger does not reach back to it (the residual "
                    "keeps this peer's own view of that round: what its own lineage counted of it is lost if the "
                    "adopted one did not count it; AveragingConfig.ledger_rounds=%d sets the window)",
                    round_index,
                    self.keep_rounds,
                )
                continue
            moved += self._reconcile_absorbed(pending, entry, residual_N)
            for shard in range(len(pending.counted)):
                was, now = pending.assumed(shard), entry.scale(pending.group, shard, self.peer_id, pending.norms[shard])
                if now == was:
                    continue
                if shard in pending.kept_unknown and now is not None:
                    moved += self._count_kept(round_index, pending, shard, entry, now, residual_N)
                    continue
                decoded = self._decoded(round_index, pending, shard)
                if decoded is None:
                    continue
                indices_K, values_K = decoded
                # The residual holds values - counted(was); it must hold values - counted(now). Counted whole or
                # not at all, the correction is -values or +values; at a clip scale, what clip_split keeps.
                counted_was = torch.zeros_like(values_K) if was is None else clip_split(values_K, was)[0]
                counted_now = torch.zeros_like(values_K) if now is None else clip_split(values_K, now)[0]
                correction_K = counted_was - counted_now
                residual_N.index_add_(0, indices_K.to(residual_N.device), correction_K.to(residual_N.device))
                pending.counted[shard] = now is not None
                if pending.scales is not None or (now is not None and now != 1.0):
                    pending.scales = pending.scales or [1.0] * len(pending.counted)
                    pending.scales[shard] = 1.0 if now is None else now
                moved += int(indices_K.numel())
        self.entries = {r: e for r, e in adopted.items() if r < state_round}
        self.pending = {r: p for r, p in self.pending.items() if r < state_round}
        if moved:
            logger.info("residual reconciled with the adopted state round=%d entries=%d", state_round, moved)
        return moved
