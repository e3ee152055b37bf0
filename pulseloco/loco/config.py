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
from pulseloco.loco.outer import NesterovOuterOptimizer
from pulseloco.loco.placement import OUTER_STATE_DEVICES, OuterStateDevice
from pulseloco.loco.robust import DEFAULT_DISPUTE_NORM_RATIO, DEFAULT_DISPUTE_ROUNDS
from pulseloco.loco.selection import Selector, SelectorName, ValueDType, make_selector

__all__ = ["DEFAULT_OUTER_CHUNK_BYTES", "AveragingConfig", "PlacementConfig", "RoundConfig"]

DEFAULT_OUTER_CHUNK_BYTES = 64 * 2**20
"""FP32 bytes of one chunk of the outer round's chunked phases: bounds their temporaries."""


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


@dataclass(kw_only=True)
class RoundConfig:
    """What one outer round does: ``inner_steps`` local steps, then the selector's entries averaged over the
    group and a Nesterov outer step."""

    inner_steps: int = field(default=8, metadata=_help("H: optimizer steps per outer round."))
    selector: SelectorName = field(
        default="pulse",
        metadata=_help("pulse (compute-visible gate), dense (DiLoCo) or topk (chunked top-k, SparseLoCo)."),
    )
    outer_lr: float = field(default=0.7, metadata=_help("Nesterov outer learning rate."))
    outer_momentum: float = field(default=0.9, metadata=_help("Nesterov outer momentum, in [0, 1)."))
    topk_density: float = field(default=0.01, metadata=_help("topk: fraction of each chunk sent."))
    topk_chunk_size: int = field(default=4096, metadata=_help("topk: chunk size of the top-k selection."))
    pulse_values: ValueDType = field(
        default="float32",
        metadata=_help(
            "pulse: precision of the values sent, float32 (the paper) or bfloat16 (2 bytes a value; the rounding "
            "remainder stays in the residual and is sent later)."
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ConfigError(f"inner_steps must be an integer of at least 1, got {self.inner_steps!r}")
        self.make_selector()
        self.make_outer_optimizer()

    def make_selector(self) -> Selector:
        """The selection rule; raises :class:`ConfigError` for an unknown selector or bad settings of it."""
        return make_selector(
            self.selector,
            topk_density=self.topk_density,
            topk_chunk_size=self.topk_chunk_size,
            pulse_values=self.pulse_values,
        )

    def make_outer_optimizer(self) -> NesterovOuterOptimizer:
        """A fresh Nesterov outer optimizer; raises :class:`ConfigError` for a bad learning rate or momentum."""
        return NesterovOuterOptimizer(self.outer_lr, self.outer_momentum)


@dataclass(kw_only=True)
class AveragingConfig:
    """How a round meets its group, and how long each of its waits on the swarm may take."""

    matchmaking_time: float = field(default=15.0, metadata=_help("Seconds to gather peers for a round."))
    target_group_size: int | None = field(
        default=None,
        metadata=_help(
            "Start a round as soon as this many peers registered (1: train alone without waiting); default: wait "
            "matchmaking_time."
        ),
    )
    averaging_timeout: float = field(
        default=60.0,
        metadata=_help("Seconds a round's exchange may take; a peer gone mid-round delays the others by at most this."),
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
