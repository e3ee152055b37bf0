"""The settings of the trainer's rollout check (:class:`~pulseloco.rollouts.verify.RolloutVerifier`), which the
recipes read as ``--verify_*`` flags."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Literal

from pulseloco.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["WEIGHTS", "VerifyConfig"]

#: The weights a completion is checked with (:class:`VerifyConfig`'s ``verify_weights``).
WEIGHTS = ("shared", "version")


@dataclass(kw_only=True)
class VerifyConfig:
    """The settings of :class:`RolloutVerifier` (also the recipes' ``--verify_*`` flags, read by
    ``HfArgumentParser``, with the help texts in ``metadata``). The tolerances are the measured numerical
    differences of each precision (:mod:`pulseloco.rollouts.tolerances`); the overrides exist to measure them.
    Raises :class:`ConfigError` naming a bad value."""

    verify_weights: Literal["shared", "version"] = field(
        default="shared",
        metadata={
            "help": "'shared': every completion is first checked in the forward pass of this trainer's current "
            "weights that TRL's importance-sampling ratio needs anyway, and passes there only where each token leads "
            "by more than the measured drift from its version's weights; the others, and an audited share, are "
            "checked with their version's weights. 'version': every completion with its version's weights, a "
            "forward pass of its own."
        },
    )
    verify_audit: float = field(
        default=0.125,
        metadata={
            "help": "With --verify_weights shared: the share of prompts (at least one per version and round) whose "
            "completions are checked with their version's weights whatever the shared check finds, to measure how "
            "much lead the current weights' choices lose under the version's (the drift bound)."
        },
    )
    verify_ratio_error: float = field(
        default=0.05,
        metadata={
            "help": "With --verify_weights shared: the largest difference (nats per token) between the current and "
            "the version's log-probabilities of the audited completions' tokens at which the shared check proves "
            "completions (their importance-sampling ratio is then 1, exact to this); above it every completion of "
            "the version takes the version's check, whose log-probabilities make the ratio exact."
        },
    )
    verify_false_refusal: float = field(
        default=1e-6,
        metadata={
            "help": "Probability, over a whole run, that the near-miss guard refuses an honest worker (one whose "
            "engine keeps to its precision's measured rates)."
        },
    )
    verify_probation: bool = field(
        default=True,
        metadata={
            "help": "Hold back, and generate again, every group with a near miss (a token within the margin that is "
            "not the sampler's choice) from a worker the near-miss guard has too little evidence on to refuse a "
            "steerer (a new identity, or one claiming another precision), until it has enough (the positions of "
            "pulseloco.rollouts.tolerances.probation_positions)."
        },
    )
    verify_margin: float | None = field(
        default=None,
        metadata={
            "help": "Override of the margin (nats by which a token may trail the sampler's choice; default: the "
            "measured one of the worker's and trainer's precision). For measurements: a wider margin is room for "
            "a worker to pick its tokens."
        },
    )
    verify_max_logprob_error: float | None = field(
        default=None,
        metadata={"help": "Override of the largest log-probability error per token (default: the precision's)."},
    )

    def __post_init__(self) -> None:
        if self.verify_weights not in WEIGHTS:
            raise ConfigError(f"verify_weights must be one of {', '.join(WEIGHTS)}, got {self.verify_weights!r}")
        if not 0 < self.verify_audit <= 1:
            raise ConfigError(f"verify_audit must be in (0, 1], got {self.verify_audit}")
        if not (self.verify_ratio_error >= 0 and math.isfinite(self.verify_ratio_error)):
            raise ConfigError(f"verify_ratio_error must be a finite number >= 0, got {self.verify_ratio_error}")
        if not 0 < self.verify_false_refusal < 1:
            raise ConfigError(f"verify_false_refusal must be in (0, 1), got {self.verify_false_refusal}")
        if self.verify_margin is not None and not (self.verify_margin >= 0 and math.isfinite(self.verify_margin)):
            raise ConfigError(f"verify_margin must be a finite number >= 0, got {self.verify_margin}")
        error = self.verify_max_logprob_error
        if error is not None and not (error > 0 and math.isfinite(error)):
            raise ConfigError(f"verify_max_logprob_error must be a positive number, got {error}")
