"""``transformers.TrainerCallback``s that make any Trainer (TRL's ``GRPOTrainer``, ``SFTTrainer``, a plain ``Trainer``)
a PULSELoCo swarm peer that publishes its versions to rollout workers with PULSESync.

    from pulseloco.integrations import PulseLoCoCallback, PulseSyncCallback

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...,
                          callbacks=[PulseLoCoCallback(run_id="my-run", initial_peers=["/ip4/.../p2p/..."]),
                                     PulseSyncCallback(signing_key="keys/publisher")])

:class:`PulseLoCoCallback` drives a :class:`pulseloco.PulseLoCo` with ``inner_optimizer=None``: the Trainer keeps
stepping its own optimizer (whose state is kept across rounds, as in DiLoCo) and the callback counts each applied
optimizer step (after gradient accumulation; steps the gradient scaler skipped do not count), running the outer
round after every ``inner_steps``-th one. The round is the one :class:`~pulseloco.PulseLoCo` runs for plain
PyTorch loops. Under ``accelerate launch`` with several processes only the main process joins the swarm; the
others receive ``theta`` by broadcast. Its state is saved as ``pulseloco.pt`` in every Trainer checkpoint and
restored when the Trainer resumes from one.

:class:`PulseSyncCallback` publishes the consensus weights as a new version after every outer round (or every
``every`` optimizer steps without PULSELoCo), plus the starting weights as the first version. With PULSELoCo and
``every=N`` it publishes both: the consensus after every round and, between rounds, this peer's own weights every N
optimizer steps, so that rollout workers generate with a model at most N steps behind instead of up to a round.

Metrics in the Trainer's logs: both callbacks add their numbers to the logs the Trainer sends to its reporting
integrations (``report_to``: TensorBoard, W&B, trackio, MLflow, ...), to ``trainer_state.json``'s ``log_history``
and to the printed logs, at the Trainer's next log after they happen (``logging_steps``), each value once:
``pulseloco/*`` per outer round (:class:`PulseLoCoCallback`) and ``pulsesync/*`` per stored version
(:class:`PulseSyncCallback`). The integrations write a log as soon as they see it, and the Trainer puts the
callbacks it is given after its own reporting ones, so each of these callbacks, at the first event the Trainer
sends it (``on_init_end`` for ``callbacks=[...]``, ``on_train_begin`` for ``trainer.add_callback``; checked again
at every ``on_train_begin``), moves itself in the list of the ``CallbackHandler`` that is calling it (found on the
call stack: its ``call_event`` is the caller) to just before the first callback that reads the logs (one that
overrides ``on_log``: the integrations, the printer); the other callbacks keep their order, and the list is
replaced, not changed while the handler iterates it. If it cannot find that handler (a Trainer that does not call
callbacks through ``transformers.trainer_callback.CallbackHandler``) it logs a warning once and the numbers reach
only the callbacks after it; the JSON-lines files are unaffected. Under ``accelerate launch`` with several
processes only the main process has numbers to add (the integrations write on it alone).

Failure behaviour: bad arguments raise :class:`~pulseloco.errors.ConfigError` at construction; a swarm that cannot
be joined raises :class:`~pulseloco.errors.SwarmUnreachableError` on every process at the start of training;
resuming from a checkpoint without ``pulseloco.pt`` raises :class:`~pulseloco.errors.ConfigError` before any step.
The swarm itself never fails a step (see :class:`pulseloco.PulseLoCo`).
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from pulseloco.errors import ConfigError, PulseLocoError
from pulseloco.jsonl import JsonLinesWriter
from pulseloco.keys import policy_run_id
from pulseloco.loco.optimizer import PulseLoCo
from pulseloco.loco.selection import SELECTORS, SelectorName
from pulseloco.swarm import SwarmConfig

if TYPE_CHECKING:
    from pulseloco.loco.metrics import RoundMetrics
    from pulseloco.sync.publisher import PublishedVersion

logger = logging.getLogger(__name__)

__all__ = ["STATE_FILE", "PulseLoCoCallback", "PulseSyncCallback"]

STATE_FILE = "pulseloco.pt"
"""PulseLoCo's state (theta, residual, outer momentum, counters) inside each Trainer checkpoint directory."""

_CALLBACK_OF_MODEL: weakref.WeakKeyDictionary[torch.nn.Module, PulseLoCoCallback] = weakref.WeakKeyDictionary()
"""The PulseLoCoCallback driving a model, so that a PulseSyncCallback on the same Trainer can find its rounds."""


def check_round_boundary(max_steps: int, inner_steps: int) -> None:
    """Refuse a run that would not end on an outer-round boundary: its last ``max_steps % inner_steps`` steps would
    never be averaged, and the saved model would be one peer's local weights. Raises :class:`ConfigError`."""
    if max_steps is None or max_steps <= 0:
        raise ConfigError(f"PULSELoCo needs max_steps (a multiple of inner_steps {inner_steps}), got {max_steps}")
    if max_steps % inner_steps:
        raise ConfigError(
            f"max_steps ({max_steps}) must be a multiple of inner_steps ({inner_steps}): the last "
            f"{max_steps % inner_steps} steps would never be averaged"
        )


def _join_swarm(config: SwarmConfig) -> Any:
    """Start a DHT on the main process; every process raises the same error if that fails
    (:class:`pulseloco.errors.SwarmUnreachableError` or :class:`ConfigError`, from :func:`make_dht`)."""
    from pulseloco.swarm import make_dht

    state = PartialState()  # the Trainer's own (transformers builds it with TrainingArguments)
    dht, error = None, None
    if state.is_main_process:
        try:
            dht = make_dht(config)
        except PulseLocoError as exc:
            error = exc
    if state.num_processes > 1:
        box: list[PulseLocoError | None] = broadcast_object_list([error], from_process=0)
        error = box[0]
    if error is not None:
        raise error.with_traceback(None) from None
    if dht is not None:
        for maddr in dht.get_visible_maddrs():
            print(f"swarm: multiaddr {maddr}", flush=True)
    return dht


_HANDLER_SEARCH_FRAMES = 8
"""How many callers up :func:`_calling_handler` looks for the ``CallbackHandler`` (it is 3 to 4 frames up)."""


def _calling_handler(callback: TrainerCallback) -> CallbackHandler | None:
    """The ``transformers`` ``CallbackHandler`` on the call stack (its ``call_event`` is calling one of
    ``callback``'s events) whose list holds ``callback``; ``None`` when there is none within
    :data:`_HANDLER_SEARCH_FRAMES` callers (the callback was called some other way)."""
    frame = inspect.currentframe()
    try:
        for _ in range(_HANDLER_SEARCH_FRAMES):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, CallbackHandler) and any(cb is callback for cb in owner.callbacks):
                return owner
        return None
    finally:
        del frame  # a frame kept in a local makes a reference cycle through this function's own frame


def _reads_logs(callback: Any) -> bool:
    """Whether a callback does something with the logs: it overrides ``on_log`` (the reporting integrations,
    the printer and progress bar, a user's own logger)."""
    return getattr(type(callback), "on_log", None) is not TrainerCallback.on_log


def _before_log_readers(callbacks: list[Any]) -> list[Any] | None:
    """``callbacks`` with every :class:`_LogsContributor` moved, in their order, to just before the first other
    callback that reads the logs; ``None`` when they all come before it already (or nothing reads the logs)."""
    ours = [i for i, cb in enumerate(callbacks) if isinstance(cb, _LogsContributor)]
    readers = [i for i, cb in enumerate(callbacks) if not isinstance(cb, _LogsContributor) and _reads_logs(cb)]
    if not ours or not readers or max(ours) < readers[0]:
        return None
    contributors = [callbacks[i] for i in ours]
    others = [cb for cb in callbacks if not isinstance(cb, _LogsContributor)]
    first = next(i for i, cb in enumerate(others) if _reads_logs(cb))
    return others[:first] + contributors + others[first:]


class _LogsContributor(TrainerCallback):
    """A callback that adds numbers to the Trainer's logs (so to every ``report_to`` integration), running
    before the callbacks that read them.

    Subclasses collect their numbers as they happen and hand them over in :meth:`_take_log_entries`; the next
    ``on_log`` adds them to the logs and to the ``trainer_state.json`` record of the same log. Subclasses that
    override ``on_train_begin`` call :meth:`_run_before_log_readers` there.
    """

    _placed: bool = False
    _warned_unplaced: bool = False

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._run_before_log_readers(warn=False)  # a callback given to Trainer(callbacks=...)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._run_before_log_readers(warn=True)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None:
            return
        if control.should_training_stop or 0 < state.max_steps <= state.global_step:
            self._before_last_log()
        entries = self._take_log_entries()
        if not entries:
            return
        before = {k: v for k, v in logs.items() if k not in entries}
        logs.update(entries)
        # Trainer.log put a copy of the logs into log_history before calling the callbacks: complete that record
        # too (it is the last one, of this step, and holds what the logs held before these entries).
        if state.log_history:
            record = state.log_history[-1]
            same = all(k in record and (record[k] is v or record[k] == v) for k, v in before.items())  # NaN: is
            if record.get("step") == state.global_step and same:
                record.update(entries)

    def _run_before_log_readers(self, *, warn: bool) -> None:
        """Move this callback (with the other contributors) before the log readers in the list of the
        ``CallbackHandler`` calling it. The list is replaced, never changed in place: the handler is iterating
        it. Without a handler on the call stack, logs a warning once when ``warn``."""
        handler = _calling_handler(self)
        if handler is None:
            if warn and not self._placed and not self._warned_unplaced:
                self._warned_unplaced = True
                logger.warning(
                    "%s could not find the transformers CallbackHandler calling it, so it cannot run before the "
                    "callbacks that report the logs (report_to): its numbers reach only the callbacks after it "
                    "(the JSON-lines metrics files are unaffected); put it before them in "
                    "trainer.callback_handler.callbacks",
                    type(self).__name__,
                )
            return
        self._placed = True
        reordered = _before_log_readers(handler.callbacks)
        if reordered is not None:
            handler.callbacks = reordered
            logger.info("callbacks reordered so that pulseloco's metrics reach report_to: %s",
                        [type(cb).__name__ for cb in reordered])  # fmt: skip

    def _take_log_entries(self) -> dict[str, float]:
        """The numbers collected since the last call (then forgotten); empty when there are none."""
        raise NotImplementedError

    def _before_last_log(self) -> None:
        """Called before the entries of the last log of a training run are taken."""


@dataclass
class _RoundTotals:
    """The outer rounds since the last log."""

    num_rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    num_sent: int = 0
    numel: int = 0
    seconds_sync: float = 0.0
    repaired: int = 0
    last: RoundMetrics | None = None

    def add(self, metrics: RoundMetrics) -> None:
        self.num_rounds += 1
        self.bytes_sent += metrics.bytes_sent
        self.bytes_received += metrics.bytes_received
        self.num_sent += metrics.num_sent
        self.numel += metrics.numel
        self.seconds_sync += metrics.seconds_sync
        self.repaired += int(metrics.repaired)
        self.last = metrics

    def entries(self) -> dict[str, float]:
        if self.last is None:
            return {}
        return {
            "pulseloco/round": self.last.round,
            "pulseloco/num_rounds": self.num_rounds,
            "pulseloco/bytes_sent": self.bytes_sent,
            "pulseloco/bytes_received": self.bytes_received,
            "pulseloco/density": self.num_sent / self.numel if self.numel else 0.0,
            "pulseloco/num_peers": self.last.num_peers,
            "pulseloco/num_contributors": self.last.num_contributors,
            "pulseloco/seconds_sync": self.seconds_sync,
            "pulseloco/repaired": self.repaired,
        }


@dataclass
class _VersionTotals:
    """The versions stored since the last log."""

    num_versions: int = 0
    version: int = 0
    patch_bytes: int = 0
    seconds: float = 0.0

    def add(self, published: PublishedVersion) -> None:
        self.num_versions += 1
        self.version = max(self.version, published.version)
        self.patch_bytes += published.patch_bytes
        self.seconds += published.seconds

    def entries(self) -> dict[str, float]:
        if not self.num_versions:
            return {}
        return {
            "pulsesync/version": self.version,
            "pulsesync/num_versions": self.num_versions,
            "pulsesync/patch_bytes": self.patch_bytes,
            "pulsesync/seconds_publish": self.seconds / self.num_versions,
        }


class PulseLoCoCallback(_LogsContributor):
    """Turns the Trainer it is given to into a PULSELoCo peer.

    Args (keyword-only):
        dht: a running ``hivemind.DHT`` to use (on the main process; ignored elsewhere). Without one, the
            callback starts its own on the main process from ``swarm`` (or ``initial_peers``) when training
            begins, and shuts it down when training ends.
        swarm: how to join (:class:`pulseloco.swarm.SwarmConfig`: initial peers, listen addresses, client mode,
            identity, swarm key).
        initial_peers: shorthand for ``swarm=SwarmConfig(initial_peers=...)``; none starts a new swarm.
        run_id, inner_steps, selector, and the other keyword arguments: as :class:`pulseloco.PulseLoCo`
            (``outer_lr``, ``outer_momentum``, ``topk_density``, ``topk_chunk_size``, ``matchmaking_time``,
            ``target_group_size``, ``averaging_timeout``, ``request_timeout``, ``metrics_path``, ...).
        linger: seconds to stay in the swarm after training, so that slower peers can still fetch this peer's
            shards and state, and rollout workers its last version.

    Attributes:
        loco: the :class:`pulseloco.PulseLoCo` (``None`` before training begins).
        dht: the DHT in use on the main process (``None`` elsewhere and before training begins).

    Metrics: the Trainer's next log after one or more outer rounds gets, from this peer's
    :class:`~pulseloco.loco.metrics.RoundMetrics` (on the main process, the one in the swarm; shown as
    ``train/pulseloco/...`` by TensorBoard and W&B, which prefix ``train/``):

    * ``pulseloco/round``: ``round`` of the latest round (its index, 0 for the first);
    * ``pulseloco/num_rounds``: the rounds this log covers (1 unless ``logging_steps`` > ``inner_steps``, or a
      log was skipped); the sums below are over them;
    * ``pulseloco/bytes_sent``, ``pulseloco/bytes_received``: the sum of ``bytes_sent``, ``bytes_received``
      (wire bytes of the averaging);
    * ``pulseloco/density``: the sum of ``num_sent`` over the sum of ``numel``, the latest round's ``density``
      when the log covers one round;
    * ``pulseloco/num_peers``, ``pulseloco/num_contributors``: the latest round's ``num_peers`` (group members,
      this peer included) and ``num_contributors`` (peers whose contributions the round aggregated);
    * ``pulseloco/seconds_sync``: the sum of ``seconds_sync`` (wall time of the outer steps, when training
      waits for the swarm);
    * ``pulseloco/repaired``: the rounds in which this peer downloaded the global state (``repaired``).

    The same rounds are in the JSON-lines file of ``metrics_path`` (one line each, every field).
    """

    def __init__(
        self,
        *,
        dht: Any | None = None,
        swarm: SwarmConfig | None = None,
        initial_peers: list[str] | None = None,
        run_id: str = "pulseloco",
        inner_steps: int = 8,
        selector: SelectorName = "pulse",
        linger: float = 0.0,
        **pulseloco_kwargs: Any,
    ) -> None:
        if inner_steps < 1:
            raise ConfigError(f"inner_steps must be at least 1, got {inner_steps}")
        if selector not in SELECTORS:
            raise ConfigError(f"selector must be one of {SELECTORS}, got {selector!r}")
        if swarm is not None and initial_peers is not None:
            raise ConfigError("give swarm= or initial_peers=, not both")
        if linger < 0:
            raise ConfigError(f"linger must be >= 0 seconds, got {linger}")
        self.swarm = swarm if swarm is not None else SwarmConfig(initial_peers=list(initial_peers or []))
        self.run_id = run_id
        self.inner_steps = inner_steps
        self.selector = selector
        self.linger = linger
        self.pulseloco_kwargs = pulseloco_kwargs
        self.loco: PulseLoCo | None = None
        self.dht: Any | None = dht
        self._owns_dht = dht is None
        self._before_close: list[Any] = []
        self._after_linger: list[Any] = []
        self._closed = False
        self._rounds_lock = threading.Lock()
        self._rounds = _RoundTotals()  # since the last log

    # -- Trainer events -------------------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._run_before_log_readers(warn=True)
        model = kwargs.get("model")
        if model is None:
            raise ConfigError("PulseLoCoCallback needs the Trainer's model (transformers passes it to callbacks)")
        if self.loco is not None:
            raise ConfigError("PulseLoCoCallback drives one training run; give each Trainer.train() a new callback")
        check_round_boundary(state.max_steps, self.inner_steps)
        if self._owns_dht:
            self.dht = _join_swarm(self.swarm)
        elif not PartialState().is_main_process:
            self.dht = None
        self.loco = PulseLoCo(
            model,
            None,
            dht=self.dht,
            run_id=self.run_id,
            inner_steps=self.inner_steps,
            selector=self.selector,
            **self.pulseloco_kwargs,
        )
        self.loco.add_round_listener(self._count_round)
        _CALLBACK_OF_MODEL[model] = self
        if state.global_step > 0:
            self._resume(args, state)
        if self.loco.peer_id is not None:
            print(
                f"pulseloco: peer_id={self.loco.peer_id} run_id={self.run_id} selector={self.selector} "
                f"inner_steps={self.inner_steps} round={self.loco.round}",
                flush=True,
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.loco is None:
            return
        # accelerate's optimizer wrapper says when the gradient scaler skipped the step (inf/nan gradients):
        # the weights did not move, so it is no inner step.
        if getattr(kwargs.get("optimizer"), "step_was_skipped", False):
            return
        self.loco.count_inner_step()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.loco is None or not state.is_world_process_zero:
            return
        directory = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not directory.is_dir():
            logger.warning("no checkpoint directory %s to save PulseLoCo's state into", directory)
            return
        tmp = directory / (STATE_FILE + ".tmp")
        torch.save(self.loco.state_dict(), tmp)
        os.replace(tmp, directory / STATE_FILE)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------------------------
    def _count_round(self, _loco: PulseLoCo, metrics: RoundMetrics | None) -> None:
        if metrics is not None:  # None on processes other than the main one
            with self._rounds_lock:
                self._rounds.add(metrics)

    def _take_log_entries(self) -> dict[str, float]:
        with self._rounds_lock:
            rounds, self._rounds = self._rounds, _RoundTotals()
        return rounds.entries()

    def add_close_hooks(self, before_linger: Any, after_linger: Any) -> None:
        """When training ends, run ``before_linger()`` before this peer lingers (a publisher's flush, so that its
        last version is stored) and ``after_linger()`` after it, while the DHT is still up (closing the
        publisher, which served that version to rollout workers during the linger)."""
        self._before_close.append(before_linger)
        self._after_linger.append(after_linger)

    def close(self) -> None:
        """Run the before-linger hooks, linger, run the after-linger hooks, leave the swarm and stop the DHT
        this callback started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for hook in self._before_close:
            hook()
        if self.loco is not None and self.dht is not None and self.linger > 0:
            time.sleep(self.linger)
        for hook in self._after_linger:
            hook()
        if self.loco is not None:
            self.loco.shutdown()
        if self._owns_dht and self.dht is not None:
            self.dht.shutdown()

    def _resume(self, args: TrainingArguments, state: TrainerState) -> None:
        """Load ``pulseloco.pt`` of the checkpoint the Trainer resumed from."""
        assert self.loco is not None  # noqa: S101 (called right after the PulseLoCo is built)
        resumed = args.resume_from_checkpoint
        if isinstance(resumed, str) and Path(resumed).is_dir():
            directory = Path(resumed)
        else:
            directory = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        path = directory / STATE_FILE
        if not path.is_file():
            raise ConfigError(
                f"resuming at step {state.global_step}, but {path} does not exist: the checkpoint was not saved "
                "by a Trainer with PulseLoCoCallback; start a new output_dir or resume from a checkpoint that has it"
            )
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises many types for a damaged file
            raise ConfigError(f"cannot read {path}: {exc}") from None
        self.loco.load_state_dict(saved)
        logger.info("resumed PulseLoCo round=%d local_step=%d from %s", self.loco.round, self.loco.local_step, path)


class PulseSyncCallback(_LogsContributor):
    """Publishes the Trainer's model to rollout workers with PULSESync.

    Args:
        publisher: a ready :class:`pulseloco.sync.publisher.Publisher` (main process only; ``None`` elsewhere).
            Without one, give ``signing_key``: the callback then makes a publisher on the main process when
            training begins, over the DHT of the :class:`PulseLoCoCallback` on the same Trainer (or ``dht``, or
            one it starts from ``swarm``), and closes it when training ends.
        every: ``"round"`` to publish after every outer round of the :class:`PulseLoCoCallback` driving the same
            model (the consensus ``theta``), or a number of optimizer steps N. With a PulseLoCoCallback and N, the
            consensus is still published after every round (never the pre-averaging weights of a round's last
            step), and between rounds the publishing peer's local weights every N steps.
        signing_key: the publisher's Ed25519 private key, or a path to it (``pulseloco keygen --out PATH``).
        run_id: the PULSESync run (default: ``<PulseLoCo run_id>.policy``).
        store_dir: the version store (default: ``<output_dir>/versions``).
        anchor_every: a full BF16 anchor every this many versions.
        dht, swarm: the DHT to publish on, or how to start one, when there is no PulseLoCoCallback.
        linger: seconds to keep serving after training, when this callback started the DHT.
        metrics_path: append one JSON line per stored version (``version``, ``digest``, ``patch_bytes``,
            ``seconds_publish``, ``announced``: :class:`pulseloco.sync.publisher.PublishedVersion`).
        flush_timeout: seconds to wait at the end for the last version to be encoded and stored.

    Metrics: the Trainer's next log after one or more versions were stored gets (on the main process, the one
    that publishes; ``train/pulsesync/...`` in TensorBoard and W&B):

    * ``pulsesync/version``: the newest version stored;
    * ``pulsesync/num_versions``: the versions this log covers (queued versions superseded before they were
      encoded are not stored and not counted); the sum and mean below are over them;
    * ``pulsesync/patch_bytes``: the sum of their patch sizes (0 for the first, anchor-only version);
    * ``pulsesync/seconds_publish``: the mean, over them, of the seconds from queueing the version (right after
      the optimizer step or outer round it follows) to the end of its announce in the DHT: the publisher's
      wait for the previous version, encoding, signing, store writes and announce.

    The publisher works in the background, so a version usually reaches the log after the one of the step that
    queued it; at the last log of training the callback first waits (``flush_timeout``) for the last version.
    """

    def __init__(
        self,
        publisher: Any | None = None,
        *,
        every: str | int = "round",
        signing_key: Any | None = None,
        run_id: str | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        anchor_every: int = 10,
        dht: Any | None = None,
        swarm: SwarmConfig | None = None,
        linger: float = 0.0,
        metrics_path: str | os.PathLike[str] | None = None,
        flush_timeout: float = 120.0,
    ) -> None:
        if every != "round" and not (isinstance(every, int) and every >= 1):
            raise ConfigError(f"every must be 'round' or a positive number of optimizer steps, got {every!r}")
        if publisher is not None and signing_key is not None:
            raise ConfigError("give publisher= or signing_key=, not both")
        if anchor_every < 1:
            raise ConfigError(f"anchor_every must be >= 1, got {anchor_every}")
        if isinstance(signing_key, str | os.PathLike):
            from pulseloco.sync.signing import load_private_key

            signing_key = load_private_key(signing_key)  # fails here, with a clear message, not mid-training
        self.publisher = publisher
        self.every = every
        self.signing_key = signing_key
        self.run_id = run_id
        self.store_dir = store_dir
        self.anchor_every = anchor_every
        self.dht = dht
        self.swarm = swarm
        self.linger = linger
        self.flush_timeout = flush_timeout
        self.metrics = JsonLinesWriter(metrics_path, stamp=True) if metrics_path is not None else None
        self._model: torch.nn.Module | None = None
        self._owned_dht: Any | None = None
        self._owns_publisher = False
        self._closed = False
        self._attached = False
        self._step = 0
        self._loco: PulseLoCo | None = None  # that of a PulseLoCoCallback on the same model, once attached
        self._round_at_step_begin: tuple[int, int] | None = None  # (round, inner step) when the step began
        #: called with (version, BF16 state) after each version this process publishes (the trainer's own check
        #: of rollouts keeps them: :class:`pulseloco.integrations.verify.VersionStates`)
        self.version_listeners: list[Callable[[int, dict[str, torch.Tensor]], None]] = []
        self._last_published: tuple[int, int] | None = None  # (version, step) of the last version published
        self._versions_lock = threading.Lock()
        self._versions = _VersionTotals()  # stored since the last log

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._run_before_log_readers(warn=True)
        self._model = kwargs.get("model")
        if self._model is None:
            raise ConfigError("PulseSyncCallback needs the Trainer's model (transformers passes it to callbacks)")
        self._step = state.global_step

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Set up at the first step: by then every callback's on_train_begin has run, whatever their order, so a
        # PulseLoCoCallback driving this model exists (and its DHT).
        if not self._attached and self._model is not None:
            self._attach(args)
        if self._loco is not None:
            self._round_at_step_begin = (self._loco.round, self._loco.local_step)

    def _attach(self, args: TrainingArguments) -> None:
        assert self._model is not None  # noqa: S101 (the caller checks)
        self._attached = True
        loco = _CALLBACK_OF_MODEL.get(self._model)
        if loco is not None and loco.loco is None:
            loco = None
        if self.every == "round" and loco is None:
            raise ConfigError(
                "PulseSyncCallback(every='round') needs a PulseLoCoCallback on the same Trainer; without "
                "PULSELoCo, publish every N optimizer steps with every=N"
            )
        if self.publisher is None and self.signing_key is not None:
            self._make_publisher(args, loco)
        if self.publisher is not None:
            self.publisher.add_announce_listener(self._record)
        if loco is not None:
            assert loco.loco is not None  # noqa: S101 (checked above)
            self._loco = loco.loco
            self._loco.add_round_listener(lambda _loco, _metrics: self._publish("round"))
            loco.add_close_hooks(self.flush, self.close)  # serve the last version while the peer lingers
        self._publish("start")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._step = state.global_step
        if not isinstance(self.every, int) or state.global_step % self.every != 0:
            return
        if self._loco is not None and self._round_at_step_begin is not None:
            # A step that ends a round is published by the round listener, after the outer step, whichever of the
            # two callbacks runs first: the round has run already (its number changed) or is about to (this was
            # the round's last inner step). A step the gradient scaler skipped counts as no step for PulseLoCo.
            round_begin, inner_begin = self._round_at_step_begin
            if self._loco.round != round_begin or inner_begin + 1 >= self._loco.inner_steps:
                return
            if getattr(kwargs.get("optimizer"), "step_was_skipped", False):
                return
        self._publish("step")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def flush(self) -> None:
        """Wait (``flush_timeout``) until the last queued version is stored and announced."""
        if self.publisher is None or self._closed:
            return
        try:
            self.publisher.flush(timeout=self.flush_timeout)
        except TimeoutError:
            logger.warning("the last version was still being encoded after %.0f s", self.flush_timeout)

    def close(self) -> None:
        """Flush and, for a publisher this callback made, close it and the DHT it started (after lingering).
        Idempotent."""
        if self._closed or self.publisher is None:
            return
        self.flush()
        self._closed = True
        if self._owns_publisher:
            if self._owned_dht is not None and self.linger > 0:
                time.sleep(self.linger)
            self.publisher.close()
            if self._owned_dht is not None:
                self._owned_dht.shutdown()

    def _make_publisher(self, args: TrainingArguments, loco: PulseLoCoCallback | None) -> None:
        if not PartialState().is_main_process or self.signing_key is None:
            return
        from pulseloco.sync.publisher import Publisher

        dht = self.dht
        if dht is None and loco is not None:
            dht = loco.dht
        if dht is None:
            self._owned_dht = dht = _join_swarm(self.swarm or SwarmConfig())
        run_id = self.run_id or policy_run_id(loco.run_id if loco is not None else "pulseloco")
        store = Path(self.store_dir) if self.store_dir is not None else Path(str(args.output_dir)) / "versions"
        self.publisher = Publisher(dht, run_id, self.signing_key, store, anchor_every=self.anchor_every)
        self._owns_publisher = True
        print(f"pulsesync: publishing run_id={run_id} store={store}", flush=True)

    @property
    def dht_in_use(self) -> Any | None:
        """The DHT the publisher runs on (given, started by this callback, or its PulseLoCoCallback's); None before
        the publisher exists and on processes other than the main one."""
        if self.publisher is None or self.publisher.endpoint is None:
            return None
        return self.publisher.endpoint.dht

    def _record(self, published: PublishedVersion) -> None:
        """The publisher's announce listener (its thread): the JSON line and the totals of the next log."""
        with self._versions_lock:
            self._versions.add(published)
        if self.metrics is not None:
            self.metrics.write(
                event="publish",
                version=published.version,
                digest=published.digest,
                patch_bytes=published.patch_bytes,
                seconds_publish=round(published.seconds, 4),
                announced=published.announced,
            )

    def _take_log_entries(self) -> dict[str, float]:
        with self._versions_lock:
            versions, self._versions = self._versions, _VersionTotals()
        return versions.entries()

    def _before_last_log(self) -> None:
        self.flush()  # the last version (queued by the last step or round) is then in the last log

    def add_version_listener(self, listener: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        """Call ``listener(version, BF16 state)`` after each version this process publishes from now on, and at once
        for the last one when the model has not taken a step since (a version published at train begin)."""
        self.version_listeners.append(listener)
        last = self._last_published
        if last is not None and last[1] == self._step and self._model is not None:
            from pulseloco.sync.publisher import bf16_snapshot

            listener(last[0], bf16_snapshot(self._model))

    def _publish(self, why: str) -> None:
        if self.publisher is None or self._model is None or self._closed:
            return
        version = self.publisher.publish(self._model)
        logger.info("queued version=%d step=%d reason=%s", version, self._step, why)
        self._last_published = (version, self._step)
        if self.version_listeners:
            from pulseloco.sync.publisher import bf16_snapshot

            state = bf16_snapshot(self._model)  # the values the publisher signs as this version
            for listener in self.version_listeners:
                listener(version, state)
