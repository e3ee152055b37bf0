"""pulseloco: decentralized training with precision-gated sparse exchange.

Two paths, both built on the observation that most per-step weight updates are invisible after the BF16 cast:

- PULSELoCo (``pulseloco.loco``): trainer <-> trainer, DiLoCo with the FP32 pseudo-gradient sparsified by the
  compute-visibility rule plus error feedback, averaged over a hivemind DHT.
- PULSESync (``pulseloco.sync``): trainer -> rollout workers, lossless sparse BF16 weight patches.

Importing this package is cheap and has no side effects: submodules (which import torch) load on demand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pulseloco._lazy import lazy_attributes

if TYPE_CHECKING:
    from pulseloco.loco.optimizer import PulseLoCo

__version__ = "0.1.0"

__all__ = ["PulseLoCo", "__version__"]

_LAZY = {"PulseLoCo": "pulseloco.loco.optimizer"}
"""Public classes imported on first use, so that ``import pulseloco`` does not import torch or hivemind."""


__getattr__ = lazy_attributes(__name__, _LAZY)
