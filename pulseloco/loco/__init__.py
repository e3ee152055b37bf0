"""PULSELoCo: DiLoCo with compute-visible sparse pseudo-gradients and error feedback, over hivemind.

Modules, one concept each:

- :mod:`~pulseloco.loco.selection`: selection rules ``pulse`` / ``dense`` / ``sparseloco`` with error feedback;
- :mod:`~pulseloco.loco.outer`: the Nesterov outer optimizer;
- :mod:`~pulseloco.loco.matchmaking`: DHT records (per-round groups, per-peer state digests);
- :mod:`~pulseloco.loco.validation`: encoding and validation of untrusted sparse payloads;
- :mod:`~pulseloco.loco.averaging`: the sparse reduce-scatter / all-gather over libp2p (a group member's side);
- :mod:`~pulseloco.loco.shard_owner`: a shard owner's side: receiving, checking and summing parts, serving sums;
- :mod:`~pulseloco.loco.robust`: robust aggregation: parts clipped to the group's median norm, repeat outliers excluded;
- :mod:`~pulseloco.loco.traffic`: the all-reduce's byte accounting;
- :mod:`~pulseloco.loco.state`: serving and downloading the global state (peers behind or disagreeing);
- :mod:`~pulseloco.loco.ledger`: exactly-once bookkeeping of what each round counted;
- :mod:`~pulseloco.loco.placement`: where the outer state lives and the chunked copies to and from the model;
- :mod:`~pulseloco.loco.metrics`: per-round metrics (written with :class:`pulseloco.jsonl.JsonLinesWriter`);
- :mod:`~pulseloco.loco.config`: PulseLoCo's settings in three groups (the round, averaging, placement);
- :mod:`~pulseloco.loco.optimizer`: :class:`PulseLoCo`, which ties them together.

Tensor names carry their length as a suffix: ``_N`` for a flat FP32 vector over all N parameters (``theta_N``,
``residual_N``), ``_K`` for the K selected entries of one (``indices_K``, ``values_K``), ``_C`` for a chunk of a
flat vector (``theta_C``, one slice of ``theta_N``).
"""

from pulseloco.loco.config import AveragingConfig, PlacementConfig, RoundConfig
from pulseloco.loco.metrics import RoundMetrics
from pulseloco.loco.optimizer import PulseLoCo
from pulseloco.loco.outer import NesterovOuterOptimizer
from pulseloco.loco.selection import (
    SELECTORS,
    ChunkedSelector,
    DenseSelector,
    PulseSelector,
    Selection,
    compute_visible_mask,
    make_selector,
)

__all__ = [
    "SELECTORS",
    "AveragingConfig",
    "ChunkedSelector",
    "DenseSelector",
    "NesterovOuterOptimizer",
    "PlacementConfig",
    "PulseLoCo",
    "PulseSelector",
    "RoundConfig",
    "RoundMetrics",
    "Selection",
    "compute_visible_mask",
    "make_selector",
]
