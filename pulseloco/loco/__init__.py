"""PULSELoCo: DiLoCo with compute-visible sparse pseudo-gradients and error feedback, over hivemind.

Modules, one concept each:

- :mod:`~pulseloco.loco.selection`: selection rules ``pulse`` / ``dense`` / ``topk`` with error feedback;
- :mod:`~pulseloco.loco.outer`: the Nesterov outer optimizer;
- :mod:`~pulseloco.loco.matchmaking`: DHT records (per-round groups, per-peer state digests);
- :mod:`~pulseloco.loco.validation`: encoding and validation of untrusted sparse payloads;
- :mod:`~pulseloco.loco.averaging`: the sparse reduce-scatter / all-gather over libp2p;
- :mod:`~pulseloco.loco.state`: serving and downloading the global state (peers behind or disagreeing);
- :mod:`~pulseloco.loco.ledger`: exactly-once bookkeeping of what each round counted;
- :mod:`~pulseloco.loco.metrics`: per-round JSON-lines metrics;
- :mod:`~pulseloco.loco.optimizer`: :class:`PulseLoCo`, which ties them together.
"""

from pulseloco.loco.metrics import RoundMetrics
from pulseloco.loco.optimizer import PulseLoCo
from pulseloco.loco.outer import NesterovOuterOptimizer
from pulseloco.loco.selection import (
    SELECTORS,
    DenseSelector,
    PulseSelector,
    Selection,
    TopKSelector,
    compute_visible_mask,
    make_selector,
)

__all__ = [
    "SELECTORS",
    "DenseSelector",
    "NesterovOuterOptimizer",
    "PulseLoCo",
    "PulseSelector",
    "RoundMetrics",
    "Selection",
    "TopKSelector",
    "compute_visible_mask",
    "make_selector",
]
