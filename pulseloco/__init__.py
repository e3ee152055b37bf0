"""pulseloco: decentralized training with precision-gated sparse exchange.

Two paths, both built on the observation that most per-step weight updates are invisible after the BF16 cast:

- PULSELoCo (``pulseloco.loco``): trainer <-> trainer, DiLoCo with the FP32 pseudo-gradient sparsified by the
  compute-visibility rule plus error feedback, averaged over a hivemind DHT.
- PULSESync (``pulseloco.sync``): trainer -> rollout workers, lossless sparse BF16 weight patches.

Importing this package is cheap and has no side effects: submodules (which import torch) load on demand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pulseloco.loco.optimizer import PulseLoCo

__version__ = "0.1.0"

__all__ = ["PulseLoCo", "__version__"]

_LAZY = {"PulseLoCo": "pulseloco.loco.optimizer"}


def __getattr__(name: str) -> Any:
    """Import public classes on first use, so that ``import pulseloco`` does not import torch or hivemind."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pulseloco' has no attribute {name!r}")
