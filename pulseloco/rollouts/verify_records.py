"""What the trainer's rollout check (:class:`~pulseloco.rollouts.verify.RolloutVerifier`) found: per lease
(:class:`LeaseCheck`, handed to the caller, which drops, regenerates or refuses by it) and over a run
(:class:`VerifyStats`, the rollout metrics' counters)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pulseloco.rollouts.tolerances import Tolerance

logger = logging.getLogger(__name__)

__all__ = ["LeaseCheck", "VerifyStats"]


@dataclass
class LeaseCheck:
    """What the checks found in one lease's completions (those of this batch)."""

    lease_id: str
    worker: str
    version: int
    compute_dtype: str
    tolerance: Tolerance | None = None
    completions: int = 0
    checked: int = 0
    mismatches: int = 0
    near: int = 0
    band_positions: list[int] = field(default_factory=list)
    band_near: list[int] = field(default_factory=list)
    worst_gap: float = 0.0
    logprob_error_sum: float = 0.0
    tokens: int = 0
    max_logprob_error: float = 0.0
    early_stops: int = 0
    shared: int = 0
    audited: int = 0
    unverifiable: bool = False
    evicted: bool = False
    """Unverifiable because the trainer held its version and let it go (:meth:`VersionStates.dropped
    <pulseloco.rollouts.version_states.VersionStates.dropped>`): generated again, not counted against the worker
    (its claim was authenticated when the reply came)."""
    invalid: str | None = None
    reason: str | None = None
    refuse: str | None = None
    probation: bool = False
    """Its worker was on probation when the lease came (:meth:`NearMissGuard.on_probation`)."""
    held_back: set[int] = field(default_factory=set)
    """On probation: the groups (indices in the call) with a near miss, to be generated again, not trained on."""

    @property
    def logprob_error(self) -> float:
        """Mean absolute difference between the worker's and the trainer's log-probabilities, per token."""
        return self.logprob_error_sum / max(self.tokens, 1)


@dataclass
class VerifyStats:
    """Counters over a run (what the metrics report): positions checked, near misses, leases checked and failed,
    seconds spent (``seconds``; of them in the model's forward passes, ``forward_seconds``, and in those of the
    shared checks with the trainer's current weights, ``first_forward_seconds``: the pass TRL's importance-sampling
    ratio would otherwise run), the largest honest gap and per-token log-probability error seen, the completions
    proven by the shared check (``shared_completions``), audited (``audited_completions``), the largest drift bound
    used (``drift``) and log-probability drift measured (``ratio_error``), how many of TRL's forward passes the
    checks' log-probabilities replaced (``shared_forwards``), and the workers the near-miss guard refused
    (``guard_refusals``)."""

    completions: int = 0
    positions: int = 0
    mismatches: int = 0
    near: int = 0
    leases: int = 0
    failed_leases: int = 0
    seconds: float = 0.0
    worst_passing_gap: float = 0.0
    worst_passing_logprob_error: float = 0.0
    unverifiable_leases: int = 0
    shared_completions: int = 0
    audited_completions: int = 0
    drift: float = 0.0
    ratio_error: float = 0.0
    shared_forwards: int = 0
    forward_seconds: float = 0.0
    first_forward_seconds: float = 0.0
    guard_refusals: int = 0
    probation_leases: int = 0
    probation_held_back: int = 0
    """Completions of groups held back on probation (a near miss in the group) and generated again."""
    last_failure: str | None = None
