"""What the trainer's rollout check tolerates: the engines' measured numerical differences, and a guard on their rate.

A worker's sample passes the check when each of its tokens is the replayable sampler's choice
(:mod:`pulseloco.rollouts.sampling`) under the weights of the version it claims. The trainer replays that choice
in its own precision, the worker sampled in its engine's, and the two disagree by rounding: the worker's token may
trail the replay's perturbed argmax by a small *gap* (nats of ``logits / T`` plus noise), and its reported
log-probability may differ from the replay's by a small error. Both tolerances are an attacker's room as much as
an honest engine's (a worker may pick any token within the margin), so they are the measured numerical
differences, no wider, per precision (:data:`TOLERANCES`; ``scripts/bench_verify.py`` measures them).

Rounding flips a choice only where the replay's argmax leads its runner-up by little: the position's *spread*
(the argmax's perturbed score minus the runner-up's). The check sorts positions into bands of spread
(:attr:`Tolerance.bands`) and counts, per band, the positions and the *near misses* among them (a token that is not
the replay's argmax, within the margin). An honest engine's near misses per position fall steeply with the spread
(:attr:`Tolerance.rates`); a steering worker's do not, since it flips wherever the margin lets it and it likes the
runner-up. :class:`NearMissGuard` keeps these counts per worker across leases and refuses a worker whose count in
some band is far above what the band's honest rate allows: a one-sided test whose false-refusal probability over a
whole run is at most ``false_refusal`` for a worker whose engine keeps to the rates (see :meth:`NearMissGuard.add`).
The rates are per position of a band, so they depend on the engine's rounding and hardly on the model: a model whose
choices are often close has more positions in the narrow bands, not more near misses per position.

Measured (``scripts/bench_verify.py`` and the demo's runs, the demo model against an FP32 replay, 2 CPU cores):

- ``float32``: an engine computing in FP32 on the published BF16 weights. Transformers and vLLM, 20,000 positions
  each at temperature 1 (40,000 more for transformers): no position differs from the replay; log-probabilities
  agree to 1.6e-5. The margin (1e-3 nats) is 60 times that; no near miss was seen, so the rates are loose bounds.
- ``bfloat16`` (``float16`` is held to the same): an engine computing in BF16, or a trainer replaying in BF16.
  0.2-0.3% of positions are not the replay's argmax (transformers and vLLM on CPUs; transformers on an H200:
  0.24%); the largest gap 0.21 nats over 40,000 positions and 0.66 over the 198,000 of a whole demo run
  (transformers on a CPU), so the margin is 1 nat. Near misses per position by spread, transformers / vLLM at
  temperature 1 (30,400 positions each) and transformers at 0.7 (15,000; spreads in units of ``logits / T``):
  up to 0.01 nats 30% / 29% / 42%; 0.01-0.02 26% / 23% / 29%; 0.02-0.05 4.3% / 2.0% / 10%; 0.05-0.1 1.1% / 1.1% /
  0.5%; 0.1-1 nat 0 of 6,655 / 0 of 6,654 / 1 of 2,970. The rates are about twice the largest of these (2e-3 in
  the widest band, where one near miss in 2,970 was seen); log-probability errors up to 0.48 nats per token over
  40,000 positions and 0.94 over the 119,000 of a whole demo run with vLLM (the tolerance is 2 nats: the trainer
  uses its own log-probabilities, so this only checks the engine). 0.65% of positions have a spread below 0.02
  nats: there rounding decides, and so may a worker that keeps to these rates.

Errors are divided by the temperature with the logits, so below ``T = 1`` the margin, the band edges and the
log-probability tolerance are the table's divided by ``T`` (:meth:`Tolerance.at`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "PROBATION_EXCESS",
    "TOLERANCES",
    "NearMissGuard",
    "Tolerance",
    "poisson_tail",
    "precision_of",
    "probation_positions",
    "tolerance_for",
]

#: A worker leaves probation once the guard would refuse, at its next lease, one that makes this many times the
#: honest rate of near misses in the widest band of spread (where a token may trail the sampler's choice by most).
PROBATION_EXCESS = 10.0


@dataclass(frozen=True)
class Tolerance:
    """The numerical differences tolerated for one precision (module docstring), at temperature 1.

    ``margin``: the largest gap (nats) of any position; ``bands``: the upper edges of the spread bands (band ``i``
    holds the positions whose spread is above ``bands[i - 1]`` and at most ``bands[i]``; the last edge is the
    margin: a wider spread leaves no near miss within it); ``rates``: per band, a bound on the share of its
    positions where an honest engine's token is not the replay's argmax; ``logprob_error``: the largest difference
    (nats) between a worker's log-probability and the replay's, per token."""

    margin: float
    bands: tuple[float, ...]
    rates: tuple[float, ...]
    logprob_error: float

    def __post_init__(self) -> None:
        if len(self.bands) != len(self.rates) or not self.bands or list(self.bands) != sorted(self.bands):
            raise ValueError(f"bands must be increasing, one rate each: {self.bands}, {self.rates}")

    def at(self, temperature: float) -> Tolerance:
        """The tolerance at ``temperature``: gaps, spreads and errors grow as ``1 / T`` below 1 (rates do not)."""
        scale = 1.0 / min(temperature, 1.0)
        return Tolerance(
            self.margin * scale, tuple(b * scale for b in self.bands), self.rates, self.logprob_error * scale
        )

    def with_margin(self, margin: float) -> Tolerance:
        """The same with another margin (bands above it are cut at it)."""
        bands = [min(b, margin) for b in self.bands[:-1]] + [margin]
        return Tolerance(margin, tuple(bands), self.rates, self.logprob_error)


#: Per precision: what the check tolerates (module docstring for the measurements that set each number).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(margin=1e-3, bands=(1e-4, 1e-3), rates=(0.5, 0.05), logprob_error=1e-3),
    "bfloat16": Tolerance(
        margin=1.0, bands=(0.01, 0.02, 0.05, 0.1, 1.0), rates=(0.8, 0.6, 0.2, 0.03, 2e-3), logprob_error=2.0
    ),
}

_RANK = {"float32": 0, "float16": 1, "bfloat16": 2}


def precision_of(*dtypes: str | torch.dtype) -> str:
    """The coarsest of ``dtypes`` (a worker's compute dtype, the trainer's replay dtype) as a key of
    :data:`TOLERANCES`: ``float16`` is held to ``bfloat16``'s tolerances. ``ValueError`` for another dtype."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    unknown = [n for n in names if n not in _RANK]
    if unknown:
        raise ValueError(f"no tolerance is measured for {', '.join(unknown)} (known: {', '.join(_RANK)})")
    coarsest = max(names, key=_RANK.__getitem__)
    return "bfloat16" if coarsest == "float16" else coarsest


def tolerance_for(worker_dtype: str, replay_dtype: str | torch.dtype, temperature: float) -> Tolerance:
    """The tolerance of a check of a worker computing in ``worker_dtype`` replayed in ``replay_dtype``."""
    return TOLERANCES[precision_of(worker_dtype, replay_dtype)].at(temperature)


def poisson_tail(count: int, mean: float) -> float:
    """``P(X >= count)`` for ``X`` Poisson with ``mean``: the regularized lower incomplete gamma function
    ``P(count, mean)``. It bounds the same tail of any sum of independent Bernoulli variables with that mean when
    ``count >= mean + 1`` (Anderson and Samuels 1967), which is where the guard acts."""
    if count <= 0:
        return 1.0
    if mean <= 0.0:
        return 0.0
    count_t, mean_t = torch.tensor(float(count), dtype=torch.float64), torch.tensor(mean, dtype=torch.float64)
    return float(torch.special.gammainc(count_t, mean_t))


@functools.lru_cache(maxsize=64)
def probation_positions(tolerance: Tolerance, false_refusal: float) -> int:
    """The positions of the widest band of spread (``tolerance.bands[-1]``'s, where a steering worker has the most
    room) a worker's completions must have had checked before it leaves probation: the fewest ``n`` at which a
    worker with near misses at :data:`PROBATION_EXCESS` times that band's honest rate ``r`` (``ceil(x r n)`` of
    them) is refused by the guard's test at a first lease (tail below ``false_refusal / (2 B)``, the bar of
    :meth:`NearMissGuard.add` for ``L = 1``). At the default ``false_refusal`` 1e-6: BF16 (r = 2e-3) 451 positions,
    FP32 (r = 0.05) 19. Never raises."""
    rate = tolerance.rates[-1]
    if rate <= 0.0:  # no honest near miss there: the guard refuses the first one, so no probation is needed
        return 0
    share = min(1.0, PROBATION_EXCESS * rate)
    bar = false_refusal / (2 * len(tolerance.bands))
    n = 1
    while poisson_tail(math.ceil(share * n), rate * n) >= bar:
        n += 1
    return n


@dataclass
class _Record:
    positions: list[int]
    near: list[int]
    expected: list[float]


@dataclass
class NearMissGuard:
    """Counts each worker's near misses per band of spread across its leases and says when they are far above an
    honest engine's.

    After a worker's ``L``-th lease, the guard computes for each of the ``B`` bands the probability that an honest
    worker (a near miss at each position of the band independently, at most at the band's rate) shows at least the
    count seen, and refuses the worker when one is below ``false_refusal / (B L (L + 1))``. Summed over the bands and
    every lease of a run these thresholds are at most ``false_refusal``: the probability that an honest worker is
    ever refused by the guard. A worker that steers where the margin lets it is refused within a lease or two; one
    that keeps to the honest rates in every band steers no more than rounding flips choices. Counts are kept per
    worker and tolerance (precision and temperature), so that a worker that changes the precision it claims splits
    its counts, never resets them.

    Never raises for what a worker sent; the counts are the caller's (the check's) and must be non-negative.
    """

    false_refusal: float = 1e-6
    records: dict[tuple[str, Tolerance], _Record] = field(default_factory=dict)
    leases: dict[str, int] = field(default_factory=dict)

    def on_probation(self, worker: str, tolerance: Tolerance) -> bool:
        """Whether ``worker`` has had fewer positions of ``tolerance``'s widest band checked than
        :func:`probation_positions` asks (a new identity has had none; a worker that changes the precision it
        claims starts a record of its own, on probation again)."""
        record = self.records.get((worker, tolerance))
        seen = record.positions[-1] if record is not None else 0
        return seen < probation_positions(tolerance, self.false_refusal)

    def add(self, worker: str, positions: Sequence[int], near: Sequence[int], tolerance: Tolerance) -> str | None:
        """Count one lease of ``worker``: per band of ``tolerance``, its ``positions`` and the ``near`` misses among
        them. Returns the reason to refuse the worker, or None."""
        bands = len(tolerance.bands)
        record = self.records.setdefault((worker, tolerance), _Record([0] * bands, [0] * bands, [0.0] * bands))
        leases = self.leases[worker] = self.leases.get(worker, 0) + 1
        bar = self.false_refusal / (bands * leases * (leases + 1))
        for band in range(bands):
            record.positions[band] += positions[band]
            record.near[band] += near[band]
            record.expected[band] += positions[band] * tolerance.rates[band]
        for band in range(bands):
            seen, expected = record.near[band], record.expected[band]
            tail = poisson_tail(seen, expected)
            if seen >= expected + 1 and tail < bar:
                low = tolerance.bands[band - 1] if band else 0.0
                return (
                    f"tokens not the sampler's choice at {seen} of {record.positions[band]} positions whose runner-up "
                    f"trails by {low:.3g}-{tolerance.bands[band]:.3g} nats, over {leases} leases, where an honest "
                    f"engine's rounding makes about {expected:.1f} (chance {tail:.1e} < {bar:.1e})"
                )
        return None
