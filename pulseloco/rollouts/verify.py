"""The trainer's check of a rollout worker's completions, before any of them reaches the loss.

A worker that holds the weights could return any completion with any log-probabilities: cherry-pick the best of
many samples, generate with other weights, write a chosen text that earns the reward, or pick, at each position,
whichever token close to the sampler's choice serves it. Every completion is sampled by a replayable rule
(:mod:`pulseloco.rollouts.sampling`): at each position the token is the argmax of ``logits / T`` plus Gumbel noise
keyed by the lease's seed, the completion's index and the position. :class:`RolloutVerifier` proves, for every
completion, that each token is that choice **under the weights of the version the lease claims**
(:class:`VersionStates` holds the published versions), within the measured numerical differences of the worker's
and the trainer's precision (:mod:`pulseloco.rollouts.tolerances`), in one of two ways:

- **the version's check**: a forward pass of the version's weights over the completion; every position must trail
  the perturbed argmax by at most the precision's margin; its near misses (not the argmax, within the margin) are
  counted per worker by a :class:`~pulseloco.rollouts.tolerances.NearMissGuard`, which refuses a worker whose
  near misses are far more frequent than its precision's rounding makes them;
- **the shared check** (``verify_weights="shared"``, the default): the forward pass of the trainer's *current*
  weights, which TRL's importance-sampling ratio needs anyway (its log-probabilities are handed to TRL,
  :meth:`RolloutVerifier.shared_logps`). A completion passes there when at every position the worker's token is
  the perturbed argmax under the current weights by a lead larger than the *drift* bound ``D`` of its version:
  :data:`DRIFT_SAFETY` times the most lead the current weights' perturbed argmax loses under the version's
  weights at any position of a random sample of the round's completions (the *audit*: the completions of a share
  ``verify_audit`` of the prompts, at least one prompt per version, which take the version's check). Why it
  holds: a token that wins under the current weights by more than the drift takes away from any lead keeps
  winning under the version's. ``D`` is measured, not proven: the audit is drawn by the trainer (keyed by its
  seed, the lease seed and the prompt, so the same group is audited whichever lease brings it), and a worker
  cannot aim at a position where the drift exceeds it without the trainer's unpublished weights. Every other
  completion takes the version's check.

The log-probabilities TRL's importance-sampling ratio divides by are the trainer's own, never the worker's: the
version's (those of the version's check) or, for a completion proven by the shared check, the current weights'
(the ratio is then 1: the sample is the current weights' choice too). That is exact only to the trainer's own drift
since the version, so the audit also measures it (the largest difference between the current and the version's
log-probabilities of the audited tokens): above ``verify_ratio_error`` the shared check proves nothing of that
version in that call. The worker's log-probabilities are still held to its precision's tolerance per token as a
check of the engine (in the shared check, to that plus ``D``, else the completion takes the version's check). A
completion shorter than ``max_new_tokens`` must end with an end-of-sequence token.

A lease fails when a completion has a position beyond the margin, a token outside the model's vocabulary, a
log-probability off by more than the tolerance or not finite, or stops early. The caller
(:func:`pulseloco.integrations.settle.settle`) drops every group of a failed lease, has other workers generate
them again, and reports the failure (:meth:`pulseloco.rollouts.client.RolloutClient.report_check_failure`), which
refuses the worker after a few; a worker the guard refuses is refused at once. A lease claiming a version the
trainer does not hold is *unverifiable* (generated again); beyond :data:`UNVERIFIABLE_ALLOWANCE` such leases (plus
one in ten of its verified ones) each counts as a failed lease.

Failure behaviour: nothing a worker sent raises here (a completion longer than the model's context, or with token
ids the model does not have, fails its lease); :meth:`RolloutVerifier.check` without :class:`VersionStates`
raises :class:`ConfigError`; errors of the trainer's own model propagate.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from pulseloco.errors import ConfigError
from pulseloco.rollouts.client import GroupResult
from pulseloco.rollouts.replay import Checked, PinnedWeights, Row, replay
from pulseloco.rollouts.sampling import CheckResult
from pulseloco.rollouts.tolerances import NearMissGuard, Tolerance, tolerance_for
from pulseloco.rollouts.verify_config import VerifyConfig
from pulseloco.rollouts.verify_records import LeaseCheck, VerifyStats
from pulseloco.rollouts.version_states import VersionStates

logger = logging.getLogger(__name__)

__all__ = ["DRIFT_SAFETY", "RolloutVerifier", "stop_ids"]

#: The drift bound of the shared check is this many times the largest drift its audit measured.
DRIFT_SAFETY = 2.0
#: Unverifiable leases a worker may have before each further one counts as a failed lease (plus one per ten
#: verified leases: an honest worker's lease is unverifiable when the trainer has not fetched its version yet).
UNVERIFIABLE_ALLOWANCE = 3


@dataclass
class _Outcome:
    """How one row was decided: its check's result (``shared``: by the shared check), the trainer's log-probabilities
    of its tokens that TRL's ratio divides by (``sampling``) and, in the shared mode, those of the current weights
    (``current``, TRL's old log-probabilities)."""

    result: CheckResult
    sampling: list[float]
    shared: bool = False
    audited: bool = False
    current: list[float] | None = None


class RolloutVerifier:
    """Checks the completions of rollout workers with the trainer's model (see the module docstring).

    Args:
        config: the settings (:class:`VerifyConfig`; default its defaults).
        seed: keys the audit's draw (with the completions' seeds and sequences; :attr:`audit_seed`, which
            :class:`~pulseloco.integrations.swarm_rollouts.SwarmRollouts` sets to the trainer's seed when None, so
            that a run is reproducible); None: a random key. A worker that knows it can tell which completions are
            audited, which lets it pass nothing the check would refuse: every completion is proven either way.
        record_gaps: keep every gap the version's check computes in :attr:`gaps` (to measure the margins).
        states: the published versions' weights (:class:`VersionStates`); required by :meth:`check`.
        states_wait: seconds to wait for a claimed version to be held before the lease is unverifiable.
    """

    def __init__(
        self,
        config: VerifyConfig | None = None,
        *,
        seed: int | None = None,
        record_gaps: bool = False,
        states: VersionStates | None = None,
        states_wait: float = 5.0,
    ) -> None:
        config = self.config = config or VerifyConfig()
        self.weights = config.verify_weights
        self.guard = NearMissGuard(config.verify_false_refusal)
        self.stats = VerifyStats()
        self.gaps: list[float] | None = [] if record_gaps else None
        self.states = states
        self.states_wait = states_wait
        self.audit_seed = seed
        self._random_key = os.urandom(16).hex()
        self._shared: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = {}
        self._sampling: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = {}
        self._decided: dict[tuple[tuple[int, ...], tuple[int, ...]], str] = {}
        self._unverifiable: dict[str, int] = {}
        self._verified: dict[str, int] = {}
        self._pinned = PinnedWeights()
        self._last_lost = 0.0

    # ---- the check ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def check(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        results: Sequence[GroupResult],
        *,
        temperature: float,
        max_new_tokens: int,
        stop_ids: set[int],
    ) -> dict[str, LeaseCheck]:
        """Check ``results[g]`` (the completions of prompt ``prompts[g]``) with ``model`` (the trainer's current
        weights) and the weights of the versions they claim; returns one :class:`LeaseCheck` per lease, whose
        ``reason`` is set when the lease fails (and ``refuse`` when its worker is to be refused at once). Keeps the
        trainer's log-probabilities of every completion that passed (:meth:`sampling_logps`, :meth:`shared_logps`).
        Raises :class:`ConfigError` without :attr:`states`."""
        started = time.perf_counter()
        leases, rows, states = self._leases_and_rows(model, prompts, results, temperature, max_new_tokens, stop_ids)
        outcomes = self._evaluate(model, rows, leases, states, temperature)
        for row, outcome in zip(rows, outcomes):
            self._add(leases[row.lease_id], outcome, len(row.ids))
        for lease in leases.values():  # before this lease's counts reach the guard
            tolerance = lease.tolerance
            lease.probation = bool(
                self.config.verify_probation and tolerance and self.guard.on_probation(lease.worker, tolerance)
            )
        for lease in leases.values():
            lease.reason = self._verdict(lease)
        for row, outcome in zip(rows, outcomes):
            lease = leases[row.lease_id]
            if lease.reason is None and lease.probation and outcome.result.near:
                lease.held_back.add(row.group)
        for lease in leases.values():
            self._count(lease, sum(len(results[g].completion_ids) for g in lease.held_back))
        for row, outcome in zip(rows, outcomes):
            lease = leases[row.lease_id]
            if lease.reason is None and row.group not in lease.held_back:
                self._keep(row, outcome)
        self.stats.seconds += time.perf_counter() - started
        return leases

    def _leases_and_rows(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        results: Sequence[GroupResult],
        temperature: float,
        max_new_tokens: int,
        stop_ids: set[int],
    ) -> tuple[dict[str, LeaseCheck], list[Row], dict[int, dict[str, torch.Tensor]]]:
        """One :class:`LeaseCheck` per lease (its tolerance, early stops, whether its version is held and its
        completions fit the model), the rows to check (those of leases that can be checked), and the held states of
        their versions (taken once: :class:`VersionStates` may drop a version meanwhile)."""
        if self.states is None:
            raise ConfigError(
                "the rollout check needs the published versions' weights (RolloutVerifier(states=VersionStates(...)))"
            )
        replay_dtype = next(model.parameters()).dtype
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        leases: dict[str, LeaseCheck] = {}
        rows: list[Row] = []
        for group, (prompt, result) in enumerate(zip(prompts, results)):
            lease = leases.get(result.lease_id)
            if lease is None:
                lease = leases[result.lease_id] = LeaseCheck(
                    result.lease_id, result.worker, result.version, result.compute_dtype
                )
                try:
                    lease.tolerance = self._tolerance(result.compute_dtype, replay_dtype, temperature)
                except ValueError as exc:
                    lease.invalid = str(exc)
            for row in self._rows(prompt, result, group):
                lease.completions += 1
                if len(row.ids) < max_new_tokens and (not row.ids or row.ids[-1] not in stop_ids):
                    lease.early_stops += 1
                if vocab and any(not 0 <= t < vocab for t in row.ids):
                    lease.invalid = lease.invalid or f"token ids outside the model's vocabulary [0, {vocab})"
                if context and len(row.prompt) + len(row.ids) > context:
                    lease.invalid = lease.invalid or f"a completion runs past the model's context of {context} tokens"
                rows.append(row)
        states: dict[int, dict[str, torch.Tensor]] = {}
        for version in sorted({lease.version for lease in leases.values()}):
            state = self.states.wait(version, self.states_wait)
            if state is None:
                evicted = self.states.dropped(version)
                for lease in leases.values():
                    if lease.version == version:
                        lease.unverifiable, lease.evicted = True, evicted
            else:
                states[version] = state
        checkable = [r for r in rows if leases[r.lease_id].invalid is None and not leases[r.lease_id].unverifiable]
        return leases, checkable, states

    def _tolerance(self, compute_dtype: str, replay_dtype: torch.dtype, temperature: float) -> Tolerance:
        """The precision's tolerance at ``temperature``, with the config's overrides."""
        tolerance = tolerance_for(compute_dtype, replay_dtype, temperature)
        if self.config.verify_margin is not None:
            margin = self.config.verify_margin
            tolerance = tolerance.with_margin(margin)
        if self.config.verify_max_logprob_error is not None:
            tolerance = replace(tolerance, logprob_error=self.config.verify_max_logprob_error)
        return tolerance

    def _evaluate(
        self,
        model: torch.nn.Module,
        rows: list[Row],
        leases: dict[str, LeaseCheck],
        states: dict[int, dict[str, torch.Tensor]],
        temperature: float,
    ) -> list[_Outcome]:
        """Decide every row (module docstring): in the shared mode first with ``model``, then, version by version
        (the one the second model holds first: each is loaded once), the audited rows and those the drift bound does
        not prove with the version's weights; in the version mode all with their version's."""
        tolerances = [leases[row.lease_id].tolerance for row in rows]
        outcomes: list[_Outcome | None] = [None] * len(rows)
        shared = self.weights == "shared"
        current: dict[int, Checked] = {}
        audited: set[int] = set()
        if shared and rows:
            audited = set(self._audited(rows))
            current = self._pass(
                model, rows, list(range(len(rows))), tolerances, temperature, first=True, winners=audited
            )
        versions = sorted({row.version for row in rows}, key=lambda v: (v != self._pinned.version, v))
        for version in versions:
            members = [i for i, row in enumerate(rows) if row.version == version]
            pinned = self._pinned.load(model, version, states[version])
            todo = members
            if shared:
                sample = [i for i in members if i in audited]
                decided = self._pass(pinned, rows, sample, tolerances, temperature, gaps=True, reference=current)
                bound = DRIFT_SAFETY * self._last_lost
                # how far the current weights' log-probabilities of the sampled tokens are from the version's: a
                # proven completion's ratio is 1, exact only to this
                ratio_error = max(
                    (abs(a - b) for i, c in decided.items() for a, b in zip(current[i].logprobs, c.logprobs)),
                    default=0.0,
                )
                self.stats.drift = max(self.stats.drift, bound)
                self.stats.ratio_error = max(self.stats.ratio_error, ratio_error)
                for i, checked in decided.items():
                    outcomes[i] = _Outcome(checked.result, checked.logprobs, audited=True, current=current[i].logprobs)
                exact = ratio_error <= self.config.verify_ratio_error
                todo = []
                for i in members:
                    result, tolerance = current[i].result, tolerances[i]
                    assert tolerance is not None  # noqa: S101 (rows of leases without one are not checked)
                    if i in audited:
                        continue
                    if exact and result.lead > bound and result.max_logprob_error <= tolerance.logprob_error + bound:
                        outcomes[i] = _Outcome(result, current[i].logprobs, shared=True, current=current[i].logprobs)
                    else:
                        todo.append(i)
            for i, checked in self._pass(pinned, rows, todo, tolerances, temperature, gaps=True).items():
                # TRL's old log-probabilities stay the current weights'
                outcomes[i] = _Outcome(
                    checked.result, checked.logprobs, current=current[i].logprobs if shared else None
                )
        done = [o for o in outcomes if o is not None]
        assert len(done) == len(rows)  # noqa: S101 (every row is decided by one of the passes)
        return done

    def _audited(self, rows: list[Row]) -> list[int]:
        """The rows whose version's check measures the drift: every completion of a share ``verify_audit`` of the
        prompts (a group's completions share their prompt's forward pass), each drawn by a keyed hash of the lease
        seed and the prompt (the same group is audited in whichever call it comes), and at least the lowest-hashed
        prompt of each version."""
        key = self._random_key if self.audit_seed is None else str(self.audit_seed)
        draws = []
        for row in rows:
            text = f"{key}:{row.seed}:{','.join(map(str, row.prompt))}".encode()
            draws.append(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") / 2**64)
        chosen = {i for i, u in enumerate(draws) if u < self.config.verify_audit}
        for version in {row.version for row in rows}:
            members = [i for i, row in enumerate(rows) if row.version == version]
            if not chosen.intersection(members):
                lowest = min(draws[i] for i in members)
                chosen.update(i for i in members if draws[i] == lowest)
        return sorted(chosen)

    def _pass(
        self,
        model: torch.nn.Module,
        rows: list[Row],
        indices: list[int],
        tolerances: list[Tolerance | None],
        temperature: float,
        *,
        first: bool = False,
        gaps: bool = False,
        winners: set[int] | None = None,
        reference: dict[int, Checked] | None = None,
    ) -> dict[int, Checked]:
        """:func:`~pulseloco.rollouts.replay.replay` of ``rows[i]`` for ``i`` in ``indices`` with ``model``; the most
        lead ``reference``'s winners lose goes to :attr:`_last_lost`, the gaps to :attr:`gaps` (with ``gaps``), the
        forward passes' seconds to the stats (``first``: also to ``first_forward_seconds``)."""
        done = replay(
            model,
            rows,
            indices,
            tolerances,
            temperature,
            gaps_out=self.gaps if gaps else None,
            winners=winners,
            reference=reference,
        )
        self._last_lost = done.lost
        self.stats.forward_seconds += done.forward_seconds
        self.stats.first_forward_seconds += done.forward_seconds if first else 0.0
        return done.checked

    # ---- the log-probabilities handed on ---------------------------------------------------------------------

    def _keep(self, row: Row, outcome: _Outcome) -> None:
        """Keep the trainer's log-probabilities of a row that passed, for :meth:`sampling_logps` and (shared mode)
        :meth:`shared_logps`."""
        self._sampling[row.key] = outcome.sampling
        self._decided[row.key] = "shared" if outcome.shared else "version"
        if outcome.current is not None:
            self._shared[row.key] = outcome.current

    def clear_shared(self) -> None:
        """Forget the log-probabilities kept (the caller's: at the start of each generation round; :meth:`check`
        adds to them, since a round's groups generated again are checked in a later call)."""
        self._shared = {}
        self._sampling = {}
        self._decided = {}

    def sampling_logps(self, prompt: Sequence[int], ids: Sequence[int]) -> list[float] | None:
        """The trainer's log-probabilities of completion ``ids`` of ``prompt`` that TRL's importance-sampling ratio
        divides by (module docstring), from a check since :meth:`clear_shared` that passed it; None otherwise."""
        return self._sampling.get((tuple(prompt), tuple(ids)))

    def decided_by(self, prompt: Sequence[int], ids: Sequence[int]) -> str | None:
        """Which check passed completion ``ids`` of ``prompt`` since :meth:`clear_shared`: ``shared`` (proven from
        the current weights) or ``version``; None when none did."""
        return self._decided.get((tuple(prompt), tuple(ids)))

    def shared_logps(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
    ) -> torch.Tensor | None:
        """The trainer's per-token log-probabilities of TRL's batch (``input_ids``: left-padded prompts followed by
        right-padded completions, the last ``logits_to_keep`` columns the completions), shaped as TRL's
        ``_get_per_token_logps_and_entropies`` returns them (``(rows, logits_to_keep)``, zero past a completion's
        end), from the shared checks with the trainer's current weights since :meth:`clear_shared`; ``None``
        unless every row was checked so (TRL then runs its own forward pass). Never raises for a batch it does not
        know."""
        if not self._shared or input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
            return None
        split = input_ids.shape[1] - logits_to_keep
        if split < 0 or logits_to_keep < 1:
            return None
        rows = []
        for ids, keep in zip(input_ids.tolist(), attention_mask.bool().tolist()):
            prompt = tuple(t for t, k in zip(ids[:split], keep[:split]) if k)
            completion = tuple(t for t, k in zip(ids[split:], keep[split:]) if k)
            values = self._shared.get((prompt, completion))
            if values is None or len(values) > logits_to_keep:
                return None
            rows.append(values + [0.0] * (logits_to_keep - len(values)))
        return torch.tensor(rows, dtype=torch.float32, device=input_ids.device)

    @torch.no_grad()
    def share(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        results: Sequence[GroupResult],
        *,
        temperature: float,
    ) -> None:
        """Replace the log-probabilities kept by those that one :meth:`check` of every completion of ``results``
        (``results[g]`` answering ``prompts[g]``) in one call computes: the same passes over the same rows, no
        counts. Rows that would not pass keep nothing. Errors of the model propagate."""
        started = time.perf_counter()
        leases, rows, states = self._leases_and_rows(model, prompts, results, temperature, 1, set())
        self.clear_shared()
        for row, outcome in zip(rows, self._evaluate(model, rows, leases, states, temperature)):
            self._keep(row, outcome)
        self.stats.seconds += time.perf_counter() - started

    # ---- rows, folding and verdicts -------------------------------------------------------------------------

    @staticmethod
    def _rows(prompt: Sequence[int], result: GroupResult, group: int = -1) -> list[Row]:
        """The rows checked for ``result``'s completions of ``prompt`` (the ``group``-th of its call)."""
        return [
            Row(
                result.lease_id,
                list(prompt),
                ids,
                logprobs,
                result.seed,
                result.sequence + offset,
                result.version,
                group,
            )
            for offset, (ids, logprobs) in enumerate(zip(result.completion_ids, result.logprobs))
        ]

    @staticmethod
    def _add(lease: LeaseCheck, outcome: _Outcome, num_tokens: int) -> None:
        """Fold one completion's check into its lease."""
        result = outcome.result
        lease.checked += result.checked
        lease.mismatches += result.mismatches
        lease.near += result.near
        bands = len(lease.tolerance.bands) if lease.tolerance else 0
        if not lease.band_positions:
            lease.band_positions, lease.band_near = [0] * bands, [0] * bands
        for band in range(bands):
            lease.band_positions[band] += result.band_positions[band]
            lease.band_near[band] += result.band_near[band]
        lease.worst_gap = max(lease.worst_gap, result.worst_gap)
        lease.tokens += num_tokens
        lease.logprob_error_sum += result.logprob_error * num_tokens
        if not outcome.shared:  # the shared check held it to the tolerance plus the drift bound already
            lease.max_logprob_error = max(lease.max_logprob_error, result.max_logprob_error)
        lease.shared += outcome.shared
        lease.audited += outcome.audited

    def _verdict(self, lease: LeaseCheck) -> str | None:
        """Why ``lease`` fails (None: it passes); counts its worker's unverifiable and verified leases."""
        worker = lease.worker
        if lease.unverifiable and lease.evicted:
            return None  # this trainer dropped its version: generated again, not the worker's doing
        if lease.unverifiable:
            self._unverifiable[worker] = self._unverifiable.get(worker, 0) + 1
            allowed = UNVERIFIABLE_ALLOWANCE + self._verified.get(worker, 0) // 10
            if self._unverifiable[worker] > allowed:
                return (
                    f"claims version {lease.version}, which this trainer does not hold ({self._unverifiable[worker]} "
                    f"unverifiable leases, {allowed} allowed)"
                )
            return None
        self._verified[worker] = self._verified.get(worker, 0) + 1
        if lease.invalid is not None:
            return lease.invalid
        if lease.early_stops:
            return f"{lease.early_stops} completion(s) stopped before max_new_tokens without an end-of-sequence token"
        tolerance = lease.tolerance
        assert tolerance is not None  # noqa: S101 (set for every lease that is not invalid)
        if lease.mismatches:
            return (
                f"tokens are not the replayable sampler's choice: {lease.mismatches} position(s) trail it by more "
                f"than the {lease.compute_dtype} margin of {tolerance.margin:.3g} nats (up to {lease.worst_gap:.3g})"
            )
        if lease.max_logprob_error > tolerance.logprob_error:
            return (
                f"log-probabilities differ from the trainer's by up to {lease.max_logprob_error:.3g} nats per token "
                f"(the {lease.compute_dtype} tolerance is {tolerance.logprob_error:.3g})"
            )
        empty = [0] * len(tolerance.bands)
        refuse = self.guard.add(worker, lease.band_positions or empty, lease.band_near or empty, tolerance)
        if refuse is not None:
            lease.refuse = refuse
            return refuse
        return None

    def _count(self, lease: LeaseCheck, held_back: int = 0) -> None:
        """Add ``lease`` to the run's counters (``held_back``: the completions of its groups held back)."""
        stats = self.stats
        stats.probation_leases += lease.probation and lease.reason is None and not lease.unverifiable
        stats.probation_held_back += held_back
        if lease.unverifiable and lease.reason is None:
            stats.unverifiable_leases += 1
            return
        stats.leases += 1
        stats.shared_completions += lease.shared
        stats.audited_completions += lease.audited
        stats.completions += lease.completions
        stats.positions += lease.checked
        stats.mismatches += lease.mismatches
        stats.near += lease.near
        stats.guard_refusals += lease.refuse is not None
        if lease.reason is not None:
            stats.failed_leases += 1
            stats.last_failure = lease.reason
        else:
            stats.worst_passing_gap = max(stats.worst_passing_gap, lease.worst_gap)
            stats.worst_passing_logprob_error = max(stats.worst_passing_logprob_error, lease.max_logprob_error)


def stop_ids(tokenizer: Any, model: Any) -> set[int]:
    """The tokens a completion may end on before ``max_new_tokens``: the tokenizer's end-of-sequence token and those
    of the model's generation config (what the engines stop on)."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids
