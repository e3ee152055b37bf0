"""The outer optimizer of PULSELoCo and DiLoCo: SGD with Nesterov momentum on the global parameters.

    v     = mu * v + g
    theta = theta - lr * (g + mu * v)

with ``g`` the averaged pseudo-gradient. The operations are written one rounding step at a time, in this
order, so that any peer (and a plain reference written from the formula above) computes bit-identical
results from bit-identical inputs; this is what keeps every peer's ``theta`` equal after a round.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pulseloco.errors import ConfigError, TensorMismatchError

logger = logging.getLogger(__name__)

__all__ = ["NesterovOuterOptimizer"]


class NesterovOuterOptimizer:
    """Nesterov SGD over one flat FP32 tensor of global parameters.

    ``lr`` must be positive and ``momentum`` in [0, 1): otherwise :class:`ConfigError` at construction. The
    momentum buffer starts at zero and has the shape of the first pseudo-gradient it sees.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        if not lr > 0.0:
            raise ConfigError(f"outer_lr must be positive, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.momentum_N: torch.Tensor | None = None

    def step(self, theta_N: torch.Tensor, pseudo_gradient_N: torch.Tensor) -> None:
        """Update ``theta_N`` in place with the averaged ``pseudo_gradient_N``.

        Raises :class:`ValueError` if the shapes differ from each other or from the momentum buffer.
        """
        if theta_N.shape != pseudo_gradient_N.shape:
            raise ValueError(
                f"theta {tuple(theta_N.shape)} and pseudo-gradient {tuple(pseudo_gradient_N.shape)} differ"
            )
        if self.momentum_N is None:
            self.momentum_N = torch.zeros_like(theta_N)
        elif self.momentum_N.shape != theta_N.shape:
            raise ValueError(f"momentum {tuple(self.momentum_N.shape)} and theta {tuple(theta_N.shape)} differ")
        v = self.momentum_N
        v.mul_(self.momentum)
        v.add_(pseudo_gradient_N)
        update_N = v * self.momentum
        update_N = pseudo_gradient_N + update_N
        update_N.mul_(self.lr)
        theta_N.sub_(update_N)

    def state_dict(self) -> dict[str, Any]:
        """``lr``, ``momentum`` and the momentum buffer (``None`` before the first step)."""
        return {"lr": self.lr, "momentum": self.momentum, "momentum_N": self.momentum_N}

    def load_state_dict(self, state: dict[str, Any], *, numel: int | None = None) -> None:
        """Restore from :meth:`state_dict`. Raises :class:`TensorMismatchError` for a buffer of the wrong size
        (when ``numel`` is given) or dtype, leaving this optimizer as it was."""
        buf = state.get("momentum_N")
        if buf is not None:
            if not isinstance(buf, torch.Tensor) or buf.dtype != torch.float32 or buf.dim() != 1:
                raise TensorMismatchError("outer optimizer momentum must be a flat FP32 tensor")
            if numel is not None and buf.numel() != numel:
                raise TensorMismatchError(f"outer optimizer momentum has {buf.numel()} elements, expected {numel}")
            buf = buf.detach().clone()
        self.lr = float(state.get("lr", self.lr))
        self.momentum = float(state.get("momentum", self.momentum))
        self.momentum_N = buf
