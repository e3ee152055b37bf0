"""Completions for TRL's ``GRPOTrainer`` from the swarm's rollout workers: a ``rollout_func``.

    from pulseloco.integrations import PulseLoCoCallback, PulseSyncCallback, SwarmRollouts

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...,
                          callbacks=[PulseLoCoCallback(run_id="my-run", ...),
                                     PulseSyncCallback(signing_key="keys/publisher")],
                          rollout_func=SwarmRollouts(run_id="my-run"))

``run_id`` is the bare training run id everywhere (the callbacks', this one's, the worker's ``--run_id``); the
workers follow ``<run_id>.policy``, derived from it. Each round's record goes to ``<output_dir>/rollouts.jsonl``.

TRL calls the rollout function once per generation round with this process's prompts (each repeated
``num_generations`` times); :class:`SwarmRollouts` tokenizes them as TRL would (TRL's own ``_tokenize_prompts``:
the chat template is applied here, at the backend boundary), has the rollout workers that follow ``<run_id>.policy``
generate ``num_generations`` completions of each prompt (:class:`pulseloco.rollouts.client.RolloutClient`: leases,
re-leases, checked replies), and returns ``prompt_ids``, ``completion_ids`` and the workers' sampling ``logprobs``.
TRL then decodes the completions and computes the rewards itself: a worker's own scores are never used.

- **Asynchrony**: once a batch is back, the batch TRL will ask for next is already sent to the workers (predicted
  from a second iterator over the trainer's own train dataloader, and checked against the prompts TRL then passes:
  a wrong prediction is discarded and lookahead turned off, never trained on), so the workers generate while the
  trainer trains.
- **Lag**: a completion made with version v is used at the newest published version v' only if v' - v <= ``max_lag``;
  older ones are dropped, counted and generated again.
- **Off-policy correction**: TRL's truncated importance sampling (``vllm_importance_sampling_correction``, its mode
  and ``vllm_importance_sampling_clip_*``) runs in the installed TRL only where ``use_vllm`` is set. When the
  correction is on, the first call sets ``use_vllm`` on this trainer so that TRL computes the ratio between its
  own log-probabilities and the workers' and multiplies the loss by it; TRL's hook that would push weights to a
  vLLM engine is given an object whose ``sync_weights`` does nothing, because the workers receive the weights by
  PULSESync (:class:`PulseSyncCallback`). Sampling is plain temperature: TRL's ``top_p``, ``top_k``, ``min_p`` and
  ``repetition_penalty`` must be off, since the workers' log-probabilities would otherwise not be those of the
  distribution sampled from.
- **Checks**: before TRL sees a worker's completions, the trainer checks them
  (:class:`pulseloco.rollouts.verify.RolloutVerifier`): every token must be the replayable sampler's choice
  (:mod:`pulseloco.rollouts.sampling`) under the weights of the version the lease claims (followed here by a
  :class:`pulseloco.rollouts.verify.VersionStates`), every log-probability near the trainer's, and a completion
  may end early only on an end-of-sequence token. The groups of a lease that fails are generated again by other
  workers; a worker whose leases fail ``max_refusals`` times is refused for the run (logged, in the metrics, and in
  the DHT for ``pulseloco status``), so a dishonest worker's completions never reach the loss.
- **Replayable batches**: a batch's sampling noise is keyed by one seed (from the trainer's ``seed``) and each
  group by its place in the batch, so a group generated again, by another worker in another lease, gets the same
  noise: at a given version, which workers answered (or failed) does not change the batch TRL trains on.
- **No workers**: after ``rollout_timeout`` seconds without a usable worker, ``fallback="local"`` generates the
  batch with the trainer's own model (saying so), and ``fallback="wait"`` keeps waiting with a warning every
  ``rollout_timeout`` seconds.

Under ``accelerate launch`` with several processes, every process's prompts are gathered on the main process
(the only one in the swarm), generated there, and each process gets its own slice back.

Failure behaviour: bad arguments raise :class:`pulseloco.errors.ConfigError` at construction, and a trainer
configuration this path cannot serve (sampling filters, multimodal prompts, no DHT or key to be found) raises it at
the first call, as do run ids that disagree with the trainer's PulseLoCoCallback or PulseSyncCallback. Neither
fallback raises for want of workers (``local`` generates, ``wait`` waits), and nothing a worker
sends raises here (bad replies are refused and re-leased).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from transformers import TrainerCallback

from pulseloco.errors import ConfigError
from pulseloco.integrations.callback_base import RunRollouts
from pulseloco.integrations.pulsesync import PulseSyncCallback
from pulseloco.integrations.settle import settle
from pulseloco.integrations.trainer import PulseLoCoCallback
from pulseloco.jsonl import JsonLinesWriter
from pulseloco.keys import check_training_run_id, policy_run_id
from pulseloco.rollouts.client import GroupResult, LeaseConfig, NoWorkersError, RolloutClient, worker_command
from pulseloco.rollouts.verify import RolloutVerifier, stop_ids
from pulseloco.rollouts.version_states import VersionStates
from pulseloco.swarm import SwarmConfig

logger = logging.getLogger(__name__)

__all__ = [
    "FALLBACKS",
    "ROLLOUTS_FILE",
    "RolloutConfig",
    "SwarmRollouts",
    "check_run_ids",
    "enable_importance_sampling",
    "share_old_logps",
]

ROLLOUTS_FILE = "rollouts.jsonl"
"""The generation rounds' JSON lines, in the trainer's ``output_dir`` unless ``metrics_path`` says otherwise."""

Fallback = Literal["local", "wait"]
FALLBACKS: tuple[Fallback, ...] = get_args(Fallback)


@dataclass(kw_only=True)
class RolloutConfig(LeaseConfig):
    """How a trainer uses the swarm's rollout workers: the leases (:class:`LeaseConfig`), what to do without a
    worker, and whether to send the next batch early (also the recipes' flags, read by ``HfArgumentParser``).
    Raises :class:`ConfigError` naming a bad value."""

    rollout_fallback: Fallback = field(
        default="local",
        metadata={
            "help": "With no usable worker for --rollout_timeout s: local (generate with the trainer's model) or wait."
        },
    )
    rollout_lookahead: bool = field(
        default=True, metadata={"help": "Send the next batch to the workers while the trainer trains on this one."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout_fallback not in FALLBACKS:
            raise ConfigError(f"rollout_fallback must be one of {', '.join(FALLBACKS)}, got {self.rollout_fallback!r}")


#: Times a round's stale or failing groups are generated again by the workers before the trainer generates them.
MAX_REGENERATIONS = 3


class _PulseSyncWeights:
    """Stands where TRL keeps its vLLM weight sync (``trainer.vllm_generation``): TRL calls ``sync_weights()``
    before each rollout round, and on this path the workers get the weights by PULSESync instead."""

    def sync_weights(self) -> None:
        return None


def enable_importance_sampling(trainer: Any) -> bool:
    """Make TRL's ``GRPOTrainer`` apply its truncated importance-sampling correction to a ``rollout_func``'s
    completions (module docstring): sets ``use_vllm`` on ``trainer`` and gives it a ``vllm_generation`` whose
    ``sync_weights`` does nothing. Returns whether it changed anything: not when the correction is off
    (``vllm_importance_sampling_correction=False``) or ``use_vllm`` is already set (TRL does it itself)."""
    if not trainer.args.vllm_importance_sampling_correction or trainer.use_vllm:
        return False
    trainer.use_vllm = True
    trainer.vllm_generation = _PulseSyncWeights()
    trainer._last_loaded_step = trainer.state.global_step
    return True


def share_old_logps(trainer: Any, verifier: RolloutVerifier) -> bool:
    """Let TRL's ``GRPOTrainer`` take its importance-sampling ratio's old log-probabilities (its no-gradient
    forward pass of the trainer's model over a generation round) from ``verifier``'s first check of the same
    completions with the same weights (:meth:`RolloutVerifier.shared_logps`), so that the check's forward pass
    replaces TRL's.

    Wraps the trainer's ``_get_per_token_logps_and_entropies``: the wrapper answers only a call without gradients on
    the trainer's own model with nothing else asked (TRL makes that call first, for the old log-probabilities; a
    reference model's call, with PEFT on the same model, comes after and goes to TRL, since the kept values are
    used once), and only when every row was checked; anything else goes to TRL. Returns whether it wrapped: not
    when TRL computes no such ratio (``vllm_importance_sampling_correction`` off), where the first check is a
    forward pass of its own."""
    if not (trainer.use_vllm and trainer.args.vllm_importance_sampling_correction):
        return False
    original = trainer._get_per_token_logps_and_entropies

    def shared(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
        asked = {k: v for k, v in kwargs.items() if k != "batch_size" and v not in (None, False)}
        if model is trainer.model and not args and not asked and not torch.is_grad_enabled():
            logps = verifier.shared_logps(input_ids, attention_mask, logits_to_keep)
            verifier.clear_shared()  # one use
            if logps is not None:
                verifier.stats.shared_forwards += 1
                return logps, None, None
        return original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = shared
    return True


def check_run_ids(run_id: str | None, callbacks: list[Any]) -> str:
    """The training run id of a :class:`SwarmRollouts` given ``run_id`` on a trainer with ``callbacks``: ``run_id``,
    else that of the :class:`PulseLoCoCallback` or :class:`PulseSyncCallback` among them. Raises
    :class:`ConfigError` when one of theirs disagrees with it (the workers would follow another run than the one
    published), or when there is none at all."""
    theirs: list[tuple[str, str]] = []
    for callback in callbacks:
        if isinstance(callback, PulseLoCoCallback):
            theirs.append(("PulseLoCoCallback", callback.run_id))
        elif isinstance(callback, PulseSyncCallback) and callback.training_run_id is not None:
            theirs.append(("PulseSyncCallback", callback.training_run_id))
    chosen = run_id
    for name, other in theirs:
        if chosen is None:
            chosen = other
        elif other != chosen:
            raise ConfigError(
                f"SwarmRollouts(run_id={chosen!r}) and the trainer's {name}(run_id={other!r}) disagree: the workers "
                f"would follow '{chosen}.policy' while versions are published under '{other}.policy'; give the "
                "same training run id to both (and to the worker's --run_id)"
            )
    if chosen is None:
        raise ConfigError(
            "SwarmRollouts needs the training run id: give run_id='RUN' (the rollout workers' --run_id), or put a "
            "PulseLoCoCallback or PulseSyncCallback with one on the same trainer"
        )
    return chosen


@dataclass
class _Pending:
    key: str
    prompt_ids: list[list[int]]
    groups: list[list[int]]
    num_samples: int
    seed: int
    future: concurrent.futures.Future[list[GroupResult]]
    prefetched: bool = False
    sent: float = field(default_factory=time.time)  # wall time its leases went to the workers


def _group(rows: list[Any], num_generations: int) -> int:
    """How many consecutive rows share a prompt: ``num_generations`` when the rows come in such runs, else 1."""
    if num_generations > 1 and len(rows) % num_generations == 0:
        for start in range(0, len(rows), num_generations):
            if any(rows[start + i] != rows[start] for i in range(1, num_generations)):
                return 1
        return num_generations
    return 1


class SwarmRollouts(RunRollouts):
    """A TRL ``rollout_func`` whose completions come from the swarm's rollout workers (module docstring).

    Args (keyword-only):
        dht: the DHT to use; default: that of a :class:`PulseLoCoCallback` or :class:`PulseSyncCallback` on the same
            trainer, else one started from ``swarm`` at the first call.
        swarm: how to join when there is no DHT to reuse.
        run_id: the training run id, bare (workers follow ``<run_id>.policy``, derived from it; a value ending in
            ``.policy`` is refused); default: that of the :class:`PulseLoCoCallback` or :class:`PulseSyncCallback`
            on the same trainer. One that disagrees with theirs, or none at all, raises :class:`ConfigError` at
            the first call.
        public_key: the publisher's public key or its path; default: the key of a :class:`PulseSyncCallback` on the
            same trainer.
        config: how the workers are used (:class:`RolloutConfig`; default its defaults): ``max_lag``, the versions a
            completion may be behind the newest published version when it is used; ``lease_timeout``, the seconds a
            worker has for one lease; ``rollout_timeout``, the seconds without a usable worker before the fallback,
            ``rollout_fallback`` (``local``: generate with the trainer's model; ``wait``); ``rollout_lookahead``
            (send the next batch to the workers before TRL asks for it); ``leases_per_worker`` (this trainer's
            leases running on one worker at once); ``max_refusals`` (failed leases before a worker is refused).
        verify: check every worker's completions with the trainer's model before TRL sees them
            (:class:`pulseloco.rollouts.verify.RolloutVerifier`); a lease that fails is generated again by
            other workers and counts against its worker, refused after ``max_refusals``.
        verifier: the checks (default: a :class:`RolloutVerifier` with its default thresholds).
        metrics_path: where to append one JSON line per generation round (lag histogram, dropped, refused, wait
            seconds). ``None`` (the default): ``<output_dir>/rollouts.jsonl`` of the trainer's ``args.output_dir`` on
            the main process; ``False``: no file.

    Attributes: ``client`` (the :class:`RolloutClient`, after the first call), ``seconds_waiting`` (total time
    TRL waited in this function), ``num_local`` (rounds generated locally).
    """

    def __init__(
        self,
        *,
        dht: Any | None = None,
        swarm: SwarmConfig | None = None,
        run_id: str | None = None,
        public_key: Any | None = None,
        config: RolloutConfig | None = None,
        verify: bool = True,
        verifier: RolloutVerifier | None = None,
        metrics_path: str | os.PathLike[str] | Literal[False] | None = None,
    ) -> None:
        from pulseloco.integrations.trl_warnings import replace_rollout_func_warning

        replace_rollout_func_warning()  # before the GRPOTrainer this is given to warns; said in one line at start
        config = self.config = config or RolloutConfig()
        if run_id is not None:
            check_training_run_id(run_id)
        #: the file the public key was read from, for the hint that starts a worker (None for a key object)
        self.public_key_path: str | None = None
        if isinstance(public_key, str | os.PathLike):
            from pulseloco.sync.signing import load_public_key

            self.public_key_path = str(public_key)
            public_key = load_public_key(public_key)  # fails here, with a clear message, not mid-training
        self.dht = dht
        self.swarm = swarm
        self.run_id = run_id
        self.public_key = public_key
        self.lookahead = config.rollout_lookahead
        self.verifier = (verifier or RolloutVerifier()) if verify else None
        self.metrics_path = metrics_path
        self.metrics: JsonLinesWriter | None = None  # opened at the first call (the default is in output_dir)
        self.client: RolloutClient | None = None
        self.seconds_waiting = 0.0
        self.num_local = 0
        self.num_rounds = 0
        self._publishers: list[PulseSyncCallback] = []  # this trainer's publishing callbacks (their queued versions)
        self._pushed = -1  # the newest version whose head was pushed to the workers
        self._owned_dht: Any | None = None
        self._pending: _Pending | None = None
        self._predictions: Iterator[list[Any]] | None = None
        self._local_engine: Any | None = None
        self._states: VersionStates | None = None
        self._started = False

    # ---- TRL's entry point --------------------------------------------------------------------------------

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if not self._started:
            self._start(trainer)
        accelerator = trainer.accelerator
        if accelerator.num_processes == 1:
            return self._generate(prompts, trainer)
        from accelerate.utils import broadcast_object_list, gather_object

        everyone = gather_object([prompts])  # one list of prompts per process, in rank order
        box: list[Any] = [None]
        if accelerator.is_main_process:
            box[0] = self._generate([p for part in everyone for p in part], trainer)
        broadcast_object_list(box, from_process=0)
        start = sum(len(part) for part in everyone[: accelerator.process_index])
        end = start + len(prompts)
        return {key: values[start:end] for key, values in box[0].items()}

    def check_trainer(self, trainer: Any) -> None:
        """Raise :class:`ConfigError` unless ``trainer`` samples with plain temperature (TRL's ``top_p`` 1.0,
        ``top_k`` 0 or None, no ``min_p``, ``repetition_penalty`` 1.0): the checks replay the sampler's choice
        from the whole distribution. Called at the first rollout round, and at train begin by the pulseloco
        callbacks on the same Trainer."""
        if trainer.top_p != 1.0 or trainer.top_k not in (None, 0) or trainer.min_p is not None:
            raise ConfigError(
                "swarm rollouts sample with plain temperature, so that the workers' log-probabilities are those of "
                f"the distribution sampled from: set top_p 1.0, top_k 0 and no min_p (got top_p={trainer.top_p}, "
                f"top_k={trainer.top_k}, min_p={trainer.min_p})"
            )
        if getattr(trainer, "repetition_penalty", 1.0) != 1.0:
            raise ConfigError("swarm rollouts sample with plain temperature: set repetition_penalty 1.0")

    def _start(self, trainer: Any) -> None:
        """Check that this path can serve ``trainer``; find or start the DHT and the key; turn TRL's
        importance-sampling correction on (see the module docstring)."""
        self._started = True
        args = trainer.args
        self.check_trainer(trainer)
        callbacks = list(getattr(trainer.callback_handler, "callbacks", []))
        self.run_id = check_run_ids(self.run_id, callbacks)
        from pulseloco.integrations.trl_warnings import explain_trl_warnings

        explain_trl_warnings(rollout_func=True)
        enable_importance_sampling(trainer)
        if not trainer.accelerator.is_main_process:
            return
        if self.metrics_path is None:
            self.metrics = JsonLinesWriter(os.path.join(str(args.output_dir), ROLLOUTS_FILE), stamp=True)
        elif self.metrics_path is not False:
            self.metrics = JsonLinesWriter(self.metrics_path, stamp=True)
        verifier = self.verifier
        if verifier is not None and verifier.audit_seed is None:
            verifier.audit_seed = args.seed  # the same audit in a run repeated with the same seed
        if verifier is not None and verifier.weights == "shared" and not share_old_logps(trainer, verifier):
            logger.info("rollouts: no importance-sampling ratio in TRL; the first check is a forward pass of its own")
        if self.dht is None:
            for callback in callbacks:
                if isinstance(callback, PulseLoCoCallback) and callback.dht is not None:
                    self.dht = callback.dht
                    break
                if isinstance(callback, PulseSyncCallback) and callback.dht_in_use is not None:
                    self.dht = callback.dht_in_use
                    break
        if self.public_key is None:
            for callback in callbacks:
                if isinstance(callback, PulseSyncCallback) and callback.signing_key is not None:
                    self.public_key = callback.signing_key.public_key()
        if self.public_key is None:
            raise ConfigError(
                "swarm rollouts need the publisher's public key (--public_key PATH, the .pub file of `pulseloco "
                "keygen`) to know which versions exist, or a PulseSyncCallback on this trainer"
            )
        if self.dht is None:
            from pulseloco.swarm import make_dht

            self.dht = self._owned_dht = make_dht(self.swarm or SwarmConfig())
        vocab_size = len(trainer.processing_class)
        self.client = RolloutClient(
            self.dht,
            policy_run_id(self.run_id),
            self.public_key,
            vocab_size=max(vocab_size, int(getattr(trainer.model.config, "vocab_size", 0) or 0)),
            config=self.config,
            seed=args.seed,
            worker_hint=self._worker_hint(trainer, callbacks),
        )
        if self.verifier is not None and self.verifier.states is None:
            # the published versions' own weights, so that each lease is checked with the version it claims: handed
            # over by this process's publisher, else followed like a worker follows them
            model = trainer.accelerator.unwrap_model(trainer.model)
            template = {n: t for n, t in model.state_dict().items() if t.is_floating_point()}
            publishers = [c for c in callbacks if isinstance(c, PulseSyncCallback) and c.signing_key is not None]
            follow = None if publishers else self.dht
            states = VersionStates(
                follow, policy_run_id(self.run_id), self.public_key, template, keep=self.config.max_lag + 2
            )
            for callback in publishers:
                callback.add_version_listener(states.add)
            self.verifier.states = self._states = states
        for callback in callbacks:
            if isinstance(callback, PulseSyncCallback) and callback.signing_key is not None:
                callback.add_head_listener(self._head_signed)
                callback.add_announce_listener(self._announced)
                self._publishers.append(callback)
        trainer.add_callback(_CloseAtEnd(self))
        print(
            f"rollouts: from the swarm's workers of run_id={policy_run_id(self.run_id)} max_lag={self.config.max_lag} "
            f"fallback={self.config.rollout_fallback}",
            flush=True,
        )

    def _head_signed(self, version: int, head: bytes) -> None:
        """This trainer's publisher signed a version's head (its thread), before the DHT stores it: pushed to the
        workers now, so that they fetch the version from this publisher a DHT round trip or more sooner."""
        if self.client is not None and version > self._pushed:
            self._pushed = version
            self.client.push_head(version, head)

    def _announced(self, published: Any) -> None:
        """This trainer's publisher announced a version (its thread): the client's newest, with no DHT read (the
        newest counts only once the workers can find it in the DHT, so it is learned here, not at signing), and
        the head pushed to the workers if :meth:`_head_signed` has not (a version announced before this object
        listened). A version whose head record the DHT did not take is not one the workers can find, so it is
        left out."""
        if published.announced and self.client is not None:
            self.client.note_published(published.version, published.digest)
            self._head_signed(published.version, published.head_envelope)
        if published.announced and self._states is not None:
            # leases of versions from here on are within max_lag of what the workers can find: keep them checkable
            self._states.hold_from(published.version - self.config.max_lag)

    def _worker_hint(self, trainer: Any, callbacks: list[Any]) -> str:
        """The complete command that starts a worker for this run (:func:`worker_command`): the trainer's model
        directory, the public key's file (given here, or the ``.pub`` beside a PulseSyncCallback's signing key) and
        this trainer's own multiaddr, each a placeholder when it is not known."""
        assert self.run_id is not None  # noqa: S101 (resolved by _start)
        model = trainer.accelerator.unwrap_model(trainer.model)
        model_dir = str(getattr(model.config, "_name_or_path", "") or "") or None
        key = self.public_key_path
        if key is None:
            for callback in callbacks:
                if isinstance(callback, PulseSyncCallback) and callback.signing_key_path is not None:
                    key = f"{callback.signing_key_path}.pub"
        maddr = None
        try:
            maddrs = [str(a) for a in self.dht.get_visible_maddrs()] if self.dht is not None else []
            maddr = next((a for a in maddrs if "/p2p/" in a), None)
        except Exception as exc:  # the hint only; the placeholder says what is missing
            logger.debug("no multiaddr for the worker hint: %r", exc)
        return worker_command(self.run_id, model=model_dir, public_key=key, initial_peers=maddr)

    # ---- one generation round -----------------------------------------------------------------------------

    def _generate(self, rows: list[Any], trainer: Any) -> dict[str, list[Any]]:
        assert self.client is not None  # noqa: S101 (set by _start on the main process, which alone gets here)
        started = time.monotonic()
        if self.verifier is not None:
            self.verifier.clear_shared()
        training = trainer.model.training
        num_generations = trainer.num_generations if training else trainer.num_generations_eval
        pending = self._take_or_submit(rows, trainer)
        if training and self.lookahead:
            # the next round goes to the workers now, before this one is back: each worker queues it behind its
            # lease of this round and goes on without waiting a round trip for it, and generates while the trainer
            # checks and trains this one (a lease this round's checks send again queues behind it)
            self._submit_prediction(trainer)
        results, fallback = self._collect(trainer, pending.future, pending.groups, pending.num_samples)
        received = time.time()

        def regenerate(indices: list[int], last: bool) -> list[GroupResult]:
            nonlocal fallback
            groups = [pending.groups[i] for i in indices]
            if last:
                logger.warning(
                    "rollouts: %d groups still stale or failing the checks; generating them with the trainer's model",
                    len(indices),
                )
                fallback = True
                return self._generate_locally(trainer, groups, pending.num_samples)
            # the batch's seed and the groups' own ids: a group is sampled with the same noise whoever makes it
            future = self._submit_groups(
                groups, pending.num_samples, trainer, pending.seed, indices, min_version=self._min_version(0)
            )
            again, here = self._collect(trainer, future, groups, pending.num_samples)
            fallback = fallback or here
            return again

        model = trainer.accelerator.unwrap_model(trainer.model)
        settled = settle(
            results,
            pending.groups,
            client=self.client,
            verifier=self.verifier,
            model=model,
            max_lag=self.config.max_lag,
            temperature=trainer.temperature,
            max_new_tokens=trainer.max_completion_length,
            stop_ids=stop_ids(trainer.processing_class, model),
            regenerate=regenerate,
            attempts=MAX_REGENERATIONS,
        )
        results, newest, verify_seconds = settled.results, settled.newest, settled.verify_seconds
        lags = [self.client.lag(r.version) for r in results if r.version >= 0]  # before anything moves the newest
        waited = time.monotonic() - started
        self.seconds_waiting += waited
        self.num_rounds += 1
        self._record(
            trainer, results, pending, newest, lags, waited, fallback, num_generations, verify_seconds, received
        )
        completion_ids, logprobs = [], []
        for result in results:
            completion_ids.extend(result.completion_ids)
            logprobs.extend(result.logprobs)
        return {"prompt_ids": pending.prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    def _collect(
        self,
        trainer: Any,
        future: concurrent.futures.Future[list[GroupResult]],
        groups: list[list[int]],
        num_samples: int,
    ) -> tuple[list[GroupResult], bool]:
        """The results of ``future``, or, when no worker took its leases (``fallback="local"``), the same groups
        generated with the trainer's own model; the flag says which."""
        try:
            return future.result(timeout=None if self.config.rollout_fallback == "wait" else self._wait_bound()), False
        except (NoWorkersError, concurrent.futures.TimeoutError) as exc:
            future.cancel()
            logger.warning("rollouts: %s; generating this batch with the trainer's own model", exc)
            print(f"rollouts: no workers ({exc}); generating this round locally", flush=True)
            return self._generate_locally(trainer, groups, num_samples), True

    def _min_version(self, steps_ahead: int) -> int:
        """The oldest version that a round trained ``steps_ahead`` optimizer steps from now may be generated with:
        ``max_lag`` behind the newest version by then (one more per step at most), counted from the newest this
        trainer queued for publishing, else the newest it knows of; never above that newest (a version that does
        not exist yet: with ``max_lag`` 0 and a version every few steps the workers would wait for it until their
        leases' deadlines). 0 when it knows of none."""
        assert self.client is not None  # noqa: S101
        queued = [v for v in (c.queued_version for c in self._publishers) if v is not None]
        newest = (max(queued) if queued else self.client.newest) or 0
        return max(0, min(newest, newest + steps_ahead - self.config.max_lag))

    def _submit_groups(
        self,
        groups: list[list[int]],
        num_samples: int,
        trainer: Any,
        seed: int,
        group_ids: list[int] | None = None,
        *,
        min_version: int = 0,
    ) -> concurrent.futures.Future[list[GroupResult]]:
        assert self.client is not None  # noqa: S101
        return self.client.submit(
            groups,
            num_samples=num_samples,
            max_new_tokens=trainer.max_completion_length,
            temperature=trainer.temperature,
            wait=self.config.rollout_fallback == "wait",
            seed=seed,
            group_ids=group_ids,
            min_version=min_version,
        )

    def _wait_bound(self) -> float:
        # the client raises NoWorkersError after rollout_timeout idle; this bounds a batch that keeps failing
        return self.config.rollout_timeout + 10 * self.config.lease_timeout

    def _take_or_submit(self, rows: list[Any], trainer: Any) -> _Pending:
        key = json.dumps(rows, sort_keys=True, default=str)
        pending, self._pending = self._pending, None
        if pending is not None and pending.key == key:
            pending.prefetched = True
            return pending
        if pending is not None:  # the prediction was wrong: never train on it, and stop predicting
            pending.future.cancel()
            self._predictions = None
            self.lookahead = False
            logger.info("rollouts: the predicted batch was not the one TRL asked for; lookahead turned off")
        return self._submit(rows, key, trainer, steps_ahead=0)

    def _submit(self, rows: list[Any], key: str, trainer: Any, *, steps_ahead: int) -> _Pending:
        assert self.client is not None  # noqa: S101
        num_generations = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        per_group = _group(rows, num_generations)
        prompt_ids, images, multimodal = trainer._tokenize_prompts(rows)  # TRL's own tokenization
        if images is not None or multimodal:
            raise ConfigError("swarm rollouts generate from text prompts only (this batch has images)")
        prompt_ids = [list(map(int, ids)) for ids in prompt_ids]
        groups = [prompt_ids[start] for start in range(0, len(rows), per_group)]
        seed = self.client.next_seed()
        future = self._submit_groups(groups, per_group, trainer, seed, min_version=self._min_version(steps_ahead))
        return _Pending(key, prompt_ids, groups, per_group, seed, future)

    def _submit_prediction(self, trainer: Any) -> None:
        if self._predictions is None:
            self._predictions = self._predicted_rounds(trainer)
            next(self._predictions, None)  # the round just served
        rows = next(self._predictions, None)
        if rows is not None:
            # trained after this round's step: one version newer at most by then
            self._pending = self._submit(rows, json.dumps(rows, sort_keys=True, default=str), trainer, steps_ahead=1)

    @staticmethod
    def _predicted_rounds(trainer: Any) -> Iterator[list[Any]]:
        """The prompts of TRL's generation rounds, from a second iterator over the trainer's train dataloader (its
        sampler is seeded, so it yields the same batches; TRL generates on every ``steps_per_generation *
        num_iterations``-th batch)."""
        every = trainer.args.steps_per_generation * trainer.num_iterations
        while True:
            loader = trainer.get_train_dataloader()
            for position, batch in enumerate(loader):
                if position % every == 0:
                    yield [row["prompt"] for row in batch]

    def _generate_locally(self, trainer: Any, groups: list[list[int]], num_samples: int) -> list[GroupResult]:
        from pulseloco.rollouts.engines.hf import TransformersEngine

        if self._local_engine is None:
            model = trainer.accelerator.unwrap_model(trainer.model)
            self._local_engine = TransformersEngine(model, trainer.processing_class, shadow=False)
        self.num_local += 1
        prompts = [group for group in groups for _ in range(num_samples)]
        completions = self._local_engine.generate_ids(
            prompts, max_new_tokens=trainer.max_completion_length, temperature=trainer.temperature
        )
        results = []
        for g in range(len(groups)):
            mine = completions[g * num_samples : (g + 1) * num_samples]
            results.append(GroupResult(-1, "", [c.token_ids for c in mine], [c.logprobs for c in mine], "local"))
        return results

    def _record(
        self,
        trainer: Any,
        results: list[GroupResult],
        pending: _Pending,
        newest: int | None,
        lags: list[int],
        waited: float,
        fallback: bool,
        num_generations: int,
        verify_seconds: float,
        received: float,
    ) -> None:
        assert self.client is not None  # noqa: S101
        stats = self.client.stats
        num_samples = pending.num_samples
        for lag in lags:
            stats.lag[lag] += num_samples
        workers = sorted({r.worker for r in results})
        mode = "train" if trainer.model.training else "eval"
        metrics = trainer._metrics[mode]  # TRL logs these with its own (report_to)
        metrics["rollouts/lag_mean"].append(sum(lags) / len(lags) if lags else 0.0)
        metrics["rollouts/wait_seconds"].append(waited)
        metrics["rollouts/stale_dropped"].append(float(stats.stale_dropped))
        metrics["rollouts/refused"].append(float(stats.refused))
        metrics["rollouts/local"].append(1.0 if fallback else 0.0)
        metrics["rollouts/check_failed"].append(float(stats.check_failed))
        metrics["rollouts/refused_workers"].append(float(len(stats.refusals)))
        metrics["rollouts/verify_seconds"].append(verify_seconds)
        if self.metrics is not None:
            by_worker: dict[str, int] = {}
            for r in results:
                by_worker[r.worker] = by_worker.get(r.worker, 0) + len(r.completion_ids)
            self.metrics.write(
                event="rollouts",
                round=self.num_rounds,
                step=trainer.state.global_step,
                mode=mode,
                newest_version=newest,
                versions=sorted({r.version for r in results}),
                lags=sorted(lags),
                completions=len(results) * num_samples,
                num_generations=num_generations,
                by_worker=by_worker,
                workers=workers,
                seconds_waiting=round(waited, 4),
                local=fallback,
                prefetched=pending.prefetched,
                sent=round(pending.sent, 3),
                received=round(received, 3),
                stale_dropped=stats.stale_dropped,
                refused=stats.refused,
                failed=stats.failed,
                released=stats.released,
                backups=stats.backups,
                backups_won=stats.backups_won,
                refused_workers=dict(stats.refusals),
                check_failed=stats.check_failed,
                verify=self._verify_record(verify_seconds),
            )

    def _verify_record(self, seconds: float) -> dict[str, Any] | None:
        """The checks' counters for the metrics line (None when the checks are off)."""
        if self.verifier is None:
            return None
        counters = dataclasses.asdict(self.verifier.stats)
        rounded = {k: round(v, 5) if isinstance(v, float) else v for k, v in counters.items()}
        return {"seconds": round(seconds, 4), "total_seconds": rounded.pop("seconds"), **rounded}

    def close(self) -> None:
        """Cancel a batch still in flight, close the client and a DHT this object started. Idempotent."""
        if self._pending is not None:
            self._pending.future.cancel()
            self._pending = None
        if self._states is not None:
            self._states.close()
            self._states = None
        if self.client is not None:
            self.client.close()
            self.client = None
        if self._owned_dht is not None:
            self._owned_dht.shutdown()
            self._owned_dht = None


class _CloseAtEnd(TrainerCallback):
    """Closes a :class:`SwarmRollouts` when training ends (added to the trainer's callbacks at the first call)."""

    def __init__(self, rollouts: SwarmRollouts) -> None:
        self.rollouts = rollouts

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rollouts.close()
