"""PulseLoCo's settings, in three groups: what a round does (:class:`RoundConfig`), how it meets the swarm
(:class:`AveragingConfig`) and where its outer state lives (:class:`PlacementConfig`).

Each is the one definition of its options: :class:`pulseloco.loco.optimizer.PulseLoCo` and
:class:`pulseloco.integrations.trainer.PulseLoCoCallback` take them, and the recipes' flags
(:class:`pulseloco.integrations.args.PulseLoCoArguments`, read by ``HfArgumentParser``) are their fields, with the
help texts in each field's ``metadata``. Each checks its values once, when it is built, and raises
:class:`~pulseloco.errors.ConfigError` naming the first bad one; :class:`RoundConfig` does so by building the
selector and the outer optimizer it describes, whose constructors own those checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pulseloco.errors import ConfigError
from pulseloco.loco.ledger import DEFAULT_KEEP_ROUNDS, MAX_LEDGER_ROUNDS
from pulseloco.loco.outer import NesterovOuterOptimizer
from pulseloco.loco.placement import OUTER_STATE_DEVICES, OuterStateDevice
from pulseloco.loco.quantize import ParamLayout
from pulseloco.loco.reduce import DEFAULT_EXCHANGE_BUDGET, MAX_EXCHANGE_BUDGET
from pulseloco.loco.robust import DEFAULT_DISPUTE_NORM_RATIO, DEFAULT_DISPUTE_ROUNDS
from pulseloco.loco.selection import Selector, SelectorName, ValueDType, make_selector

__all__ = [
    "DEFAULT_OUTER_CHUNK_BYTES",
    "EXCHANGES",
    "MEAN_OVER",
    "STRATEGY_DEFAULTS",
    "AveragingConfig",
    "PlacementConfig",
    "RoundConfig",
]

EXCHANGES = ("auto", "sums", "gather", "topk")
"""The owner's exchange (:class:`AveragingConfig`): ``sums`` serves the FP32 sum of the shard's parts, ``gather``
relays the parts themselves (cheaper when a part's values take fewer bytes than an FP32 sum's), ``topk`` serves a
budget of the aggregate per tile in the parts' precision, a few payloads whatever the group's size
(:mod:`pulseloco.loco.reduce`); ``auto`` decides per round
(:meth:`pulseloco.loco.shard_owner.ShardOwner.exchange_for`)."""
DEFAULT_OUTER_CHUNK_BYTES = 64 * 2**20
"""FP32 bytes of one chunk of the outer round's chunked phases: bounds their temporaries."""


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


MEAN_OVER = ("peers", "senders")
"""How a shard's sum becomes the average: divided by the peers counted in the shard (DiLoCo, PULSE), or each
entry by the peers that sent it (SparseLoCo)."""
STRATEGY_DEFAULTS: dict[str, dict[str, Any]] = {
    "pulse": {"outer_lr": 0.7, "outer_momentum": 0.9, "error_decay": 1.0, "mean_over": "peers"},
    "dense": {"outer_lr": 0.7, "outer_momentum": 0.9, "error_decay": 1.0, "mean_over": "peers"},
    "sparseloco": {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95, "mean_over": "senders"},
}
"""Per selector, the published values of the options left at None: DiLoCo's and PULSE's Nesterov outer step
(lr 0.7, momentum 0.9) with plain error feedback, SparseLoCo's plain SGD step (lr 1, no momentum) with decayed
error feedback (0.95) and the mean over senders."""


@dataclass(kw_only=True)
class RoundConfig:
    """What one outer round does: ``inner_steps`` local steps, then the selector's entries averaged over the
    group and an outer SGD step (Nesterov momentum, or none for SparseLoCo). Options left at None take the
    selector's published value (:data:`STRATEGY_DEFAULTS`)."""

    inner_steps: int = field(default=8, metadata=_help("H: optimizer steps per outer round."))
    selector: SelectorName = field(
        default="pulse",
        metadata=_help(
            "pulse (compute-visible gate, PULSELoCo), dense (DiLoCo) or sparseloco (top-k per 64x64 tile, 2-bit "
            "values, SparseLoCo)."
        ),
    )
    outer_lr: float | None = field(
        default=None, metadata=_help("Outer learning rate; default 0.7 (pulse, dense) or 1.0 (sparseloco).")
    )
    outer_momentum: float | None = field(
        default=None,
        metadata=_help("Nesterov outer momentum in [0, 1); default 0.9 (pulse, dense) or 0 (sparseloco: plain SGD)."),
    )
    error_decay: float | None = field(
        default=None,
        metadata=_help(
            "The residual is multiplied by this before each round's pseudo-gradient is added, in (0, 1]; default 1 "
            "(pulse) or 0.95 (sparseloco)."
        ),
    )
    mean_over: str | None = field(
        default=None,
        metadata=_help(
            "peers: a shard's sum divided by the peers it counted; senders: each entry by the peers that sent it. "
            "Default peers (pulse, dense) or senders (sparseloco). Decided by each shard's owner."
        ),
    )
    topk_k: int = field(default=64, metadata=_help("sparseloco: entries kept per chunk_size x chunk_size tile."))
    chunk_size: int = field(
        default=64,
        metadata=_help("Tile side of sparseloco and pulse_budget: 64x64 of a matrix, rows of 64 of a vector."),
    )
    quant_bits: int = field(default=2, metadata=_help("Bits per quantized value (sparseloco, pulse_values quantized)."))
    pulse_values: ValueDType = field(
        default="float32",
        metadata=_help(
            "pulse: precision of the values sent, float32 (the paper), bfloat16 (2 bytes a value) or quantized "
            "(quant_bits per value, per-parameter lookup table); the rounding or quantization error stays in the "
            "residual and is sent later."
        ),
    )
    pulse_budget: int | None = field(
        default=None,
        metadata=_help("pulse: at most this many visible entries per tile (the largest); default every visible one."),
    )

    overlap: bool = field(
        default=False,
        metadata=_help(
            "Overlap each round's exchange with the next round's inner steps: the exchange runs in the background "
            "and its outer step is applied one round late, while the local model starts the next round from theta "
            "minus its own pseudo-gradient. The inner optimizer waits only for an exchange longer than a round of "
            "compute. Costs 8 more bytes a parameter (docs/design.md 2.6)."
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ConfigError(f"inner_steps must be an integer of at least 1, got {self.inner_steps!r}")
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"overlap must be true or false, got {self.overlap!r}")
        decay = self.resolved("error_decay")
        if not (0.0 < decay <= 1.0):
            raise ConfigError(f"error_decay must be in (0, 1], got {self.error_decay}")
        if self.resolved("mean_over") not in MEAN_OVER:
            raise ConfigError(f"mean_over must be one of {', '.join(MEAN_OVER)}, got {self.mean_over!r}")
        self.make_selector()
        self.make_outer_optimizer()

    def resolved(self, name: str) -> Any:
        """The option ``name``, or the selector's default when it is None (:data:`STRATEGY_DEFAULTS`); raises
        :class:`ConfigError` for an unknown selector."""
        value = getattr(self, name)
        if value is not None:
            return value
        if self.selector not in STRATEGY_DEFAULTS:
            raise ConfigError(f"selector must be one of {', '.join(STRATEGY_DEFAULTS)}, got {self.selector!r}")
        return STRATEGY_DEFAULTS[self.selector][name]

    def make_selector(self, layout: ParamLayout | None = None) -> Selector:
        """The selection rule for the parameters of ``layout`` (the chunked rules need it; None: a placeholder that
        checks the settings); raises :class:`ConfigError` for an unknown selector or bad settings of it."""
        return make_selector(
            self.selector,
            layout=layout,
            pulse_values=self.pulse_values,
            pulse_budget=self.pulse_budget,
            topk_k=self.topk_k,
            chunk_size=self.chunk_size,
            quant_bits=self.quant_bits,
        )

    def make_outer_optimizer(self) -> NesterovOuterOptimizer:
        """A fresh outer optimizer (Nesterov; momentum 0 is plain SGD); raises :class:`ConfigError` for a bad
        learning rate or momentum."""
        return NesterovOuterOptimizer(self.resolved("outer_lr"), self.resolved("outer_momentum"))


@dataclass(kw_only=True)
class AveragingConfig:
    """How a round meets its group, and how long each of its waits on the swarm may take."""

    matchmaking_time: float = field(default=15.0, metadata=_help("Seconds to gather peers for a round."))
    close_when_expected: bool = field(
        default=True,
        metadata=_help(
            "Start a round as soon as every expected peer has registered (those whose state record says they start "
            "that round or are still in the previous one, catching up included; not in round 0), instead of "
            "waiting out matchmaking_time."
        ),
    )
    target_group_size: int | None = field(
        default=None,
        metadata=_help(
            "Start a round as soon as this many peers registered (1: train alone without waiting); default: wait "
            "matchmaking_time."
        ),
    )
    averaging_timeout: float = field(
        default=60.0,
        metadata=_help(
            "Seconds a round's exchange may take: a slow peer's part counts if it arrives by then. A server-mode peer "
            "gone mid-round is noticed within seconds (it does not answer a ping); a client-mode one delays the "
            "others by at most this."
        ),
    )
    request_timeout: float = field(default=10.0, metadata=_help("Seconds for one DHT operation or message."))
    digest_timeout: float | None = field(
        default=None,
        metadata=_help("Seconds to wait for the group's digests after a round; default: request_timeout."),
    )
    max_norm_ratio: float = field(
        default=10.0,
        metadata=_help(
            "A contribution whose norm exceeds this many times the median of the others' in its shard is rejected."
        ),
    )
    num_download_retries: int = field(default=3, metadata=_help("Peers tried when downloading the state."))
    clip_to_median: bool = field(
        default=True,
        metadata=_help(
            "A shard owner scales each part above the group's median norm down to it (the clipped-off part goes back "
            "to its sender's residual); False: only the max_norm_ratio screen."
        ),
    )
    dispute_norm_ratio: float = field(
        default=DEFAULT_DISPUTE_NORM_RATIO,
        metadata=_help(
            "A part whose norm is above this many times its shard's median norm strikes; a peer with strikes in most "
            "of its last dispute_rounds parts is excluded from that owner's sums."
        ),
    )
    dispute_rounds: int = field(
        default=DEFAULT_DISPUTE_ROUNDS,
        metadata=_help("Window of a peer's last parts judged for strikes (most of them exclude it); 0: never exclude."),
    )
    exchange: str = field(
        default="auto",
        metadata=_help(
            "How this peer's shard reaches the group when it owns one: sums (the FP32 sum of the parts), gather (the "
            "parts themselves, relayed; each member averages them), topk (the largest entries of the aggregate per "
            "tile, in the parts' precision; what it drops goes back to its senders' residuals) or auto (for quantized "
            "values topk where it sends less than gather, in groups of more than 1 + exchange_budget, and gather "
            "below; else sums)."
        ),
    )
    ledger_rounds: int = field(
        default=DEFAULT_KEEP_ROUNDS,
        metadata=_help(
            "Rounds of history each peer keeps and serves with its state (at most 64): a partition, stall or split "
            "of up to this many rounds is reconciled exactly when the halves meet again; a peer apart for longer "
            "loses what it sent before the window (logged). Costs, per round, the CPU memory of the parts sent (their "
            "size on the wire: about 4 bytes per FP32 entry)."
        ),
    )
    exchange_budget: float = field(
        default=DEFAULT_EXCHANGE_BUDGET,
        metadata=_help(
            "topk exchange: entries of the aggregate an owner keeps per chunk_size x chunk_size tile, as a multiple of "
            "one part's budget there (sparseloco: topk_k; pulse: pulse_budget, else the parts' mean count). 1 keeps "
            "an aggregate as large as one part (Ok-Topk's rule); larger applies more of the group's update a round "
            "and sends more (about (1 + exchange_budget) (R - 1)/R payloads each way)."
        ),
    )

    def __post_init__(self) -> None:
        for name in ("matchmaking_time", "averaging_timeout", "request_timeout"):
            _check_seconds(name, getattr(self, name))
        if self.digest_timeout is not None:
            _check_seconds("digest_timeout", self.digest_timeout)
        if self.target_group_size is not None and self.target_group_size < 1:
            raise ConfigError(f"target_group_size must be at least 1 or None, got {self.target_group_size}")
        if not self.max_norm_ratio > 1.0:
            raise ConfigError(f"max_norm_ratio must be above 1, got {self.max_norm_ratio}")
        if self.num_download_retries < 1:
            raise ConfigError(f"num_download_retries must be at least 1, got {self.num_download_retries}")
        if not isinstance(self.clip_to_median, bool):
            raise ConfigError(f"clip_to_median must be True or False, got {self.clip_to_median!r}")
        if not (self.dispute_norm_ratio > 1.0 and math.isfinite(self.dispute_norm_ratio)):
            raise ConfigError(f"dispute_norm_ratio must be a finite number above 1, got {self.dispute_norm_ratio}")
        if self.exchange not in EXCHANGES:
            raise ConfigError(f"exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}")
        budget = self.exchange_budget
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0.0 < budget <= MAX_EXCHANGE_BUDGET:
            raise ConfigError(
                f"exchange_budget must be a number above 0 and at most {MAX_EXCHANGE_BUDGET:g} (a multiple of one "
                f"part's entries per tile), got {budget!r}"
            )
        window = self.ledger_rounds
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_LEDGER_ROUNDS:
            raise ConfigError(
                f"ledger_rounds must be an integer from 1 to {MAX_LEDGER_ROUNDS} (the most rounds a served ledger may "
                f"hold), got {window!r}"
            )
        rounds = self.dispute_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ConfigError(f"dispute_rounds must be an integer of at least 0 (0: never exclude), got {rounds!r}")

    @property
    def digest_seconds(self) -> float:
        """Seconds to wait for the group's digests: ``digest_timeout``, else ``request_timeout``."""
        return self.request_timeout if self.digest_timeout is None else float(self.digest_timeout)


@dataclass(kw_only=True)
class PlacementConfig:
    """Where the outer state (``theta``, the residual and the outer momentum: flat FP32, 12 bytes a parameter)
    lives, and the chunk size of the round's chunked phases (see :class:`pulseloco.loco.placement.OuterPlacement`).
    Either placement gives bit-identical results."""

    outer_state_device: OuterStateDevice = field(
        default="auto",
        metadata=_help(
            "Where PulseLoCo keeps theta, the residual and the outer momentum (12 bytes a parameter): auto / cpu: "
            "host memory, pinned for a model on a GPU; model: on the model's GPU (faster rounds, needs the room)."
        ),
    )
    outer_chunk_bytes: int = field(
        default=DEFAULT_OUTER_CHUNK_BYTES,
        metadata=_help(
            "FP32 bytes of a chunk of the round's chunked phases (transfers, pseudo-gradient, selection, outer "
            "step): their temporaries are a few chunks, not the model. At least 4."
        ),
    )

    def __post_init__(self) -> None:
        if self.outer_state_device not in OUTER_STATE_DEVICES:
            raise ConfigError(
                f"outer_state_device must be one of {', '.join(OUTER_STATE_DEVICES)} (auto/cpu: host memory, "
                f"pinned for a model on a GPU; model: the model's GPU), got {self.outer_state_device!r}"
            )
        chunk = self.outer_chunk_bytes
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 4:
            raise ConfigError(f"outer_chunk_bytes must be an integer of at least 4 bytes, got {chunk!r}")


def _check_seconds(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
