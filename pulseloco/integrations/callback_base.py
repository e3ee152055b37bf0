"""What both pulseloco Trainer callbacks share: a place in the Trainer's logs, joining the swarm on the main
process, and the registry through which a :class:`~pulseloco.integrations.pulsesync.PulseSyncCallback` finds the
:class:`~pulseloco.integrations.trainer.PulseLoCoCallback` of the same model.

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
"""

from __future__ import annotations

import inspect
import logging
import math
import weakref
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from pulseloco.errors import ConfigError, PulseLocoError
from pulseloco.swarm import SwarmConfig

logger = logging.getLogger(__name__)

__all__ = [
    "LogsContributor",
    "RunRollouts",
    "calling_trainer",
    "check_linger",
    "check_rollouts_at_start",
    "join_swarm",
    "loco_callback_of",
    "register_loco_callback",
]


class RunRollouts:
    """Base of a Trainer's ``rollout_func`` that belongs to a swarm run
    (:class:`~pulseloco.integrations.swarm_rollouts.SwarmRollouts`): a callback reads its training ``run_id`` (None
    until known) at train begin without importing it."""

    run_id: str | None = None

    def check_trainer(self, trainer: Any) -> None:
        """Raise :class:`ConfigError` when ``trainer``'s settings are ones this ``rollout_func`` cannot serve; the
        callbacks call it at train begin, so that a bad setting stops training before any step (this base class
        accepts every trainer)."""


_CALLBACK_OF_MODEL: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()
"""The PulseLoCoCallback driving a model, so that a PulseSyncCallback on the same Trainer can find its rounds."""


def check_linger(linger: float) -> float:
    """``linger`` (seconds a callback stays in the swarm after training) when it is a finite number >= 0; raises
    :class:`ConfigError` otherwise."""
    if not (linger >= 0 and math.isfinite(linger)):
        raise ConfigError(f"linger must be >= 0 seconds, got {linger}")
    return linger


def register_loco_callback(model: torch.nn.Module, callback: Any) -> None:
    """Record that ``callback`` (a PulseLoCoCallback) drives ``model`` (held weakly)."""
    _CALLBACK_OF_MODEL[model] = callback


def loco_callback_of(model: torch.nn.Module) -> Any | None:
    """The PulseLoCoCallback driving ``model``, or None."""
    return _CALLBACK_OF_MODEL.get(model)


def join_swarm(config: SwarmConfig) -> Any:
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


def check_rollouts_at_start(callback: TrainerCallback) -> RunRollouts | None:
    """The calling Trainer's pulseloco ``rollout_func`` (None without one), checked against the Trainer
    (:meth:`RunRollouts.check_trainer`: raises :class:`ConfigError` for settings it cannot serve)."""
    trainer = calling_trainer(callback)
    rollouts = getattr(trainer, "rollout_func", None)
    if not isinstance(rollouts, RunRollouts):
        return None
    rollouts.check_trainer(trainer)  # a setting it cannot serve stops training now, not at its first round
    return rollouts


def calling_trainer(callback: TrainerCallback) -> Any | None:
    """The Trainer whose ``CallbackHandler`` is calling one of ``callback``'s events (the caller on the call stack
    whose ``callback_handler`` holds ``callback``: ``Trainer.train`` calls ``on_train_begin`` from its own method),
    so that a callback can see what the Trainer was given (its ``rollout_func``); ``None`` when there is none within
    :data:`_HANDLER_SEARCH_FRAMES` + 2 callers. Never raises."""
    frame = inspect.currentframe()
    try:
        for _ in range(_HANDLER_SEARCH_FRAMES + 2):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            handler = getattr(owner, "callback_handler", None)
            if isinstance(handler, CallbackHandler) and any(cb is callback for cb in handler.callbacks):
                return owner
        return None
    finally:
        del frame


def _reads_logs(callback: Any) -> bool:
    """Whether a callback does something with the logs: it overrides ``on_log`` (the reporting integrations,
    the printer and progress bar, a user's own logger)."""
    return getattr(type(callback), "on_log", None) is not TrainerCallback.on_log


def _before_log_readers(callbacks: list[Any]) -> list[Any] | None:
    """``callbacks`` with every :class:`LogsContributor` moved, in their order, to just before the first other
    callback that reads the logs; ``None`` when they all come before it already (or nothing reads the logs)."""
    ours = [i for i, cb in enumerate(callbacks) if isinstance(cb, LogsContributor)]
    readers = [i for i, cb in enumerate(callbacks) if not isinstance(cb, LogsContributor) and _reads_logs(cb)]
    if not ours or not readers or max(ours) < readers[0]:
        return None
    contributors = [callbacks[i] for i in ours]
    others = [cb for cb in callbacks if not isinstance(cb, LogsContributor)]
    first = next(i for i, cb in enumerate(others) if _reads_logs(cb))
    return others[:first] + contributors + others[first:]


class LogsContributor(TrainerCallback):
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
