"""What the trainer's rollout check tolerates: the engines' measured numerical differences, and a guard on their rate.

A worker's sample passes the check when each of its tokens is the replayable sampler's choice
(:mod:`pulseloco.rollouts.sampling`) under the weights of the version it claims. The trainer replays that choice
in its own precision, the worker sampled in its engine's, and the two disagree by rounding: the worker's token may
trail the replay's perturbed argmax by a small *gap* (nats of ``logits / T`` plus noise), and its reported
log-probability may differ from the replay's by a small error. Both tolerances are an attacker's room as much as
an honest engine's (a worker may pick any token within the margin), so they are the measured numerical
differences, no wider, per precision (:data:`TOLERANCES`; ``scripts/bench_verify.py`` measures them):

- ``float32``: an engine computing in FP32 on the published BF16 weights, replayed in FP32. Measured on 2 CPU
  cores with the demo model (transformers, 40,303 positions at temperature 1): no position differs from the
  replay, log-probabilities agree to 1.6e-5. The margin (1e-3 nats) is 60 times that; a near miss is never seen,
  so the rates are loose bounds (half the contested positions, and 1 in 1,000).
- ``bfloat16`` (and ``float16``, held to the same): an engine computing in BF16, or a trainer replaying in BF16.
  Measured with the demo model at temperature 1 against an FP32 replay: 0.22-0.26% of positions are not the
  replay's argmax (transformers and vLLM on 2 CPU cores, 40,000 positions each; transformers on an H200, 0.24%);
  the largest gap 0.21 nats there and 0.66 nats over the 198,000 positions of a whole demo run (transformers on a
  CPU), so the margin is 1 nat; 2.9% of positions are contested within 0.1 nats, and 6-8% of those are near misses
  (``core_rate`` 0.15); 25% have a runner-up within the margin, and none of those 5,058 had a near miss beyond
  0.1 nats (one in about 10,000 over 40,000 positions; ``wide_rate`` 1e-3); log-probability errors up to 0.48
  nats per token (the margin for them is 1 nat).

A precision's ``margin`` bounds the gap of any one position (beyond it the lease fails); the positions where the
token is not the argmax but within the margin (*near misses*) are an honest engine's at the rate its rounding
flips close choices, and a steering worker's wherever it steers. :class:`NearMissGuard` counts them per worker
across leases, in two bands of gap (``core``: the bulk of rounding's, up to ``core_gap``; ``wide``: beyond it, up
to the margin, rare for an honest engine), and refuses a worker whose count in a band is far above what the band's
honest rate allows: a one-sided test whose false-refusal probability over a whole run is at most
``false_refusal`` for a worker whose engine keeps to the rates (see :meth:`NearMissGuard.add`).

Errors are divided by the temperature with the logits, so a margin at temperature ``T < 1`` is the table's
divided by ``T`` (:meth:`Tolerance.at`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

__all__ = ["TOLERANCES", "NearMissGuard", "Tolerance", "precision_of", "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    """The numerical differences tolerated for one precision (module docstring), at temperature 1.

    ``margin``: the largest gap (nats) of any position; ``core_gap``: the gap below which an honest engine's near
    misses mostly fall; ``core_rate``: a bound on an honest engine's near misses with a gap up to ``core_gap``, as a
    share of the *contested* positions (where the replay's runner-up trails the argmax by at most ``core_gap``: the
    only places such a near miss can happen); ``wide_rate``: the same for near misses with a gap above
    ``core_gap`` (up to the margin), as a share of the positions whose runner-up is within the margin;
    ``logprob_error``: the largest difference (nats) between a worker's log-probability and the replay's, per
    token. Rates per contested position depend on the engine's rounding, hardly on the model: a model whose
    choices are often close has more contested positions, not more near misses per contested one."""

    margin: float
    core_gap: float
    core_rate: float
    wide_rate: float
    logprob_error: float

    def at(self, temperature: float) -> Tolerance:
        """The tolerance at ``temperature``: gaps and errors grow as ``1 / T`` below 1 (rates do not)."""
        scale = 1.0 / min(temperature, 1.0)
        return Tolerance(
            self.margin * scale, self.core_gap * scale, self.core_rate, self.wide_rate, self.logprob_error * scale
        )


#: Per precision: what the check tolerates (module docstring for the measurements that set each number).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(margin=1e-3, core_gap=1e-4, core_rate=0.5, wide_rate=1e-3, logprob_error=1e-3),
    "bfloat16": Tolerance(margin=1.0, core_gap=0.1, core_rate=0.15, wide_rate=1e-3, logprob_error=1.0),
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
    return float(
        torch.special.gammainc(torch.tensor(float(count), dtype=torch.float64), torch.tensor(mean, dtype=torch.float64))
    )


@dataclass
class _Record:
    leases: int = 0
    contested: int = 0
    core: int = 0
    contested_wide: int = 0
    wide: int = 0
    core_expected: float = 0.0
    wide_expected: float = 0.0


@dataclass
class NearMissGuard:
    """Counts each worker's near misses across its leases and says when their rate is far above an honest one.

    After a worker's ``L``-th lease, the guard computes for each band the probability that an honest worker
    (near misses at most at the band's rate of its tolerances, each position independently) shows at least the
    count seen, and refuses the worker when either is below ``false_refusal / (2 L (L + 1))``. Summed over both
    bands and every lease of a run these thresholds are at most ``false_refusal``: the probability that an honest
    worker is ever refused by the guard. A worker that steers at a share of positions well above the honest rate
    is refused within a few leases; one that stays at the honest rate steers no more than rounding flips choices.

    Never raises for what a worker sent; the counts are the caller's (the check's) and must be non-negative.
    """

    false_refusal: float = 1e-6
    records: dict[str, _Record] = field(default_factory=dict)

    def add(
        self, worker: str, contested: int, core: int, contested_wide: int, wide: int, tolerance: Tolerance
    ) -> str | None:
        """Count one lease of ``worker``: ``core`` near misses with a gap up to ``tolerance.core_gap`` at its
        ``contested`` positions, ``wide`` near misses above it at its ``contested_wide`` positions (runner-up
        within the margin). Returns the reason to refuse the worker, or None."""
        record = self.records.setdefault(worker, _Record())
        record.leases += 1
        record.contested += contested
        record.core += core
        record.contested_wide += contested_wide
        record.wide += wide
        record.core_expected += contested * tolerance.core_rate
        record.wide_expected += contested_wide * tolerance.wide_rate
        leases = record.leases
        bar = self.false_refusal / (2 * leases * (leases + 1))
        for band, seen, expected, among in (
            ("within", record.core, record.core_expected, record.contested),
            ("beyond", record.wide, record.wide_expected, record.contested_wide),
        ):
            tail = poisson_tail(seen, expected)
            if seen >= expected + 1 and tail < bar:
                return (
                    f"tokens not the sampler's choice, {band} {tolerance.core_gap:.3g} nats of it, at {seen} of "
                    f"{among} contested positions over {leases} leases, where an honest engine's rounding makes "
                    f"about {expected:.1f} (chance {tail:.1e} < {bar:.1e})"
                )
        return None

    def counts(self, worker: str) -> tuple[int, int, int, int]:
        """``(contested, core near misses, contested_wide, wide near misses)`` counted for ``worker`` so far."""
        r = self.records.get(worker, _Record())
        return r.contested, r.core, r.contested_wide, r.wide
