"""Robust aggregation of a shard's contributions: each part clipped to the group's median norm, and peers that keep
sending outliers excluded.

PULSELoCo trainers are untrusted volunteers. The outlier screen (:func:`pulseloco.loco.validation.screen_outliers`)
rejects only gross outliers (above ``max_norm_ratio``, 10, times the others' median norm), so without more a peer
may send nearly ten times an honest norm in any direction it likes. A shard owner therefore also applies:

**Clip to the median** (templar's production rule, and SparseLoCo's as its authors run it). Of the parts that pass
the screen, each part ``x_p`` whose L2 norm exceeds the *bar* is scaled down to it: ``y_p = s_p x_p`` with
``s_p = min(1, bar / |x_p|)``. The bar is the median of the parts' norms when at least three parts remain; with
fewer there is no majority, and the bar is the norm of the owner's own part (the one part it can trust; the same
choice as the screen's), or nothing is clipped when the owner has no part there. A bar of zero (more than half the
parts empty) clips nothing either: no honest scale exists to clip to, and clipping a lone honest sender to zero
would hold its entries back for as long as the others stay silent there.

*What it bounds.* With fewer than half the parts Byzantine, at least one honest norm lies at or above the median
and at least one at or below it, so every part that reaches the sum is at most the largest honest norm in the
shard: one peer of ``R`` moves a round's average by at most ``bar / R`` in any direction, whatever it sends. A
sign-flipped pseudo-gradient at 9x the honest norm is clipped to one honest-sized vector: in a group of four
whose honest pseudo-gradients agree, the sum is ``3 g - g = 2 g`` instead of ``4 g`` (half the step, never a
reversal nor a stall); a fixed direction or noise at 9x adds one honest-sized vector that is not the gradient. It
does *not* bound an attacker that stays below the median but points against the consensus every round (it costs
the group one honest contribution per round, and is never excluded), nor an attacker that owns the shard (the
member-side screen of :mod:`pulseloco.loco.averaging` is the defence there).

*Exactly once.* What the owner clipped off is the sender's, not lost: the owner reports its bar in its sum's header (one
number, :func:`parse_bar` checks it on receipt), each sender derives its own scale from it and its own part
(:func:`clip_scale` of :func:`part_norm`), and puts ``x_p - y_p`` back into its error-feedback residual, so that
sent-and-counted plus residual equals the signal, element by element. The owner and the sender compute the same norm
from the same values on any hardware (:func:`part_norm`: exact squares summed exactly on a fixed-point grid), so they
reach the same scale without the owner listing one per contributor (which cost every peer ``O(R)`` bytes per owner,
``O(R^2)`` a round). :func:`clip_split` computes ``y_p`` and ``x_p - y_p`` with one FP32 rounding in a way both sides
reproduce bit for bit and whose two halves add up to ``x_p`` exactly (below). An honest peer that is clipped only delays
the clipped part by a round (error feedback sends it again).

**Exclusion of repeat outliers** (:class:`RepeatOutliers`). A part *strikes* when its norm is above
``dispute_norm_ratio`` (default 4) times the bar, when the screen rejects it, or when it is not a valid frame. A
peer with strikes in a majority of its last ``dispute_rounds`` (default 8) parts at this owner, that is 5 of 8, is
excluded from this owner's sums for the rest of the run: its parts are rejected with that reason (logged), and the
peer is published as *disputed* (it then neither votes nor serves state, :func:`pulseloco.loco.consensus.distrusted`).
The 9x attacks above strike every round and are excluded after five rounds. Each owner judges only the parts it
received (one owner's word never excludes a peer from another owner's shard), so a false accusation costs the
accused its contributions to one shard, and its vote and its role as a state source (the consensus rule's cost of
any accusation).

*Why 4 and a majority of 8.* Honest peers of one run draw their data from the same distribution, so their parts' norms
stay within a small factor of the median (the four honest peers of ``experiments/byzantine/bench_byzantine.py``: at most
2.9 times it in any shard and round, 95% of owner-rounds below 1.65; docs/results.md), while the 9x attacks sit at 8-10
times it. A single honest round above 4 (a peer whose residual holds two rounds after a failed one, a shard its data
happens to dominate) is one strike; a majority of eight is needed to exclude. The hazard that remains: an honest peer
whose pseudo-gradients are *systematically* larger than the others' and point the same way round after round (another
learning rate or batch size) is clipped every round, its clipped-off excess accumulates in its residual, and its norm
grows by about ``(rho - 1) x bar`` a round at ``rho`` times the median, so it can reach the strike ratio after ``(4 -
rho) / (rho - 1)`` rounds. Swarms of peers configured alike do not do this; ``dispute_rounds = 0`` turns exclusion off.

Exact split: for ``s >= 1/2``, ``y = fl(s x)`` lies in ``[x/2, x]``, so ``x - y`` is exact (Sterbenz); for ``s < 1/2``
the returned part ``r = fl(fl(1 - s) x)`` lies in ``[x/2, x]`` and ``y = x - r`` is exact, but ``y`` is then off
``s x`` by up to an ulp of ``x`` (2**-23 relative to ``x``, ``2**-23 / s`` relative to ``y``: 2e-6 at the smallest
scales the screen lets through, about 1/20). The bar is a double (exact in the JSON header) and a scale the FP32
rounding of ``bar / norm``, so the owner and the sender compute the same ``y`` from the same ``x``.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import threading
from typing import Any

import torch

from pulseloco.errors import PayloadError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_DISPUTE_NORM_RATIO",
    "DEFAULT_DISPUTE_ROUNDS",
    "RepeatOutliers",
    "clip_bar",
    "clip_scale",
    "clip_scales",
    "clip_split",
    "parse_bar",
    "part_norm",
    "to_float32",
]

DEFAULT_DISPUTE_NORM_RATIO = 4.0
"""A part above this many times its shard's clip bar strikes (see the module docstring for the choice)."""
DEFAULT_DISPUTE_ROUNDS = 8
"""Window of a peer's last parts at one owner; strikes in a majority of them exclude it (0: never exclude)."""
_MAX_TRACKED_PEERS = 4096
"""Peers whose history an owner keeps (the least recently seen is forgotten first; exclusions are kept)."""


def to_float32(value: float) -> float:
    """``value`` rounded to the nearest FP32 number (as a Python float)."""
    return float(torch.tensor(value, dtype=torch.float32))


def _is_float32(value: float) -> bool:
    return math.isfinite(value) and to_float32(value) == value


def clip_bar(norms: dict[str, float], own: str | None) -> tuple[float, str]:
    """The norm parts are clipped to, and what it is: the median of ``norms`` (L2 norms of the parts that passed
    the screen, by peer) when there are three or more, else the norm of ``own``'s part (the owner's), else 0
    (nothing is clipped)."""
    if len(norms) >= 3:
        return statistics.median(norms.values()), "the group median"
    if own is not None and own in norms:
        return norms[own], "the owner's own part"
    return 0.0, "no bar"


def part_norm(values_K: torch.Tensor) -> float:
    """The L2 norm of a part's values, the same on every machine and for any order of the values. A shard owner and
    the part's sender both compute it (:func:`clip_scale`), so no rounding in it may depend on a reduction's order
    (SIMD width, threads, the device). The squares are exact in float64 (an FP32 significand squared fits in 48
    bits); each is cut, element by element and exactly, into two integers on a fixed-point grid set by the
    largest (``b = 62 - bits(n)`` bits below it, and ``b`` more), and the integers are summed exactly. The result
    depends on the multiset of values alone; what the grid drops is below ``n 2**-(2 b)`` of the largest square
    (under 1e-10 of the norm up to a billion values). An infinite value gives ``inf``; no values, or all zero,
    0.0."""
    if values_K.numel() == 0:
        return 0.0
    squares = values_K.detach().to(torch.float64).square()
    top = float(squares.max())
    if top == 0.0 or not math.isfinite(top):
        return top
    bits = 62 - values_K.numel().bit_length()  # n integers below 2**bits each sum below 2**62
    shift = bits - math.frexp(top)[1]  # the largest square times 2**shift lies in [2**(bits - 1), 2**bits)
    scaled = squares * 2.0**shift  # exact: a power of two (but where it makes a tiny square subnormal)
    high = torch.trunc(scaled)
    low = torch.trunc((scaled - high) * 2.0**bits)  # the fraction, exact, on a grid 2**bits finer
    total = (int(high.to(torch.int64).sum()) << bits) + int(low.to(torch.int64).sum())
    return math.sqrt(math.ldexp(float(total), -(shift + bits)))


def clip_scale(norm: float, bar: float | None) -> float:
    """The scale a part of L2 ``norm`` (:func:`part_norm`) is counted at under clip ``bar``: ``min(1, bar /
    norm)`` rounded to FP32; 1.0 for no bar (``None``, clipping off) or a bar of 0 (nothing to clip to). A part too
    large for any positive FP32 scale gets 0 (an owner rejects it; a member refuses a sum that counted it)."""
    if bar is None or bar <= 0.0 or norm <= bar:
        return 1.0
    return min(1.0, to_float32(bar / norm))  # an infinite norm gives 0


def clip_scales(norms: dict[str, float], bar: float) -> dict[str, float]:
    """Every peer's :func:`clip_scale` at ``bar``."""
    return {peer: clip_scale(norm, bar) for peer, norm in norms.items()}


def clip_split(values_K: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept_K, clipped_K)`` of FP32 ``values_K`` at FP32 ``scale`` in ``[0, 1]``: ``kept_K`` is ``scale *
    values_K`` rounded once (for ``scale >= 1/2``; below, to within an ulp of each value), and ``kept_K +
    clipped_K == values_K`` exactly, element by element (module docstring). The owner sums ``kept_K``; the sender
    returns ``clipped_K`` to its residual.

    Raises :class:`ValueError` for a scale outside ``[0, 1]`` or not an FP32 number, or values not FP32."""
    if not (0.0 <= scale <= 1.0 and _is_float32(scale)):
        raise ValueError(f"scale must be an FP32 number in [0, 1], got {scale!r}")
    if values_K.dtype != torch.float32:
        raise ValueError(f"values must be FP32, got {values_K.dtype}")
    if scale == 1.0:
        return values_K, torch.zeros_like(values_K)
    scale_t = torch.tensor(scale, dtype=torch.float32, device=values_K.device)
    if scale >= 0.5:
        kept_K = values_K * scale_t
        return kept_K, values_K - kept_K
    clipped_K = values_K * (1.0 - scale_t)
    return values_K - clipped_K, clipped_K


def parse_bar(value: Any, what: str = "aggregate header") -> float | None:
    """A clip bar received in a served header or a ledger entry (``what`` names it in the error): ``None`` (absent
    or null: nothing clipped) or a finite number at least 0, as a float.

    Raises :class:`PayloadError` for anything else (a string, a boolean, a negative or non-finite number)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PayloadError(f"{what}'s clip bar is not a number: {value!r}")
    bar = float(value)
    if not (math.isfinite(bar) and bar >= 0.0):
        raise PayloadError(f"{what}'s clip bar is {bar!r}: it must be a finite number at least 0")
    return bar


class RepeatOutliers:
    """One owner's record of the parts it judged, per peer: whether each of the peer's last ``num_rounds`` parts
    struck, and the peers excluded (strikes in a majority of those rounds: ``num_rounds // 2 + 1``). Exclusion is
    for the life of this object; ``num_rounds = 0`` never excludes. Thread-safe (owners sum shards on executor
    threads)."""

    def __init__(self, num_rounds: int) -> None:
        if num_rounds < 0:
            raise ValueError(f"num_rounds must be at least 0, got {num_rounds}")
        self.num_rounds = num_rounds
        self._history: collections.OrderedDict[str, collections.deque[tuple[int, str | None]]] = (
            collections.OrderedDict()
        )
        self._excluded: dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def num_strikes(self) -> int:
        """Strikes within the window that exclude a peer."""
        return self.num_rounds // 2 + 1

    def exclusion(self, peer: str) -> str | None:
        """Why ``peer`` is excluded, or ``None`` if it is not."""
        with self._lock:
            return self._excluded.get(peer)

    def excluded(self) -> dict[str, str]:
        """Every excluded peer with its reason (a copy)."""
        with self._lock:
            return dict(self._excluded)

    def record(self, round_index: int, strikes: dict[str, str | None]) -> dict[str, str]:
        """Add one round's judgement: per peer, the reason its part struck, or ``None`` for a part that did not.
        Returns the peers this round excluded, with their reasons (the caller logs them)."""
        if self.num_rounds == 0:
            return {}
        newly: dict[str, str] = {}
        with self._lock:
            for peer, strike in strikes.items():
                if peer in self._excluded:
                    continue
                history = self._history.pop(peer, None) or collections.deque(maxlen=self.num_rounds)
                history.append((round_index, strike))
                self._history[peer] = history  # most recently seen last
                struck = [(r, reason) for r, reason in history if reason is not None]
                if len(struck) >= self.num_strikes:
                    last_reason = struck[-1][1]
                    self._excluded[peer] = newly[peer] = (
                        f"struck in {len(struck)} of its last {len(history)} rounds (rounds "
                        f"{', '.join(str(r) for r, _ in struck)}; last: {last_reason})"
                    )
                    del self._history[peer]
            while len(self._history) > _MAX_TRACKED_PEERS:
                self._history.popitem(last=False)
        return newly
