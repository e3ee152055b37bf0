"""A Byzantine PULSELoCo trainer: a peer that trains honestly but sends an attack instead of its selection.

:func:`install` wraps one peer's ``SparseAverager.all_reduce`` (the peer keeps computing its honest pseudo-gradient
and selection; only what it pushes to the shard owners changes). Every attack is sent at ``factor`` times the L2
norm of the honest selection it replaces (9 by default), as dense FP32 entries where it needs them:

- ``flip``: the honest selection sign-flipped (``-factor * values``, the same entries);
- ``fixed``: one fixed random direction over all parameters, the same every round (a drift);
- ``noise``: fresh Gaussian noise over all parameters every round.

The attacker keeps its own state as if its honest selection had been counted whole (no entries returned, clip scale
1), so that "the honest norm" stays the norm an honest peer would send; its shard owner code is left as it is (it
serves honest sums of its own shard). Used by ``experiments/byzantine/bench_byzantine.py`` and
``tests/loco_helpers.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger(__name__)

ATTACKS = ("flip", "fixed", "noise")
"""The attacks :func:`install` knows."""


def attack_selection(
    attack: str, indices_K: Any, values_K: Any, numel: int, factor: float, generator: Any, fixed_N: Any
) -> tuple[Any, Any]:
    """``(indices, values)`` the attacker sends instead of its honest selection ``(indices_K, values_K)`` (sorted
    global indices into ``numel`` parameters, FP32 values): ``factor`` times the honest L2 norm, in the direction
    ``attack`` names (``fixed_N``: the fixed unit direction; ``generator``: the noise's). Raises ValueError for an
    unknown attack."""
    import torch

    norm = float(torch.linalg.vector_norm(values_K))
    if attack == "flip":
        return indices_K, -factor * values_K
    if attack == "fixed":
        direction_N = fixed_N
    elif attack == "noise":
        direction_N = torch.randn(numel, generator=generator)
        direction_N /= torch.linalg.vector_norm(direction_N)
    else:
        raise ValueError(f"attack must be one of {', '.join(ATTACKS)}, got {attack!r}")
    return torch.arange(numel, dtype=torch.int64), (factor * norm) * direction_N


def install(opt: Any, attack: str, *, factor: float = 9.0, seed: int = 0) -> None:
    """Make the :class:`pulseloco.PulseLoCo` ``opt`` (with a swarm) send ``attack`` at ``factor`` times its honest
    norm from its next round on. Raises ValueError for an unknown attack or an ``opt`` without a swarm."""
    import torch

    if attack not in ATTACKS:
        raise ValueError(f"attack must be one of {', '.join(ATTACKS)}, got {attack!r}")
    averager = opt.averager
    if averager is None:
        raise ValueError("the attacker needs a swarm (a PulseLoCo built with a DHT)")
    honest_all_reduce = averager.all_reduce
    generator = torch.Generator().manual_seed(seed)
    fixed_N = torch.randn(opt.numel, generator=generator)
    fixed_N /= torch.linalg.vector_norm(fixed_N)

    def all_reduce(
        group: Any, indices_K: Any, values_K: Any, value_dtype: str = "float32", group_starts: Any = None
    ) -> Any:
        bad_indices, bad_values = attack_selection(attack, indices_K, values_K, opt.numel, factor, generator, fixed_N)
        result = honest_all_reduce(group, bad_indices, bad_values.to(torch.float32), "float32")
        # The attacker keeps nothing back: its parts count whole in its own books (a norm of 0 is never clipped).
        own_scales = tuple(None if scale is None else 1.0 for scale in result.own_scales)
        logger.info("attack=%s round=%d sent=%d entries", attack, group.round, bad_indices.numel())
        return dataclasses.replace(
            result,
            returned_K=torch.zeros(indices_K.numel(), dtype=torch.bool),
            own_scales=own_scales,
            own_norms=tuple(0.0 for _ in result.own_norms),
        )

    averager.all_reduce = all_reduce
