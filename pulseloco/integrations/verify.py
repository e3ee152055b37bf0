"""The trainer's check of a rollout worker's completions, before any of them reaches the loss.

A worker that holds the weights could return any completion with its true log-probabilities: cherry-pick the best
of many samples, generate with other weights, or write a chosen text that earns the reward. Every completion is
sampled by a replayable rule (:mod:`pulseloco.rollouts.sampling`): at each position the token is the argmax of
``logits / T`` plus Gumbel noise keyed by the lease's seed, the completion's index in the lease, the position and
the token id. :class:`RolloutVerifier` runs the trainer's model over the completions (one forward pass without
gradients, in chunks) and, from its logits:

- recomputes the choice at every position of every completion (or of a random ``fraction`` of each lease's
  completions, at least one, drawn by the trainer so that a worker cannot know which: the forward pass, the check's
  cost, shrinks in proportion, and a worker that cheats on a share ``s`` of a lease's ``n`` completions is then
  caught with probability about ``1 - (1 - fraction) ** (s n)``), and counts a *mismatch* where the worker's token
  trails the perturbed argmax by more than ``margin``. The logits come from the weights of the version the lease
  claims when the trainer holds them (:class:`VersionStates` follows the published versions): the margin then
  covers only numeric differences
  between engines and devices (measured by ``scripts/bench_verify.py``). Otherwise they come from the trainer's
  own weights, which are up to ``lag`` versions newer (and moved by its own inner steps), and the margin is scaled
  by ``1 + lag``: a weaker check, counted apart in the stats (``pinned_leases``). Positions within the margin are
  counted as *near*;
- compares the worker's per-token log-probabilities with those of the same weights: their mean absolute difference
  over a lease must stay below ``max_logprob_error`` (scaled by ``1 + lag`` when not pinned), since they feed TRL's
  importance-sampling ratio;
- checks that a completion shorter than ``max_new_tokens`` ends with an end-of-sequence token (a worker may not cut
  a sample where it likes).

A lease fails when any of its completions has more than ``max_mismatch_rate`` of its checked positions mismatched
(at least one), when its log-probabilities are off, or a completion stopped early. The caller
(:class:`pulseloco.integrations.swarm_rollouts.SwarmRollouts`) drops every group of a failed lease, has other workers
generate them again, and reports the failure (:meth:`pulseloco.rollouts.client.RolloutClient.report_check_failure`),
which refuses the worker after a few.

Failure behaviour: nothing a worker sent raises here (a completion longer than the model's context fails its
lease); errors of the trainer's own model propagate.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pulseloco.errors import ConfigError
from pulseloco.rollouts.client import GroupResult, RolloutClient
from pulseloco.rollouts.sampling import CheckResult, check_completions

logger = logging.getLogger(__name__)

__all__ = [
    "LeaseCheck",
    "RolloutVerifier",
    "Settled",
    "VerifyConfig",
    "VerifyStats",
    "VersionStates",
    "settle",
    "stop_ids",
]


Row = tuple[str, list[int], list[int], list[float], int, int]
"""A completion as the checks see it: lease id, prompt, completion ids, the worker's log-probabilities, lease
seed, sequence index."""

#: The weights a completion is checked with (:class:`VerifyConfig`'s ``verify_weights``).
WEIGHTS = ("shared", "version")


#: Logits held at once per chunk of the forward pass (elements; 2**27 float32 values are 512 MiB).
@dataclass(kw_only=True)
class VerifyConfig:
    """The thresholds of :class:`RolloutVerifier` (also the recipes' ``--verify_*`` flags, read by
    ``HfArgumentParser``, with the help texts in ``metadata``). Raises :class:`ConfigError` naming a bad one."""

    verify_margin: float = field(
        default=2.0,
        metadata={
            "help": "Nats (of logits / temperature plus noise, per version of lag plus one) by which a worker's token "
            "may trail the sampler's choice without counting as a mismatch: covers engine and device differences."
        },
    )
    verify_max_mismatch_rate: float = field(
        default=0.0,
        metadata={"help": "Fraction of a completion's positions that may mismatch before its lease fails."},
    )
    verify_max_logprob_error: float = field(
        default=0.25,
        metadata={
            "help": "Mean |worker - trainer| log-probability per token (per version of lag plus one) a lease may have."
        },
    )
    verify_fraction: float = field(
        default=1.0,
        metadata={
            "help": "With --verify_weights version: fraction of each lease's completions checked, drawn at random (at "
            "least one): the check's forward pass shrinks with it, and a worker cheating on few completions is "
            "caught less surely. The shared check looks at every completion."
        },
    )

    verify_weights: Literal["shared", "version"] = field(
        default="shared",
        metadata={
            "help": "'shared': every completion is first checked with this trainer's current weights, in the "
            "forward pass TRL's importance-sampling ratio needs anyway (its log-probabilities are handed to TRL), and "
            "only the completions that do not pass are checked again with the weights of the version they claim; "
            "'version': every checked completion with its version's weights, a forward pass of its own."
        },
    )

    def __post_init__(self) -> None:
        if self.verify_weights not in WEIGHTS:
            raise ConfigError(f"verify_weights must be one of {', '.join(WEIGHTS)}, got {self.verify_weights!r}")
        if not (self.verify_margin >= 0 and math.isfinite(self.verify_margin)):
            raise ConfigError(f"verify_margin must be a finite number >= 0, got {self.verify_margin}")
        if not 0 <= self.verify_max_mismatch_rate < 1:
            raise ConfigError(f"verify_max_mismatch_rate must be in [0, 1), got {self.verify_max_mismatch_rate}")
        if not (self.verify_max_logprob_error > 0 and math.isfinite(self.verify_max_logprob_error)):
            raise ConfigError(f"verify_max_logprob_error must be positive, got {self.verify_max_logprob_error}")
        if not 0 < self.verify_fraction <= 1:
            raise ConfigError(f"verify_fraction must be in (0, 1], got {self.verify_fraction}")


MAX_CHUNK_LOGITS = 1 << 27


class VersionStates:
    """The published BF16 weights of the newest ``keep`` versions, for checking each lease with its own version.

    A thread follows the PULSESync run ``run_id`` (a :class:`pulseloco.sync.subscriber.Subscriber` that does not
    relay, so a trainer uploads nothing for it) on a BF16 copy of ``template`` (the trainer's state dict: the names
    and shapes the publisher signs) and keeps a copy of the state at each version it reaches. With ``dht=None``
    nothing is followed: the publisher's own process hands each version it publishes to :meth:`add` (it cannot
    fetch from itself). It reaches the head
    every ``poll`` seconds, so a version published and superseded between two looks is not held; a lease of such a
    version is checked with the trainer's weights instead. Memory: ``keep + 1`` BF16 copies of the weights.

    Failure behaviour: a version that cannot be fetched or verified is logged and retried at the next look; never
    raises into the trainer. :meth:`close` stops the thread (bounded).
    """

    def __init__(
        self,
        dht: Any | None,
        run_id: str,
        public_key: Any,
        template: dict[str, torch.Tensor],
        *,
        keep: int = 3,
        poll: float = 0.2,
    ) -> None:
        self.keep = max(1, keep)
        self.poll = poll
        self._held: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.subscriber: Any = None
        self._thread: threading.Thread | None = None
        if dht is not None:
            from pulseloco.sync.subscriber import Subscriber

            self.state = {n: t.detach().to(device="cpu", dtype=torch.bfloat16).clone() for n, t in template.items()}
            self.subscriber = Subscriber(dht, run_id, public_key, relay=False)
            self._thread = threading.Thread(target=self._follow, name="verify-versions", daemon=True)
            self._thread.start()

    def add(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Hold ``state`` as ``version`` (a publisher's own versions: :attr:`PulseSyncCallback.version_listeners
        <pulseloco.integrations.pulsesync.PulseSyncCallback.version_listeners>`); the oldest beyond ``keep`` go."""
        with self._lock:
            self._held[version] = state
            for old in sorted(self._held)[: -self.keep]:
                del self._held[old]

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        """The BF16 state of ``version`` (None when not held)."""
        with self._lock:
            return self._held.get(version)

    def wait(self, version: int, timeout: float) -> dict[str, torch.Tensor] | None:
        """The state of ``version``, waiting up to ``timeout`` s for it (a version just published is fetched within
        a poll or two); None at once for a version older than every one held."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                state = self._held.get(version)
                older = bool(self._held) and version < min(self._held)
            if state is not None or older or time.monotonic() >= deadline or self._stop.is_set():
                return state
            time.sleep(0.05)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                report = self.subscriber.update_report(self.state)
            except Exception as exc:  # a provider gone or a bad object: the subscriber kept its version; retry
                logger.warning("verification could not follow the published versions: %r", exc)
                report = None
            if report is not None:
                self.add(report.version, {name: t.clone() for name, t in self.state.items()})
            self._stop.wait(self.poll)

    def close(self) -> None:
        """Stop following (bounded; never raises)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.subscriber is not None:
            self.subscriber.close()


@dataclass
class LeaseCheck:
    """What the checks found in one lease's completions (those of this batch)."""

    lease_id: str
    worker: str
    lag: int
    completions: int = 0
    checked: int = 0
    mismatches: int = 0
    near: int = 0
    worst_gap: float = 0.0
    worst_completion_rate: float = 0.0
    logprob_error_sum: float = 0.0
    tokens: int = 0
    max_logprob_error: float = 0.0
    early_stops: int = 0
    shared: int = 0
    pinned: bool = False
    unverifiable: bool = False
    reason: str | None = None

    @property
    def logprob_error(self) -> float:
        """Mean absolute difference between the worker's and the trainer's log-probabilities, per token."""
        return self.logprob_error_sum / max(self.tokens, 1)


@dataclass
class VerifyStats:
    """Counters over a run (what the metrics report): positions checked, mismatched and near, completions and
    leases checked and failed, seconds spent (``seconds``; of them in the model's forward passes,
    ``forward_seconds``, and in those of the first checks with the trainer's current weights,
    ``first_forward_seconds``: the pass TRL's importance-sampling ratio would otherwise run), the largest honest gap
    and log-probability error seen, the completions that passed with the trainer's current weights
    (``shared_completions``; the others were checked with their version's) and how many of TRL's forward passes
    the checks' log-probabilities replaced (``shared_forwards``)."""

    completions: int = 0
    positions: int = 0
    mismatches: int = 0
    near: int = 0
    leases: int = 0
    failed_leases: int = 0
    seconds: float = 0.0
    worst_passing_gap: float = 0.0
    worst_passing_logprob_error: float = 0.0
    pinned_leases: int = 0
    unverifiable_leases: int = 0
    shared_completions: int = 0
    shared_forwards: int = 0
    forward_seconds: float = 0.0
    first_forward_seconds: float = 0.0
    last_failure: str | None = None


class RolloutVerifier:
    """Checks the completions of rollout workers with the trainer's model (see the module docstring).

    Args:
        config: the thresholds (:class:`VerifyConfig`; default its defaults): ``verify_margin``, the perturbed-score
            gap (nats) within which a token that is not the argmax is not counted; ``verify_max_mismatch_rate``, the
            fraction of a completion's checked positions that may mismatch before its lease fails (0: none may);
            ``verify_max_logprob_error``, the largest mean absolute log-probability difference (nats per token) a
            lease may have; ``verify_fraction``, the fraction of each lease's completions checked (1.0: all; at
            least one per lease).
        seed: seeds the choice of positions.
        record_gaps: keep every checked position's gap in :attr:`gaps` (to measure the margin).
        states: the published versions' weights (:class:`VersionStates`): a lease is checked with the weights of the
            version it claims (a BF16 copy of the model) and the margin alone; one whose version is not held within
            ``states_wait`` seconds is *unverifiable* (generated again, held against nobody). Without ``states``,
            leases are checked with the trainer's weights and a margin scaled by the lag.

    With ``verify_weights="shared"`` (the default) :meth:`check` first checks every completion (whatever
    ``fraction``) with the model it is given, the trainer's current weights, and the margin alone (not scaled by
    any lag): a completion with no mismatched position and a mean log-probability error within
    ``max_logprob_error`` passes there; only the others are checked as above, with their version's weights. Passing
    the first check means the tokens are the sampler's choice under weights the trainer holds, as strictly as the
    second, so nothing is let through that the second would refuse for a worker that does not know the trainer's
    unpublished weights. The first check's log-probabilities are kept for :meth:`shared_logps`, which hands them
    to TRL as its importance-sampling ratio's old log-probabilities (the forward pass TRL would do next, with the
    same weights): at learning rates where the weights move little between versions (RL's), most completions pass
    the first check and the second forward pass is not needed.
    """

    def __init__(
        self,
        config: VerifyConfig | None = None,
        *,
        seed: int = 0,
        record_gaps: bool = False,
        states: VersionStates | None = None,
        states_wait: float = 5.0,
    ) -> None:
        config = config or VerifyConfig()
        self.margin = config.verify_margin
        self.max_mismatch_rate = config.verify_max_mismatch_rate
        self.max_logprob_error = config.verify_max_logprob_error
        self.fraction = config.verify_fraction
        self.weights = config.verify_weights
        self._shared: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = {}
        self.stats = VerifyStats()
        self.gaps: list[float] | None = [] if record_gaps else None
        self.states = states
        self.states_wait = states_wait
        self._pinned_model: torch.nn.Module | None = None
        self._pinned_version: int | None = None
        self._rng = random.Random(seed)

    @torch.no_grad()
    def check(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        results: Sequence[GroupResult],
        lags: Sequence[int],
        *,
        temperature: float,
        max_new_tokens: int,
        stop_ids: set[int],
    ) -> dict[str, LeaseCheck]:
        """Check ``results[g]`` (the completions of prompt ``prompts[g]``, ``lags[g]`` versions behind) with
        ``model``; returns one :class:`LeaseCheck` per lease, whose ``reason`` is set when the lease fails."""
        started = time.perf_counter()
        leases: dict[str, LeaseCheck] = {}
        rows: list[Row] = []
        for prompt, result, lag in zip(prompts, results, lags):
            lease = leases.setdefault(result.lease_id, LeaseCheck(result.lease_id, result.worker, lag))
            for row in self._rows(prompt, result):
                ids = row[2]
                lease.completions += 1
                if len(ids) < max_new_tokens and (not ids or ids[-1] not in stop_ids):
                    lease.early_stops += 1
                rows.append(row)
        if self.weights == "shared":  # first with the trainer's weights; what does not pass, with the version's
            rows = self._first_check(model, rows, leases, temperature)
        elif self.fraction < 1.0:
            rows = self._sample(rows)
        # each lease is checked with its own version's weights when they are held (then the margin covers only
        # numeric differences), else with the trainer's current weights and a margin scaled by the lag
        version_of = {r.lease_id: r.version for r in results}
        snapshots = {}
        if self.states is not None:
            for version in sorted({version_of[row[0]] for row in rows}):
                snapshots[version] = self.states.wait(version, self.states_wait)
        for lease_id in {row[0] for row in rows}:
            lease = leases[lease_id]
            if snapshots.get(version_of[lease_id]) is not None:
                lease.pinned, lease.lag = True, 0
            elif self.states is not None:  # a version the trainer does not hold: generated again, nobody blamed
                lease.unverifiable = True
        groups: dict[int | None, list[Any]] = {}
        for row in rows:
            if not leases[row[0]].unverifiable:
                groups.setdefault(version_of[row[0]] if leases[row[0]].pinned else None, []).append(row)
        for pin, group in groups.items():
            target = model if pin is None else self._pinned(model, pin, snapshots[pin])
            for chunk, checked, _ in self._run(target, group, temperature, [leases[r[0]].lag for r in group]):
                for row, outcome in zip(chunk, checked):
                    self._add(leases[row[0]], outcome, len(row[2]))
        for lease in leases.values():
            lease.reason = self._verdict(lease)
            self._count(lease)
        self.stats.seconds += time.perf_counter() - started
        return leases

    def _pinned(self, model: torch.nn.Module, version: int, state: dict[str, torch.Tensor] | None) -> torch.nn.Module:
        """A second model of ``model``'s class and config, in its dtype and on its device, holding ``state`` (the
        published BF16 weights of ``version``); made once and reloaded when the version changes.

        Built from the config, not copied: a trainer's model may carry a ``forward`` wrapped by ``accelerate``
        (autocast, output conversion) in a closure over the original module, which a deep copy would keep
        calling, so the copy would compute with the trainer's weights. Its initialisation leaves the trainer's
        random generators as they were."""
        assert state is not None  # noqa: S101 (only versions with a snapshot get here)
        if self._pinned_model is None:
            parameter = next(model.parameters())
            # its random initialisation (overwritten below) must not draw from the trainer's generators: whether a
            # run builds this model (a completion fails the shared check) would otherwise change its training
            cuda = [parameter.device] if parameter.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda), torch.device(parameter.device):
                pinned = type(model)(copy.deepcopy(model.config))
            self._pinned_model = pinned.to(dtype=parameter.dtype).eval()
            self._pinned_version = None
        if self._pinned_version != version:
            with torch.no_grad():
                for name, tensor in self._pinned_model.state_dict().items():
                    if name in state:
                        tensor.copy_(state[name])
            self._pinned_version = version
        return self._pinned_model

    def _sample(self, rows: list[Any]) -> list[Any]:
        """A random ``fraction`` of each lease's completions (at least one), drawn with the trainer's generator."""
        by_lease: dict[str, list[Any]] = {}
        for row in rows:
            by_lease.setdefault(row[0], []).append(row)
        kept = []
        for lease_rows in by_lease.values():
            count = max(1, round(self.fraction * len(lease_rows)))
            kept.extend(self._rng.sample(lease_rows, count))
        return kept

    def _chunks(self, rows: list[Any], model: torch.nn.Module) -> list[list[Any]]:
        vocab = int(getattr(model.config, "vocab_size", 0) or 1)
        chunks: list[list[Any]] = []
        current: list[Any] = []
        for row in sorted(rows, key=lambda r: len(r[1]) + len(r[2])):  # similar lengths pad less
            width = len(row[1]) + len(row[2])
            if current and (len(current) + 1) * width * vocab > MAX_CHUNK_LOGITS:
                chunks.append(current)
                current = []
            current.append(row)
        if current:
            chunks.append(current)
        return chunks

    def _first_check(
        self, model: torch.nn.Module, rows: list[Any], leases: dict[str, LeaseCheck], temperature: float
    ) -> list[Any]:
        """Check every row with ``model`` (the trainer's current weights) and the margin alone, keeping each row's
        log-probabilities for :meth:`shared_logps`; fold the rows that pass (no mismatched position, mean
        log-probability error within ``max_logprob_error``) into their leases and return the others."""
        left = []
        lags = [0] * len(rows)
        for chunk, results, logprobs in self._run(model, rows, temperature, lags, keep_logprobs=True, first=True):
            self._keep(chunk, logprobs)
            for row, result in zip(chunk, results):
                if result.mismatches == 0 and result.logprob_error <= self.max_logprob_error:
                    self._add(leases[row[0]], result, len(row[2]))
                    leases[row[0]].shared += 1
                else:
                    left.append(row)
        return left

    @torch.no_grad()
    def share(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        results: Sequence[GroupResult],
        *,
        temperature: float,
    ) -> None:
        """Replace the log-probabilities kept for :meth:`shared_logps` by ``model``'s of every completion of
        ``results`` (``results[g]`` answering ``prompts[g]``), computed in one call as :meth:`check` computes them
        when it is given the same rows: no check, no counts. Errors of the model propagate."""
        started = time.perf_counter()
        rows = [row for prompt, result in zip(prompts, results) for row in self._rows(prompt, result)]
        self._shared = {}
        for chunk, _, logprobs in self._run(model, rows, temperature, [0] * len(rows), keep_logprobs=True):
            self._keep(chunk, logprobs)
        self.stats.seconds += time.perf_counter() - started

    @staticmethod
    def _rows(
        prompt: Sequence[int], result: GroupResult
    ) -> list[tuple[str, list[int], list[int], list[float], int, int]]:
        """The rows checked for ``result``'s completions of ``prompt``: (lease id, prompt, completion ids, the
        worker's log-probabilities, lease seed, sequence index)."""
        return [
            (result.lease_id, list(prompt), ids, logprobs, result.seed, result.sequence + offset)
            for offset, (ids, logprobs) in enumerate(zip(result.completion_ids, result.logprobs))
        ]

    def _keep(self, rows: list[Any], logprobs: list[list[float]]) -> None:
        """Keep the trainer's log-probabilities of ``rows`` for :meth:`shared_logps`, keyed by prompt and
        completion tokens."""
        for row, values in zip(rows, logprobs):
            self._shared[(tuple(row[1]), tuple(row[2]))] = values

    def clear_shared(self) -> None:
        """Forget the log-probabilities kept for :meth:`shared_logps` (the caller's: at the start of each generation
        round; :meth:`check` adds to them, since a round's groups generated again are checked in a later call)."""
        self._shared = {}

    def shared_logps(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
    ) -> torch.Tensor | None:
        """The trainer's per-token log-probabilities of TRL's batch (``input_ids``: left-padded prompts followed by
        right-padded completions, the last ``logits_to_keep`` columns the completions), shaped as TRL's
        ``_get_per_token_logps_and_entropies`` returns them (``(rows, logits_to_keep)``, zero past a completion's
        end), from the first checks with the trainer's current weights since :meth:`clear_shared`; ``None`` unless
        every row was checked so (TRL then runs its own forward pass). Never raises for a batch it does not know."""
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

    def _run(
        self,
        model: torch.nn.Module,
        rows: list[Any],
        temperature: float,
        lags: list[int],
        keep_logprobs: bool = False,
        first: bool = False,
    ) -> list[tuple[list[Any], list[CheckResult], list[list[float]]]]:
        """Check ``rows`` (with their lags, which scale the margin) with ``model`` in eval mode, in chunks: per chunk
        its rows, their results and (``keep_logprobs``) the trainer's log-probabilities of their tokens. The forward
        passes' seconds go to the stats (``first``: also to ``first_forward_seconds``)."""
        lag_of = {id(row): lag for row, lag in zip(rows, lags)}
        out = []
        was_training = model.training
        model.eval()
        try:
            for chunk in self._chunks(rows, model):
                logprobs: list[list[float]] | None = [] if keep_logprobs else None
                results = self._check_chunk(
                    model, chunk, [lag_of[id(r)] for r in chunk], temperature, logprobs, first=first
                )
                out.append((chunk, results, logprobs or []))
        finally:
            model.train(was_training)
        return out

    def _check_chunk(
        self,
        model: torch.nn.Module,
        chunk: list[Any],
        lags: list[int],
        t: float,
        logprobs_out: list[list[float]] | None = None,
        first: bool = False,
    ) -> list[CheckResult]:
        length = max(len(c) for _, _, c, _, _, _ in chunk)
        tokens = torch.tensor([c + [0] * (length - len(c)) for _, _, c, _, _, _ in chunk], dtype=torch.long)
        mask = torch.tensor([[True] * len(c) + [False] * (length - len(c)) for _, _, c, _, _, _ in chunk])
        logprobs = torch.tensor([list(lp) + [0.0] * (length - len(lp)) for _, _, _, lp, _, _ in chunk])
        started = time.perf_counter()
        picked = self._completion_logits(model, chunk, length)
        seconds = time.perf_counter() - started  # the host's; on a GPU, until the kernels are queued
        self.stats.forward_seconds += seconds
        self.stats.first_forward_seconds += seconds if first else 0.0
        check = mask.clone()
        results = check_completions(
            picked,
            tokens,
            mask,
            logprobs,
            temperature=t,
            seeds=torch.tensor([r[4] for r in chunk], dtype=torch.int64),
            sequences=torch.tensor([r[5] for r in chunk], dtype=torch.int64),
            margin=torch.tensor([self.margin * (1 + lag) for lag in lags]),
            check=check,
            gaps_out=self.gaps,
            logprobs_out=logprobs_out,
        )
        return results

    @staticmethod
    def _completion_logits(model: torch.nn.Module, chunk: list[Any], length: int) -> torch.Tensor:
        """The logits that predict each completion token, ``(len(chunk), length, vocab)`` (past a completion's end:
        what its padding gives, for the caller to mask). A group's completions share their prompt: each distinct
        prompt runs once (rows with prompts of one length together, unpadded), its last position predicting the
        first completion token, and its KV cache, selected once per completion, serves the completions' forward
        pass (right-padded: causal attention leaves the real tokens alone). With ``G`` completions per prompt the
        prompt's share of the work is divided by ``G``."""
        device = next(model.parameters()).device
        out: torch.Tensor | None = None
        by_length: dict[int, list[int]] = {}
        for i, (_, prompt, _, _, _, _) in enumerate(chunk):
            by_length.setdefault(len(prompt), []).append(i)
        for width, rows in by_length.items():
            distinct: dict[tuple[int, ...], int] = {}
            which = [distinct.setdefault(tuple(chunk[i][1]), len(distinct)) for i in rows]
            # the prompt's last position alone predicts a checked token (the first of each completion)
            first = model(input_ids=torch.tensor(list(distinct), device=device), use_cache=True, logits_to_keep=1)
            index = torch.tensor(which, device=device)
            parts = [first.logits[index]]
            wide = max(len(chunk[i][2]) for i in rows) - 1  # a completion's last token predicts nothing checked
            if wide > 0:  # completion token j predicts token j + 1
                cache = first.past_key_values
                cache.batch_select_indices(index)
                heads = [chunk[i][2][:wide] for i in rows]
                ids = [c + [0] * (wide - len(c)) for c in heads]
                attention = [[1] * (width + len(c)) + [0] * (wide - len(c)) for c in heads]
                second = model(
                    input_ids=torch.tensor(ids, device=device),
                    attention_mask=torch.tensor(attention, device=device),
                    past_key_values=cache,
                    use_cache=False,
                )
                parts.append(second.logits)
            logits = torch.cat(parts, dim=1)[:, :length]
            if out is None:
                out = logits.new_zeros((len(chunk), length, logits.shape[-1]))
            out[torch.tensor(rows, device=device), : logits.shape[1]] = logits
        assert out is not None  # noqa: S101 (a chunk has rows)
        return out

    @staticmethod
    def _add(lease: LeaseCheck, result: CheckResult, num_tokens: int) -> None:
        """Fold one completion's check into its lease."""
        lease.checked += result.checked
        lease.mismatches += result.mismatches
        lease.near += result.near
        lease.worst_gap = max(lease.worst_gap, result.worst_gap)
        if result.checked:
            lease.worst_completion_rate = max(lease.worst_completion_rate, result.mismatches / result.checked)
        lease.tokens += num_tokens
        lease.logprob_error_sum += result.logprob_error * num_tokens
        lease.max_logprob_error = max(lease.max_logprob_error, result.max_logprob_error)

    def _verdict(self, lease: LeaseCheck) -> str | None:
        if lease.unverifiable:
            return None
        margin = self.margin * (1 + lease.lag)
        weights = "the claimed version's weights" if lease.pinned else f"the trainer's weights, lag {lease.lag}"
        if lease.early_stops:
            return f"{lease.early_stops} completion(s) stopped before max_new_tokens without an end-of-sequence token"
        if lease.mismatches and (self.max_mismatch_rate == 0 or lease.worst_completion_rate > self.max_mismatch_rate):
            return (
                "tokens are not the replayable sampler's choice: a completion has "
                f"{lease.worst_completion_rate:.0%} of its positions off, up to {lease.worst_gap:.2f} nats behind "
                f"(margin {margin:.2f}, {weights})"
            )
        tolerance = self.max_logprob_error * (1 + lease.lag)
        if lease.logprob_error > tolerance:
            return (
                f"log-probabilities differ from the trainer's by {lease.logprob_error:.3f} nats per token on average "
                f"(at most {tolerance:.3f} at lag {lease.lag})"
            )
        return None

    def _count(self, lease: LeaseCheck) -> None:
        stats = self.stats
        if lease.unverifiable:
            stats.unverifiable_leases += 1
            return
        stats.leases += 1
        stats.pinned_leases += lease.pinned
        stats.shared_completions += lease.shared
        stats.completions += lease.completions
        stats.positions += lease.checked
        stats.mismatches += lease.mismatches
        stats.near += lease.near
        if lease.reason is not None:
            stats.failed_leases += 1
            stats.last_failure = lease.reason
        else:
            stats.worst_passing_gap = max(stats.worst_passing_gap, lease.worst_gap)
            stats.worst_passing_logprob_error = max(stats.worst_passing_logprob_error, lease.logprob_error)


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


@dataclass
class Settled:
    """A batch after :func:`settle`: its ``results`` (none stale, every worker's group checked), the ``newest``
    version at the last look, and the seconds spent checking."""

    results: list[GroupResult]
    newest: int | None
    verify_seconds: float


def settle(
    results: list[GroupResult],
    groups: Sequence[Sequence[int]],
    *,
    client: RolloutClient,
    verifier: RolloutVerifier | None,
    model: torch.nn.Module,
    max_lag: int,
    temperature: float,
    max_new_tokens: int,
    stop_ids: set[int],
    regenerate: Callable[[list[int], bool], list[GroupResult]],
    attempts: int,
) -> Settled:
    """Make a batch of results fit to train on: groups generated more than ``max_lag`` versions before the newest
    are dropped (counted in the client's stats), groups of workers checked by ``verifier`` (None: not checked), and
    the groups of a lease that fails the checks, or of a worker refused meanwhile, dropped too; every dropped group
    is generated again by ``regenerate(indices, last)`` (the newest version may move meanwhile, so this repeats),
    at most ``attempts`` times, then once more with ``last=True``, whose results (the trainer's own, ``version``
    -1) are taken as they are. Each failed lease is reported with
    :meth:`pulseloco.rollouts.client.RolloutClient.report_check_failure`. ``results[g]`` answers ``groups[g]``.
    With ``verify_weights="shared"``, a batch whose groups were checked in more than one call has its
    log-probabilities for TRL computed again in one (:meth:`RolloutVerifier.share`): a forward pass more, only in
    such rounds, that keeps training bit for bit what it is when every group passes at once (so a dishonest
    worker's leases, failed and generated again, change nothing)."""
    results = list(results)
    verified: set[int] = set()
    seconds = 0.0
    calls = 0
    newest = client.newest_version()
    for attempt in range(attempts + 1):
        if attempt:
            newest = client.newest_version()
        stale = {i for i, r in enumerate(results) if r.version >= 0 and client.lag(r.version) > max_lag}
        client.stats.stale_dropped += sum(len(results[i].completion_ids) for i in stale)
        refused = client.stats.refusals
        redo = stale | {i for i, r in enumerate(results) if r.version >= 0 and r.worker in refused}
        todo = [i for i, r in enumerate(results) if r.version >= 0 and i not in verified and i not in redo]
        if verifier is not None and todo:
            started = time.perf_counter()
            leases = verifier.check(
                model,
                [groups[i] for i in todo],
                [results[i] for i in todo],
                [client.lag(results[i].version) for i in todo],
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                stop_ids=stop_ids,
            )
            seconds += time.perf_counter() - started
            calls += 1
            for check in leases.values():
                if check.reason is not None:
                    client.report_check_failure(check.worker, check.lease_id, check.reason)
            failed = {lease_id for lease_id, c in leases.items() if c.reason is not None or c.unverifiable}
            redo |= {i for i in todo if results[i].lease_id in failed or results[i].worker in refused}
        verified.update(i for i in todo if i not in redo)
        if not redo:
            break
        indices = sorted(redo)
        for i, result in zip(indices, regenerate(indices, attempt == attempts)):
            results[i] = result
    if verifier is not None and verifier.weights == "shared" and calls > 1 and all(r.version >= 0 for r in results):
        # groups checked in several calls: their log-probabilities for TRL again in one, so that they are those of
        # a round whose groups all passed at once (the same rows, the same forward pass), bit for bit
        started = time.perf_counter()
        verifier.share(model, groups, results, temperature=temperature)
        seconds += time.perf_counter() - started
    return Settled(results, newest, seconds)
