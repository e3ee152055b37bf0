"""PulseLoCo: DiLoCo-style outer optimization with compute-visible sparse pseudo-gradients over a hivemind swarm.

    opt = PulseLoCo(model, inner_optimizer, dht=dht, run_id="run",
                    round_config=RoundConfig(inner_steps=8, selector="pulse"))   # or "dense", "sparseloco"
    loss.backward(); opt.step(); opt.zero_grad()

A training loop that steps its own optimizer (a ``transformers.Trainer``) passes ``inner_optimizer=None`` and calls
:meth:`PulseLoCo.count_inner_step` after each optimizer step instead; :class:`pulseloco.integrations.PulseLoCoCallback`
does exactly that. Both run the same round.

Every ``inner_steps`` calls to :meth:`PulseLoCo.step` run one outer round (docs/design.md section 2), in named
phases: pseudo-gradient (``theta - theta_local``) and signal (``error_decay * residual + pseudo_gradient``);
catch up (download the state if the swarm is ahead); select (pulse / dense / sparseloco, with error feedback);
average over the swarm (:class:`~pulseloco.loco.averaging.SparseAverager`); return undelivered entries to the
residual; outer step (Nesterov, or plain SGD for SparseLoCo); check the digest against the swarm's majority and
repair; reset the local model to ``theta``. Entries a shard counted at a clip scale below 1
(:mod:`pulseloco.loco.robust`) give back to the residual exactly what the scale clipped off. With
``RoundConfig(overlap=True)`` the round after the pseudo-gradient runs in the background during the next round's
inner steps and lands one round late (docs/design.md 2.6); :meth:`PulseLoCo.finish` lands the last one.

Failure behaviour: the swarm never makes :meth:`step` raise. A round whose group cannot be formed or whose
averaging times out keeps every unsent or undelivered entry in the residual and leaves ``theta`` unchanged
where nothing arrived; a peer that ends a round with a digest other than the majority's, or behind the others,
downloads the state from a peer. Waits are bounded by ``matchmaking_time``, ``averaging_timeout`` and
``request_timeout`` (see :class:`PulseLoCo`). Bad configuration raises :class:`~pulseloco.errors.ConfigError`
at construction.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypedDict

import torch
from hivemind.utils import get_dht_time

from pulseloco.codec import FrameHeader
from pulseloco.errors import ConfigError, StateDownloadError, TensorMismatchError
from pulseloco.jsonl import JsonLinesWriter
from pulseloco.keys import check_run_id
from pulseloco.loco.averaging import AllReduceResult, SparseAverager, payload_frame
from pulseloco.loco.config import AveragingConfig, PlacementConfig, RoundConfig
from pulseloco.loco.consensus import distrusted, repair_target
from pulseloco.loco.ledger import Ledger, LedgerEntry, Pending
from pulseloco.loco.matchmaking import Matchmaker
from pulseloco.loco.metrics import RoundMetrics
from pulseloco.loco.outer import NesterovOuterOptimizer
from pulseloco.loco.peers import PeerState, RoundRecord
from pulseloco.loco.placement import OuterPlacement, process_group
from pulseloco.loco.quantize import ParamLayout
from pulseloco.loco.reduce import ReduceSpec
from pulseloco.loco.robust import clip_split
from pulseloco.loco.selection import select_in_place
from pulseloco.loco.state import StateSnapshot
from pulseloco.loco.validation import theta_digest
from pulseloco.memory import release_freed_memory
from pulseloco.swarm import is_reachable

logger = logging.getLogger(__name__)

__all__ = ["PulseLoCo"]

_NO_OVERFLOW_BOUND = 2.0**103
"""Local parameters below this in magnitude cannot make ``theta - local`` overflow for any finite FP32 ``theta``:
``|theta| <= 2**128 - 2**104``, and FP32 rounds to infinity only from ``2**128 - 2**103`` up."""


class _ByteSplit(TypedDict, total=False):
    """The byte accounting fields of :class:`RoundMetrics` (see there)."""

    payload_bytes: int
    payload_index_bytes: int
    payload_value_bytes: int
    sent_index_bytes: int
    sent_value_bytes: int
    sent_sum_bytes: int
    sent_sum_index_bytes: int
    sent_sum_value_bytes: int
    sent_header_bytes: int
    num_pushed: int
    num_sum_entries: int


def _byte_split(result: AllReduceResult | None, payload: FrameHeader | None) -> _ByteSplit:
    """The byte accounting fields of :class:`RoundMetrics`: from the averaging ``result``, else (no swarm, or
    the round sat out: ``payload`` None) only the payload's sizes (nothing was sent)."""
    if result is None:
        return {
            "payload_bytes": payload.total_bytes if payload is not None else 0,
            "payload_index_bytes": payload.index_bytes if payload is not None else 0,
            "payload_value_bytes": payload.value_bytes if payload is not None else 0,
        }
    return {
        "payload_bytes": result.payload_bytes,
        "payload_index_bytes": result.payload_index_bytes,
        "payload_value_bytes": result.payload_value_bytes,
        "sent_index_bytes": result.sent_index_bytes,
        "sent_value_bytes": result.sent_value_bytes,
        "sent_sum_bytes": result.sent_sum_index_bytes + result.sent_sum_value_bytes,
        "sent_sum_index_bytes": result.sent_sum_index_bytes,
        "sent_sum_value_bytes": result.sent_sum_value_bytes,
        "sent_header_bytes": result.sent_header_bytes,
        "num_pushed": result.num_pushed,
        "num_sum_entries": result.num_sum_entries,
    }


class PulseLoCo:
    """Wraps a model's trainable parameters and its ``inner_optimizer`` (any ``torch.optim.Optimizer``).

    Args (all but the first two are keyword-only):
        model: the local model; its trainable parameters (in ``model.parameters()`` order, tied parameters
            once) form the flat parameter space.
        inner_optimizer: steps the local model; its state is kept across rounds (as in DiLoCo). ``None`` when
            the caller steps its own optimizer and reports each step with :meth:`count_inner_step`.
        dht: a running ``hivemind.DHT``, or ``None`` to train alone (each round averages over one peer).
        run_id: peers with the same ``run_id`` average together; a prefix of every DHT key.
        round_config: what a round does (:class:`~pulseloco.loco.config.RoundConfig`: ``inner_steps`` H, the
            ``selector`` -- ``"pulse"``, ``"dense"`` (DiLoCo) or ``"sparseloco"`` -- and its settings, the outer
            ``outer_lr`` and ``outer_momentum``, ``error_decay`` and ``mean_over``); default ``RoundConfig()``.
        averaging_config: how a round meets the swarm and how long each wait may take
            (:class:`~pulseloco.loco.config.AveragingConfig`: ``matchmaking_time``, ``target_group_size``,
            ``averaging_timeout`` -- a peer gone mid-round delays the others by at most this --,
            ``request_timeout``, ``digest_timeout``, ``max_norm_ratio``, ``num_download_retries``, and the robust
            aggregation of a shard owner: ``clip_to_median``, ``dispute_norm_ratio``, ``dispute_rounds``, and its
            ``exchange``: ``auto`` gathers the parts of quantized selections and sums the others).
        placement_config: where the outer state (``theta``, the residual and the outer momentum: flat FP32, 12
            bytes a parameter) lives and the chunk size of the round's chunked phases
            (:class:`~pulseloco.loco.config.PlacementConfig`). ``outer_state_device="auto"`` (default) and
            ``"cpu"``: host memory, pinned when the model is on a CUDA GPU (so that the chunked copies to and
            from the GPU run asynchronously); ``"model"``: the model's CUDA device (host memory for a model on
            the CPU). Either way the results are bit-identical. The temporaries of the chunked phases are
            bounded by a few chunks of ``outer_chunk_bytes`` (plus the selected entries), not by the model.
        client_mode: join without serving shards or state (behind NAT); default: whether the DHT is unreachable
            (:func:`pulseloco.swarm.is_reachable`: client mode without a relay address).
        metrics_path: append one JSON line per outer round (:class:`~pulseloco.loco.metrics.RoundMetrics`).

    Memory: beside the model, the outer state (12 bytes a parameter, where ``outer_state_device`` says), two
    staging chunks, and during a round temporaries of a few chunks plus the selected entries (indices and
    values: 12 bytes each, all entries for ``dense``). With a swarm, the ledger keeps the parts this peer sent in
    its last ``ledger_rounds`` rounds, at their size on the wire (about 4 bytes per FP32 entry sent). An outer
    state that does not fit raises :class:`ConfigError` at construction (out of GPU memory, or of pinned host memory).

    With ``torch.distributed`` initialized and several processes (``accelerate launch``), only rank 0 joins
    the swarm (``dht`` is ignored elsewhere); the other ranks receive ``theta`` by broadcast at construction and
    after every round, so every rank must call :meth:`step` the same number of times.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer | None,
        *,
        dht: Any | None = None,
        run_id: str = "pulseloco",
        round_config: RoundConfig | None = None,
        averaging_config: AveragingConfig | None = None,
        placement_config: PlacementConfig | None = None,
        client_mode: bool | None = None,
        metrics_path: str | os.PathLike[str] | None = None,
    ) -> None:
        check_run_id(run_id)
        rounds = round_config or RoundConfig()
        averaging = averaging_config or AveragingConfig()
        placement = placement_config or PlacementConfig()
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("model has no trainable parameters")
        self.numel = sum(p.numel() for p in self.params)
        self.inner_steps = rounds.inner_steps
        self.layout = ParamLayout([tuple(p.shape) for p in self.params])
        self.selector = rounds.make_selector(self.layout)
        self.outer_optimizer = rounds.make_outer_optimizer()
        self.error_decay = float(rounds.resolved("error_decay"))
        self.overlap = rounds.overlap
        self._group_starts = self.layout.group_starts()
        reduce_spec = ReduceSpec(
            self.layout,
            chunk=rounds.chunk_size,
            k=rounds.topk_k if rounds.selector == "sparseloco" else rounds.pulse_budget,
            value_dtype=str(getattr(self.selector, "values", "float32")),
            bits=rounds.quant_bits,
            factor=float(averaging.exchange_budget),
        )
        self.placement = OuterPlacement(self.params, placement.outer_state_device, placement.outer_chunk_bytes // 4)
        self.theta_N = self.placement.flatten_local("theta")
        self.residual_N = self.placement.empty("residual").zero_()
        self.round = 0
        self.local_step = 0
        self.num_boundaries = 0
        """Round boundaries this instance passed (phases of ``inner_steps`` trained), on every process: unlike
        ``round``, neither a repair nor a background round moves it (not saved by :meth:`state_dict`)."""
        self.digest_timeout = averaging.digest_seconds
        self.num_download_retries = averaging.num_download_retries
        self.metrics_writer = JsonLinesWriter(metrics_path) if metrics_path is not None else None
        self.last_metrics: RoundMetrics | None = None
        self._losses: list[float] = []
        self._round_start = time.monotonic()
        self._round_listeners: list[Callable[[PulseLoCo, RoundMetrics | None], None]] = []
        self._rounds_alone = 0
        self.is_main_process = process_group()[1] == 0
        self.averager: SparseAverager | None = None
        self.matchmaker: Matchmaker | None = None
        self.ledger = Ledger("")
        self._num_reconciled = 0
        self._num_clipped = 0
        self._seconds_matchmaking = self._seconds_exchange = 0.0  # this round's, for RoundMetrics
        self._complete = True
        # RoundConfig.overlap: the round in flight (on every rank; the future on the main process only), the local
        # model's start of the current inner phase and the pseudo-gradient handed to the background round.
        self._in_flight = False
        self._future: Future[RoundMetrics] | None = None
        self._finished: RoundMetrics | None = None  # a background round waited for before its boundary
        self._executor: ThreadPoolExecutor | None = None
        self._start_N: torch.Tensor | None = None
        self._delta_N: torch.Tensor | None = None
        # Overlap, one process: how late this peer registered for the round in flight (set by the background round
        # when the registration had closed), and the inner steps of the current phase (shortened to realign).
        self._late_by: float | None = None
        self._phase_steps = self.inner_steps
        if dht is not None and self.is_main_process:
            if client_mode is None:  # a client-mode DHT holding a relay address can own shards through the relay
                client_mode = not is_reachable(dht)
            self.averager = SparseAverager(
                dht,
                run_id=run_id,
                numel=self.numel,
                client_mode=client_mode,
                averaging_timeout=averaging.averaging_timeout,
                request_timeout=averaging.request_timeout,
                max_norm_ratio=averaging.max_norm_ratio,
                clip_to_median=averaging.clip_to_median,
                dispute_norm_ratio=averaging.dispute_norm_ratio,
                dispute_rounds=averaging.dispute_rounds,
                exchange=averaging.exchange,
                mean_over=rounds.resolved("mean_over"),
                reduce_spec=reduce_spec,
            )
            self.matchmaker = Matchmaker(
                dht,
                run_id=run_id,
                peer_id=self.averager.peer_id,
                client_mode=client_mode,
                matchmaking_time=averaging.matchmaking_time,
                target_group_size=averaging.target_group_size,
                close_when_expected=averaging.close_when_expected,
                request_timeout=averaging.request_timeout,
            )
            self.ledger = Ledger(self.averager.peer_id, keep_rounds=averaging.ledger_rounds)
            self._catch_up()
            self._publish()
        self.placement.broadcast(self.theta_N)
        self.placement.load_into_model(self.theta_N)
        if self.overlap:
            self._start_N = self.placement.flatten_local("phase start")
            self._delta_N = self.placement.empty("pseudo-gradient in flight")
            if self.is_main_process:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pulseloco-round")

    # -- public API -------------------------------------------------------------------------------------------
    @property
    def peer_id(self) -> str | None:
        """This peer's id in the swarm (``None`` without a DHT)."""
        return None if self.averager is None else self.averager.peer_id

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the inner optimizer's gradients."""
        self._require_inner_optimizer("zero_grad").zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, *, loss: float | torch.Tensor | None = None) -> Any:
        """One inner step; every ``inner_steps``-th call also runs an outer round.

        ``closure`` is passed to the inner optimizer as in ``torch.optim``; ``loss`` (or the closure's result)
        is averaged into the round's metrics. Raises :class:`RuntimeError` without an inner optimizer.
        """
        optimizer = self._require_inner_optimizer("step")
        result = optimizer.step(closure) if closure is not None else optimizer.step()
        self.count_inner_step(result if loss is None else loss)
        return result

    def count_inner_step(self, loss: float | torch.Tensor | None = None) -> RoundMetrics | None:
        """Record one inner optimizer step taken by the caller; every ``inner_steps``-th call runs the outer round
        and returns its metrics (on the main process; ``None`` otherwise and between rounds).

        For loops that step their own optimizer (a ``transformers.Trainer``): call it once per *applied*
        optimizer step, after the step, so that gradient accumulation and skipped steps count as the optimizer
        saw them. Every process of a ``torch.distributed`` group must call it the same number of times.
        """
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach())
        if isinstance(loss, float | int):
            self._losses.append(float(loss))
        self.local_step += 1
        if self._late_by is not None:
            self._realign()
        if self.local_step >= self._phase_steps:
            self.outer_step()
            return self.last_metrics if self.is_main_process else None
        return None

    @property
    def phase_steps(self) -> int:
        """Inner steps of the current phase: ``inner_steps``, or fewer for one phase after this peer registered too
        late for a round with ``RoundConfig.overlap`` (:meth:`_realign`)."""
        return self._phase_steps

    def _realign(self) -> None:
        """Main thread, overlap, one process: the round in flight was sat out because this peer registered
        ``_late_by`` seconds after its registration closed (0 when the others agreed on a group without it: its
        registration reached them after they went; a joiner that downloaded the state at its boundary, in a
        16-peer WAN run). Its boundaries keep that offset from the others' (no
        boundary waits for the swarm with overlap), so it would miss every round; end the current phase early
        instead, by that lateness plus half of ``matchmaking_time`` at this phase's pace, so that the next
        registration comes inside the others' window (at least the steps already taken; at least one)."""
        late_by, self._late_by = self._late_by, None
        if late_by is None or self.matchmaker is None:
            return
        step_seconds = (time.monotonic() - self._round_start) / max(1, self.local_step)
        cut = math.ceil((late_by + self.matchmaker.matchmaking_time / 2) / max(step_seconds, 1e-3))
        self._phase_steps = max(self.local_step, self.inner_steps - cut, 1)
        logger.info(
            "round=%d: %s; this phase ends after %d of %d inner steps so that the next registration comes in time",
            self.round,
            f"registered {late_by:.1f}s after the registration closed" if late_by > 0 else "seen too late",
            self._phase_steps,
            self.inner_steps,
        )

    def add_round_listener(self, listener: Callable[[PulseLoCo, RoundMetrics | None], None]) -> None:
        """Call ``listener(self, metrics)`` on every process after each outer round, once the local model holds
        the new ``theta`` (``metrics`` is ``None`` on processes other than the main one). With
        ``RoundConfig.overlap``: when the round lands (at the next boundary, or in :meth:`finish`); the local model
        then holds the next phase's start, ``theta`` minus this peer's last pseudo-gradient (docs/design.md 2.6).
        A listener that raises propagates out of :meth:`step` / :meth:`count_inner_step`."""
        self._round_listeners.append(listener)

    def _require_inner_optimizer(self, what: str) -> torch.optim.Optimizer:
        if self.inner_optimizer is None:
            raise RuntimeError(
                f"PulseLoCo.{what}() needs an inner optimizer; this instance was built with inner_optimizer=None, "
                "so step your optimizer yourself and call count_inner_step() after each step"
            )
        return self.inner_optimizer

    def outer_step(self) -> RoundMetrics | None:
        """Run one outer round now (``step`` calls this every ``inner_steps`` inner steps). Returns its metrics
        on the main process; with ``RoundConfig.overlap`` it starts this round in the background and returns the
        metrics of the previous round, which it waits for (``None`` at the first boundary). An exception of a
        background round propagates from here."""
        start = time.monotonic()
        seconds_inner = start - self._round_start
        loss = sum(self._losses) / len(self._losses) if self._losses else None
        landed = True  # a round's outer step reached theta at this boundary (the same on every rank)
        if self.overlap:
            landed = self._in_flight
            metrics = self._overlapped_boundary(seconds_inner, start, loss)
        else:
            metrics = None
            if not self.is_main_process:
                self.round += 1
            else:
                metrics = self._outer_round(seconds_inner, start, loss)
            self.placement.broadcast(self.theta_N)
            self.placement.load_into_model(self.theta_N)
            if metrics is not None:
                metrics = self._report(dataclasses.replace(metrics, seconds_blocked=time.monotonic() - start))
        release_freed_memory()  # the round's model-sized buffers, which the allocator would keep otherwise
        self.local_step = 0
        self._phase_steps = self.inner_steps
        self.num_boundaries += 1
        self._losses = []
        self._round_start = time.monotonic()
        if landed:
            for listener in self._round_listeners:
                listener(self, metrics)
        return metrics

    def finish(self) -> RoundMetrics | None:
        """With ``RoundConfig.overlap``: wait for the round in flight, apply it and, between rounds, load the new
        ``theta`` into the model (the local model then holds the swarm's state, as after a blocking round);
        returns that round's metrics and calls the round listeners with them. Call it on every process when
        training ends (the Trainer callback does). Nothing to do (``None``) without overlap or a round in flight.
        An exception of the background round propagates from here."""
        if not self.overlap or not self._in_flight:
            return None
        start = time.monotonic()
        metrics = self._land_round()
        start_N, delta_N = self._start_N, self._delta_N
        assert start_N is not None and delta_N is not None  # noqa: S101 (set with overlap)
        if self.local_step == 0:
            start_N.copy_(self.theta_N)
            self.placement.load_into_model(self.theta_N)
        else:  # mid-phase (a phase shortened to realign): the landed theta plus this phase's own progress since
            with torch.no_grad():
                for lo, hi, local_chunk in self.placement.local_chunks():
                    torch.sub(local_chunk, start_N[lo:hi], out=delta_N[lo:hi])
                for lo, hi in self.placement.chunk_ranges():
                    delta_N[lo:hi].add_(self.theta_N[lo:hi])
                    start_N[lo:hi].copy_(self.theta_N[lo:hi])
                self.placement.load_into_model(delta_N)
        if metrics is not None:
            metrics = self._report(dataclasses.replace(metrics, seconds_blocked=time.monotonic() - start))
        for listener in self._round_listeners:
            listener(self, metrics)
        return metrics

    def catch_up(self) -> bool:
        """Adopt the swarm's state if other peers are past this one, or if this peer's ``theta`` is not the
        majority's at its round: a peer that fell behind then ends where the swarm is. A peer alone at a round
        ahead of all the others (it averaged a last round alone after they stopped) goes back to the round most of
        them hold (``repair_target(step_back=True)``, docs/design.md 4.5), so call it once the swarm has stopped
        training, for example at an end barrier before saving the final model. Its contributions that the adopted
        state did not count go back to its residual (the ledger), so nothing is lost. Call it between rounds on
        every process (after :meth:`finish` with overlap); the model then holds ``theta``.
        Returns whether the state was replaced (on the main process). Raises ``RuntimeError`` mid-phase or with a
        round in flight; a failed download is logged and the peer keeps its own state (``False``)."""
        if self.local_step != 0 or self._in_flight:
            raise RuntimeError(
                "PulseLoCo.catch_up() runs between rounds: call it at a round boundary (after finish() with "
                f"RoundConfig.overlap); now local_step={self.local_step}, round in flight={self._in_flight}"
            )
        replaced = self._catch_up(step_back=True) if self.is_main_process else False
        self.placement.broadcast(self.theta_N)
        self.placement.load_into_model(self.theta_N)
        if self._start_N is not None:
            self._start_N.copy_(self.theta_N)
        return replaced

    def reset_outer_momentum(self) -> None:
        """Zero the outer optimizer's momentum, for a change of training phase (for example from a supervised
        warm-up at a pretraining learning rate to RL, whose pseudo-gradients are hundreds of times smaller and
        would otherwise be swamped by the warm-up's momentum for dozens of rounds).

        Every peer must call it at the same round boundary, so ``theta`` stays identical across the swarm.
        Raises :class:`RuntimeError` in the middle of a round.
        """
        if self.local_step != 0:
            raise RuntimeError(f"reset_outer_momentum in the middle of a round (inner step {self.local_step})")
        self._wait_background()  # the round in flight steps with the momentum it had
        if self.outer_optimizer.momentum_N is not None:
            self._withdraw_snapshot()
            self.outer_optimizer.momentum_N.zero_()
            self._serve_snapshot()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: global parameters, outer optimizer (momentum), residual, inner
        optimizer (when this instance owns one), round and inner-step counters. Saved between rounds, the model
        itself is ``theta``; saved mid-round, also save ``model.state_dict()``. With ``RoundConfig.overlap`` it
        first waits for the round in flight (its metrics are still delivered at the next boundary) and also saves
        ``start_N``, where the local model began the current inner phase (the model itself between rounds)."""
        self._wait_background()
        state = {
            "round": self.round,
            "local_step": self.local_step,
            "selector": self.selector.name,
            "theta_N": self.theta_N.detach().clone(),
            "residual_N": self.residual_N.detach().clone(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }
        if self.inner_optimizer is not None:
            state["inner_optimizer"] = self.inner_optimizer.state_dict()
        if self._start_N is not None:
            state["start_N"] = self._start_N.detach().clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` and, between rounds, reset the model to the restored ``theta``.

        Raises :class:`TensorMismatchError` (a :class:`ValueError`) for tensors of the wrong size or dtype and
        :class:`ConfigError` for a missing entry, another selector, or an overlapped state saved mid-round into a
        blocking ``PulseLoCo`` (its inner steps did not start from ``theta``), before changing anything. A round
        still in flight here is waited for and dropped with the state it belonged to.
        """
        required = ["round", "local_step", "theta_N", "residual_N", "outer_optimizer"]
        if self.inner_optimizer is not None:
            required.append("inner_optimizer")
        for key in required:
            if key not in state:
                raise ConfigError(f"state_dict lacks {key!r}")
        if state.get("selector", self.selector.name) != self.selector.name:
            raise ConfigError(
                f"state_dict was saved with selector {state['selector']!r}, this PulseLoCo uses {self.selector.name!r}"
            )
        keys = ("theta_N", "residual_N", "start_N") if "start_N" in state else ("theta_N", "residual_N")
        for key in keys:
            tensor = state[key]
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or tensor.shape != (self.numel,):
                raise TensorMismatchError(f"state_dict[{key!r}] must be a flat FP32 tensor of {self.numel} entries")
        mid_round = "start_N" in state and not self.overlap and int(state["local_step"]) != 0
        if mid_round and not torch.equal(state["start_N"], state["theta_N"]):
            raise ConfigError(
                "state_dict was saved mid-round with overlap=True (its inner steps started from its own "
                "theta-minus-pseudo-gradient, not theta); resume it with RoundConfig(overlap=True), or from a "
                "checkpoint saved between rounds"
            )
        outer = NesterovOuterOptimizer(self.outer_optimizer.lr, self.outer_optimizer.momentum)
        outer.load_state_dict(state["outer_optimizer"], numel=self.numel)
        if self.inner_optimizer is not None:
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self._wait_background()
        self._finished, self._in_flight = None, False
        self.outer_optimizer = outer
        self.round = int(state["round"])
        self.local_step = int(state["local_step"])
        self.theta_N = self.placement.place(state["theta_N"], "theta")
        self.residual_N = self.placement.place(state["residual_N"], "residual")
        if self.outer_optimizer.momentum_N is not None:
            self.outer_optimizer.momentum_N = self.placement.place(self.outer_optimizer.momentum_N, "momentum")
        if self._start_N is not None:
            self._start_N = self.placement.place(state.get("start_N", state["theta_N"]), "phase start")
        if self.local_step == 0:
            self.placement.load_into_model(self.theta_N if self._start_N is None else self._start_N)
        if self.averager is not None:
            self._publish()

    def shutdown(self) -> None:
        """Leave the swarm (the DHT stays up: it belongs to the caller). A round still in flight
        (``RoundConfig.overlap``) is waited for first; call :meth:`finish` before to also apply it to the model."""
        try:
            self._wait_background()
        except Exception:  # the round's own failure was already its caller's to see; leaving must go on
            logger.exception("the round in flight failed while leaving the swarm")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
            self.matchmaker = None

    def _zeros_momentum(self) -> None:
        """Create the outer momentum (zeros) in the outer state's memory before the first outer step."""
        if self.outer_optimizer.momentum_N is None:
            self.outer_optimizer.momentum_N = self.placement.empty("momentum").zero_()

    def _warn_if_alone(self, metrics: RoundMetrics) -> None:
        """Say so when rounds average over this peer alone (a wrong ``run_id`` or ``initial_peers`` looks
        exactly like this: every round waits ``matchmaking_time`` and sends nothing)."""
        if self.matchmaker is None or metrics.num_peers != 1 or self.matchmaker.target_group_size == 1:
            self._rounds_alone = 0
            return
        self._rounds_alone += 1
        if self._rounds_alone in (1, 10) or self._rounds_alone % 100 == 0:
            logger.warning(
                "round=%d: no other peer of run_id=%r joined (%d round(s) alone in a row); this peer averages "
                "with itself and sends nothing. Check that the other peers use the same run_id and reach one of "
                "your initial peers; to train alone without the %.0f s wait per round, set target_group_size=1",
                metrics.round,
                self.matchmaker.run_id,
                self._rounds_alone,
                self.matchmaker.matchmaking_time,
            )

    # -- phases -----------------------------------------------------------------------------------------------

    def _withdraw_snapshot(self) -> None:
        """Stop serving the state before ``theta`` or the momentum change in place (the snapshot shares them);
        returns once no request is reading them. Peers asking meanwhile are refused and try another peer."""
        if self.averager is not None:
            self.averager.set_snapshot(None)

    def _publish(self) -> None:
        """Announce (round, digest) and serve the current state. The snapshot shares ``theta_N`` and the
        momentum with this optimizer (no copy: 8 bytes a parameter saved); :meth:`_withdraw_snapshot` runs
        before any in-place change of them."""
        if self.averager is None or self.matchmaker is None:
            return
        digest = self._serve_snapshot()
        self.matchmaker.publish_state(self.round, digest, self._complete, self.averager.distrusted_peers())

    def _record_round(self, round_index: int, num_peers: int, result: AllReduceResult | None) -> None:
        """Keep the round's group size, contributors and bytes for the state records (monitors read them; the
        same numbers as the round's :class:`RoundMetrics`)."""
        if self.matchmaker is None:
            return
        sent, received = (result.bytes_sent, result.bytes_received) if result is not None else (0, 0)
        contributors = result.num_contributors if result is not None else 0
        self.matchmaker.record_round(RoundRecord(round_index, num_peers, contributors, sent, received))

    def _serve_snapshot(self) -> str:
        """Serve the current state (sharing its tensors, see :meth:`_publish`); returns theta's digest."""
        digest = theta_digest(self.theta_N)
        momentum = self.outer_optimizer.momentum_N
        if self.averager is None:
            return digest
        self.averager.set_snapshot(
            StateSnapshot(
                round=self.round,
                digest=digest,
                theta_N=self.theta_N.detach(),
                momentum_N=None if momentum is None else momentum.detach(),
                ledger=dict(self.ledger.entries),
            )
        )
        return digest

    def _catch_up(self, states: list[PeerState] | None = None, *, step_back: bool = False) -> bool:
        """Download the state if server-mode peers are ahead, or if this peer's digest is not the majority's
        at its own round (with ``step_back``, also if it is alone ahead of them: :func:`repair_target`). Returns
        True if the state was replaced; a failed download is logged and the peer goes on with its own state (the
        next round retries)."""
        if self.averager is None or self.matchmaker is None:
            return False
        if states is None:
            states = self.matchmaker.read_states()
        own_digest = theta_digest(self.theta_N)
        disputed = self.averager.distrusted_peers()
        own = PeerState(str(self.peer_id), self.round, own_digest, self.averager.client_mode, self._complete, disputed)
        distrust = distrusted(states) | set(disputed)
        distrust.discard(own.peer_id)
        states = [s for s in states if s.peer_id not in distrust]
        wanted = repair_target(states, own, step_back=step_back)
        if wanted is None:
            return False
        logger.info("repairing state round=%d digest=%s target=%s", self.round, own_digest, wanted)
        try:
            snapshot = self.averager.download_state(states, wanted, num_retries=self.num_download_retries)
        except StateDownloadError as exc:
            logger.warning("state repair failed, keeping own state: %s", exc)
            return False
        # New tensors, never in place: the round that called this still needs the theta it started from.
        self.theta_N = self.placement.place(snapshot.theta_N, "theta")
        if snapshot.momentum_N is not None:
            self.outer_optimizer.momentum_N = self.placement.place(snapshot.momentum_N, "momentum")
        self.round = snapshot.round
        self._complete = True  # the swarm's majority state
        self._num_reconciled += self.ledger.reconcile(snapshot.ledger, snapshot.round, self.residual_N)
        self._publish()
        return True

    def _pseudo_gradient_is_finite(self, base_N: torch.Tensor) -> bool:
        """Whether ``base_N - local`` (``base_N``: where the inner steps started) is finite everywhere, without
        materializing it: local parameters finite and below :data:`_NO_OVERFLOW_BOUND` (a reduction on the model's
        device) settle it; larger ones are checked chunk by chunk."""
        with torch.no_grad():
            peaks = []
            for p in self.params:
                if p.numel():
                    low, high = torch.aminmax(p.detach())
                    peaks.append(torch.maximum(low.float().abs(), high.float().abs()).cpu())  # NaN propagates
            peak = float(torch.stack(peaks).max())
            if not math.isfinite(peak):
                return False
            if peak < _NO_OVERFLOW_BOUND:
                return True
            for start, stop, local_chunk in self.placement.local_chunks():
                if not bool(torch.isfinite(base_N[start:stop] - local_chunk).all()):
                    return False
            return True

    def _pseudo_gradient_chunks(
        self, theta_start_N: torch.Tensor, delta_N: torch.Tensor | None
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The round's pseudo-gradient chunk by chunk, ``(start, stop, chunk)``: ``theta_start_N - local`` (the
        local parameters read as it goes), or the slices of ``delta_N`` computed at the boundary (overlap)."""
        if delta_N is not None:
            for start, stop in self.placement.chunk_ranges():
                yield start, stop, delta_N[start:stop]
            return
        for start, stop, local_chunk in self.placement.local_chunks():
            yield start, stop, theta_start_N[start:stop] - local_chunk

    def _add_pseudo_gradient(self, chunks: Iterator[tuple[int, int, torch.Tensor]] | None) -> None:
        """``residual_N = error_decay * residual_N + pseudo_gradient``, chunk by chunk (``chunks``, see
        :meth:`_pseudo_gradient_chunks`) and in place: the residual becomes the round's signal (``+= 0`` for
        ``None``, a round that diverged). Same bits as the out-of-place ``residual + (theta - local)`` (the decay,
        when below 1, multiplies first)."""
        if self.error_decay != 1.0:
            for start, stop in self.placement.chunk_ranges():
                self.residual_N[start:stop].mul_(self.error_decay)
        with torch.no_grad():
            if chunks is None:
                for start, stop in self.placement.chunk_ranges():
                    self.residual_N[start:stop].add_(torch.zeros(stop - start, device=self.placement.device))
                return
            for start, stop, chunk in chunks:
                self.residual_N[start:stop].add_(chunk)

    def _drop_diverged_round(self) -> None:
        """The inner steps made the local parameters non-finite: nothing of them may reach the swarm. Drops the
        round's local progress (a zero pseudo-gradient; the model is reset to ``theta`` after the round) and the
        inner optimizer's state when this instance owns it (its moments are then non-finite too)."""
        logger.error(
            "round=%d: the inner steps produced non-finite parameters (training diverged: lower the inner learning "
            "rate or clip gradients); this round's local progress is dropped and the model restarts from theta",
            self.round,
        )
        if self.inner_optimizer is not None:
            self.inner_optimizer.state.clear()

    def _average(self) -> tuple[AllReduceResult | None, int, torch.Tensor, torch.Tensor, FrameHeader | None]:
        """Select from the signal (held in ``residual_N``, which becomes the residual again) and average;
        returns the result (None without swarm averaging), the number of peers (0 when it sat the round out),
        the selected indices and values, and without swarm averaging the header of the selection encoded as one
        frame (``payload_bytes``; the result carries it otherwise)."""
        indices_K, values_K, value_dtype = select_in_place(
            self.selector, self.theta_N, self.residual_N, chunk_numel=self.placement.chunk_numel
        )
        if self.averager is None or self.matchmaker is None:
            payload = payload_frame(
                self.numel,
                indices_K,
                values_K,
                round_index=self.round,
                value_dtype=value_dtype,
                group_starts=self._group_starts,
            )
            return None, 1, indices_K, values_K, payload
        expiration = get_dht_time() + self.matchmaker.matchmaking_time + self.averager.averaging_timeout + 60.0
        started = time.monotonic()
        self.averager.expect_round(self.round)  # parts may come once the group forms, before all_reduce starts
        group = self.matchmaker.form_group(self.round, expiration, theta_digest(self.theta_N))
        self._seconds_matchmaking = time.monotonic() - started
        if group is None:
            late = self.matchmaker.late_by > 0 or self.matchmaker.seen_too_late
            if self.overlap and late and process_group()[0] == 1:
                self._late_by = self.matchmaker.late_by  # the main thread ends its phase early (_realign)
            self.residual_N.index_add_(0, indices_K, values_K)  # back to the signal, exactly (below)
            self.ledger.record(self.round, LedgerEntry(None), None)
            return None, 0, indices_K[:0], values_K[:0], None  # sat the round out: in no group
        indices_cpu, values_cpu = indices_K.cpu(), values_K.cpu()
        started = time.monotonic()
        result = self.averager.all_reduce(group, indices_cpu, values_cpu, value_dtype, self._group_starts)
        self._seconds_exchange = time.monotonic() - started
        if bool(result.returned_K.any()):
            returned = result.returned_K.to(indices_K.device)
            # A selected entry's residual is 0 (or the BF16 rounding remainder r of the signal s, with the value
            # bf16(s) = s - r exactly), so adding the value back restores the signal exactly.
            self.residual_N.index_add_(0, indices_K[returned], values_K[returned])
        # Entries a topk owner did not keep were returned above for good: no lineage counts them, so the ledger's
        # pending contribution is what remains (the sent entries the owners kept, or may have kept).
        dropped = result.dropped_K if bool(result.dropped_K.any()) else None
        stops = torch.tensor([stop for _, stop in result.bounds], dtype=torch.int64)
        offsets = [0, *torch.searchsorted(indices_cpu, stops).tolist()]
        kept_filters: list[torch.Tensor | None] = []
        self._num_clipped = 0
        for j, scale in enumerate(result.own_scales):
            lo, hi = offsets[j], offsets[j + 1]
            sent = None if dropped is None or not bool(dropped[lo:hi].any()) else ~dropped[lo:hi]
            kept_filters.append(None if sent is None else result.kept[j])
            if scale is not None and scale < 1.0:
                # Counted at a clip scale: the part the owner clipped off goes back, exactly (0 + clipped in the
                # float32 mode; in the BF16 mode the remainder r plus the clipped part rounds once).
                part_indices, part_values = indices_K[lo:hi], values_cpu[lo:hi]
                if sent is not None:
                    part_indices, part_values = part_indices[sent.to(indices_K.device)], part_values[sent]
                _, clipped_K = clip_split(part_values, scale)
                self.residual_N.index_add_(0, part_indices, clipped_K.to(indices_K.device))
                self._num_clipped += int(part_indices.numel())
        absorbed = None
        if result.absorbed_shard is not None and result.absorbed_K.numel():
            # This owner's rounding of its topk aggregate: what the group sent there and theta did not get. Kept
            # aside in the ledger when this peer did not apply its own shard (a repair to a theta that did adds it).
            if result.absorbed_counted:
                self.residual_N.index_add_(
                    0,
                    result.absorbed_indices_K.to(indices_K.device),
                    result.absorbed_K.to(self.residual_N.device),
                )
            absorbed = (result.absorbed_shard, result.absorbed_indices_K.clone(), result.absorbed_K.clone())
        self.ledger.record(
            self.round,
            LedgerEntry(group.group_id, result.accepted, result.bars, result.kept),
            Pending(
                group.group_id,
                list(result.parts),
                list(result.bounds),
                [scale is not None for scale in result.own_scales],
                [1.0 if scale is None else scale for scale in result.own_scales],
                kept=kept_filters,
                kept_unknown=set(result.kept_unknown),
                absorbed=absorbed,
                absorbed_counted=result.absorbed_counted,
                norms=list(result.own_norms),
            ),
        )
        return result, len(group.members), indices_K, values_K, None

    def _outer_round(
        self,
        seconds_inner: float,
        start: float,
        loss: float | None,
        finite: bool | None = None,
        delta_N: torch.Tensor | None = None,
    ) -> RoundMetrics:
        """The round on the main process (on the background thread with overlap, given the boundary's ``finite``
        and pseudo-gradient ``delta_N``; it then touches no model parameter and no ``torch.distributed``
        collective). Returns its metrics; the caller reports them (:meth:`_report`)."""
        # The pseudo-gradient is theta (as the round starts) minus the local parameters; it is never held whole:
        # it is added to the residual chunk by chunk once the catch-up below has corrected the residual, so the
        # signal is ``residual + pseudo_gradient`` with the residual this peer keeps after any repair.
        theta_start_N = self.theta_N
        if finite is None:
            finite = self._pseudo_gradient_is_finite(theta_start_N)
            if not finite:
                self._drop_diverged_round()
        self._num_reconciled = 0
        self._num_clipped = 0
        self._seconds_matchmaking = self._seconds_exchange = 0.0
        repaired = self._catch_up()  # a repair replaces theta_N by a new tensor; theta_start_N stays as it was
        self._add_pseudo_gradient(self._pseudo_gradient_chunks(theta_start_N, delta_N) if finite else None)
        del theta_start_N
        round_index = self.round
        result, num_peers, indices_K, values_K, payload = self._average()
        num_sent = int(indices_K.numel())
        if self.averager is None:
            self._zeros_momentum()
            self.outer_optimizer.step_sparse(self.theta_N, indices_K, values_K, chunk_numel=self.placement.chunk_numel)
        elif result is not None and result.indices_K.numel() + int(result.complete) > 0:
            self._withdraw_snapshot()  # theta and the momentum change in place; _publish below serves them again
            if not result.complete:
                missing = [result.group.servers[j] for j, names in enumerate(result.accepted) if names is None]
                logger.warning(
                    "round=%d incomplete: no sum from owner(s) %s; applying the %d shard(s) fetched, the digest "
                    "check then repairs from the majority and reconciles the residual",
                    round_index,
                    missing,
                    len(result.accepted) - len(missing),
                )
            self._zeros_momentum()
            self.outer_optimizer.step_sparse(
                self.theta_N, result.indices_K, result.average_K, chunk_numel=self.placement.chunk_numel
            )
        self.round = round_index + 1
        # A peer that sat the round out (no group) applied nothing: its record must not outvote the peers that
        # averaged (three peers left out would otherwise make two that averaged download the stale state).
        self._complete = result.complete if result is not None else self.averager is None
        digest_started = time.monotonic()
        if self.averager is not None and self.matchmaker is not None:
            self._record_round(round_index, num_peers, result)
            self._publish()
            # A peer outvoted for its start theta waits for the members that went on without it, as members wait
            # for each other: at once it would read their records of the round before, and race into the next
            # round on its stale theta, to be outvoted again (seen for 4 rounds after a partition healed).
            waiting = set(result.live_peers) if result is not None else set(self.matchmaker.outvoted_by)
            waiting.discard(str(self.peer_id))
            states = self.matchmaker.wait_for_states(self.round, waiting, self.digest_timeout)
            repaired = self._catch_up(states) or repaired
        seconds_digest = time.monotonic() - digest_started
        digest = theta_digest(self.theta_N)
        metrics = RoundMetrics(
            round=round_index,
            num_peers=num_peers,
            num_sent=num_sent,
            numel=self.numel,
            density=num_sent / self.numel,
            num_returned=int(result.returned_K.sum()) if result is not None else 0,
            num_rejected=result.num_rejected if result is not None else 0,
            bytes_sent=result.bytes_sent if result is not None else 0,
            bytes_received=result.bytes_received if result is not None else 0,
            seconds_inner=seconds_inner,
            seconds_sync=time.monotonic() - start,
            seconds_matchmaking=self._seconds_matchmaking,
            seconds_exchange=self._seconds_exchange,
            seconds_digest=seconds_digest,
            loss=loss,
            theta_digest=digest,
            repaired=repaired,
            num_contributors=result.num_contributors if result is not None else int(self.averager is None),
            complete=result.complete if result is not None else True,
            num_reconciled=self._num_reconciled,
            num_averaged=int(result.indices_K.numel()) if result is not None else num_sent * (num_peers > 0),
            num_clipped=self._num_clipped,
            largest_norm_ratio=result.largest_norm_ratio if result is not None else 0.0,
            **_byte_split(result, payload),
        )
        return metrics

    def _report(self, metrics: RoundMetrics) -> RoundMetrics:
        """Log a finished round's metrics, keep them as ``last_metrics``, append them to ``metrics_path``."""
        logger.info(
            "outer round=%d num_peers=%d num_sent=%d density=%.4g bytes_sent=%d seconds_sync=%.2f digest=%s",
            metrics.round,
            metrics.num_peers,
            metrics.num_sent,
            metrics.density,
            metrics.bytes_sent,
            metrics.seconds_sync,
            metrics.theta_digest,
        )
        self._warn_if_alone(metrics)
        self.last_metrics = metrics
        if self.metrics_writer is not None:
            self.metrics_writer.write(metrics)
        return metrics

    # -- overlapped rounds (RoundConfig.overlap) --------------------------------------------------------------

    def _overlapped_boundary(self, seconds_inner: float, start: float, loss: float | None) -> RoundMetrics | None:
        """Every process, at a round boundary with overlap: land the round in flight (``theta`` then holds it),
        take this phase's pseudo-gradient ``start - local`` into ``_delta_N``, start the next phase from
        ``theta - _delta_N`` (the phase's own progress on the swarm's theta; the swarm's average of it replaces it
        one round later) and, on the main process, run this round in the background. Returns the landed round's
        metrics (main process; ``None`` at the first boundary)."""
        start_N, delta_N = self._start_N, self._delta_N
        assert start_N is not None and delta_N is not None  # noqa: S101 (set with overlap)
        metrics = self._land_round() if self._in_flight else None
        finite = self._pseudo_gradient_is_finite(start_N)
        if not finite:
            self._drop_diverged_round()
        with torch.no_grad():
            if finite:
                for lo, hi, local_chunk in self.placement.local_chunks():
                    torch.sub(start_N[lo:hi], local_chunk, out=delta_N[lo:hi])
            for lo, hi in self.placement.chunk_ranges():
                if finite:
                    torch.sub(self.theta_N[lo:hi], delta_N[lo:hi], out=start_N[lo:hi])
                else:
                    start_N[lo:hi].copy_(self.theta_N[lo:hi])
            self.placement.load_into_model(start_N)
            for lo, hi, local_chunk in self.placement.local_chunks():
                start_N[lo:hi].copy_(local_chunk)  # what the model holds (a BF16 model rounds): the next phase's base
        self._in_flight = True
        if self._executor is not None:
            # the round's own clock (seconds_sync) starts here, after this boundary's wait for the previous round
            launched = time.monotonic()
            self._future = self._executor.submit(self._outer_round, seconds_inner, launched, loss, finite, delta_N)
        if metrics is not None:
            metrics = self._report(dataclasses.replace(metrics, seconds_blocked=time.monotonic() - start))
        return metrics

    def _wait_background(self) -> None:
        """Main process: wait for the round running in the background, if any, and keep its metrics for the
        boundary that lands it. The round's own waits are bounded (``matchmaking_time``, ``averaging_timeout``,
        ``request_timeout``, ``digest_timeout``); its exception propagates from here."""
        future, self._future = self._future, None
        if future is not None:
            self._finished = future.result()

    def _land_round(self) -> RoundMetrics | None:
        """Every process: complete the round in flight (the main process waits for it; every rank then receives its
        ``theta``) and return its metrics (main process)."""
        self._wait_background()
        metrics, self._finished = self._finished, None
        if not self.is_main_process:
            self.round += 1
        self._in_flight = False
        self.placement.broadcast(self.theta_N)
        return metrics
