"""pulseloco: decentralized training with precision-gated sparse exchange.

Two paths, both built on the observation that most per-step weight updates are invisible after the BF16 cast:

- PULSELoCo (``pulseloco.loco``): trainer <-> trainer, DiLoCo with the FP32 pseudo-gradient sparsified by the
  compute-visibility rule plus error feedback, averaged over a hivemind DHT.
- PULSESync (``pulseloco.sync``): trainer -> rollout workers, lossless sparse BF16 weight patches.

Importing this package is cheap and has no side effects: submodules (which import torch) load on demand.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
