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

Metrics: both callbacks add their numbers to the Trainer's own logs (``report_to``); see
:mod:`pulseloco.integrations.callback_base`. :class:`PulseSyncCallback` lives in
:mod:`pulseloco.integrations.pulsesync`.

Failure behaviour: bad arguments raise :class:`~pulseloco.errors.ConfigError` at construction; a swarm that cannot
be joined raises :class:`~pulseloco.errors.SwarmUnreachableError` on every process at the start of training;
resuming from a checkpoint without ``pulseloco.pt`` raises :class:`~pulseloco.errors.ConfigError` before any step.
The swarm itself never fails a step (see :class:`pulseloco.PulseLoCo`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from pulseloco.errors import ConfigError
from pulseloco.integrations.callback_base import (
    LogsContributor,
    check_linger,
    check_rollouts_at_start,
    join_swarm,
    register_loco_callback,
)
from pulseloco.keys import check_run_id
from pulseloco.loco.config import AveragingConfig, PlacementConfig, RoundConfig
from pulseloco.loco.metrics import RoundMetrics
from pulseloco.loco.optimizer import PulseLoCo
from pulseloco.swarm import SwarmConfig

logger = logging.getLogger(__name__)

__all__ = ["STATE_FILE", "PulseLoCoCallback", "check_round_boundary"]

STATE_FILE = "pulseloco.pt"
"""PulseLoCo's state (theta, residual, outer momentum, counters) inside each Trainer checkpoint directory."""


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


@dataclass
class _RoundTotals:
    """The outer rounds since the last log."""

    num_rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    num_sent: int = 0
    numel: int = 0
    seconds_sync: float = 0.0
    seconds_blocked: float = 0.0
    repaired: int = 0
    last: RoundMetrics | None = None

    def add(self, metrics: RoundMetrics) -> None:
        self.num_rounds += 1
        self.bytes_sent += metrics.bytes_sent
        self.bytes_received += metrics.bytes_received
        self.num_sent += metrics.num_sent
        self.numel += metrics.numel
        self.seconds_sync += metrics.seconds_sync
        self.seconds_blocked += metrics.seconds_blocked
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
            "pulseloco/seconds_blocked": self.seconds_blocked,
            "pulseloco/repaired": self.repaired,
        }


class PulseLoCoCallback(LogsContributor):
    """Turns the Trainer it is given to into a PULSELoCo peer.

    Args (keyword-only):
        dht: a running ``hivemind.DHT`` to use (on the main process; ignored elsewhere). Without one, the
            callback starts its own on the main process from ``swarm`` (or ``initial_peers``) when training
            begins, and shuts it down when training ends.
        swarm: how to join (:class:`pulseloco.swarm.SwarmConfig`: initial peers, listen addresses, client mode,
            identity, swarm key).
        initial_peers: shorthand for ``swarm=SwarmConfig(initial_peers=...)``; none starts a new swarm.
        run_id, round_config, averaging_config, placement_config, metrics_path: as :class:`pulseloco.PulseLoCo`
            (the settings in :mod:`pulseloco.loco.config`: ``RoundConfig(inner_steps=8, selector="pulse", ...)``,
            ``AveragingConfig(matchmaking_time=..., ...)``, ``PlacementConfig(...)``).
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
    * ``pulseloco/seconds_sync``: the sum of ``seconds_sync`` (wall time of the outer steps; with
      ``RoundConfig.overlap`` they run in the background);
    * ``pulseloco/seconds_blocked``: the sum of ``seconds_blocked`` (how long training waited for the swarm);
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
        round_config: RoundConfig | None = None,
        averaging_config: AveragingConfig | None = None,
        placement_config: PlacementConfig | None = None,
        metrics_path: str | os.PathLike[str] | None = None,
        linger: float = 0.0,
    ) -> None:
        if swarm is not None and initial_peers is not None:
            raise ConfigError("give swarm= or initial_peers=, not both")
        self.swarm = swarm if swarm is not None else SwarmConfig(initial_peers=list(initial_peers or []))
        self.run_id = check_run_id(run_id)
        self.round_config = round_config or RoundConfig()
        self.averaging_config = averaging_config or AveragingConfig()
        self.placement_config = placement_config or PlacementConfig()
        self.metrics_path = metrics_path
        self.linger = check_linger(linger)
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
        check_round_boundary(state.max_steps, self.round_config.inner_steps)
        check_rollouts_at_start(self)
        if self._owns_dht:
            self.dht = join_swarm(self.swarm)
        elif not PartialState().is_main_process:
            self.dht = None
        self.loco = PulseLoCo(
            model,
            None,
            dht=self.dht,
            run_id=self.run_id,
            round_config=self.round_config,
            averaging_config=self.averaging_config,
            placement_config=self.placement_config,
            metrics_path=self.metrics_path,
        )
        self.loco.add_round_listener(self._count_round)
        register_loco_callback(model, self)
        if state.global_step > 0:
            self._resume(args, state)
        if self.loco.peer_id is not None:
            print(
                f"pulseloco: peer_id={self.loco.peer_id} run_id={self.run_id} selector={self.round_config.selector} "
                f"inner_steps={self.round_config.inner_steps} round={self.loco.round}",
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
        if self.loco is not None:
            self.loco.finish()  # an overlapped round in flight lands: the model holds the swarm's theta
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
