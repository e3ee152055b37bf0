"""The outer optimizer of PULSELoCo and DiLoCo: SGD with Nesterov momentum on the global parameters.

    v     = mu * v + g
    theta = theta - lr * (g + mu * v)

with ``g`` the averaged pseudo-gradient. The operations are written one rounding step at a time, in this
order, so that any peer (and a plain reference written from the formula above) computes bit-identical
results from bit-identical inputs; this is what keeps every peer's ``theta`` equal after a round.
"""

from __future__ import annotations

import logging
import math
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
        if not (lr > 0.0 and math.isfinite(lr)):
            raise ConfigError(f"outer_lr must be a positive number, got {lr}")
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
        self._step_chunk(theta_N, pseudo_gradient_N, self.momentum_N)

    def _step_chunk(self, theta_C: torch.Tensor, gradient_C: torch.Tensor, v_C: torch.Tensor) -> None:
        """The update on one block of entries (every operation is element-wise: blocks do not change bits)."""
        v_C.mul_(self.momentum)
        v_C.add_(gradient_C)
        update_C = v_C * self.momentum
        update_C = gradient_C + update_C
        update_C.mul_(self.lr)
        theta_C.sub_(update_C)

    def step_sparse(
        self, theta_N: torch.Tensor, indices_K: torch.Tensor, values_K: torch.Tensor, *, chunk_numel: int
    ) -> None:
        """:meth:`step` with the pseudo-gradient given sparsely (zero except ``values_K`` at the distinct flat
        ``indices_K``), applied block by block: bit-identical to ``step`` on the dense tensor, with temporaries
        of one block of ``chunk_numel`` entries instead of three of the model's size.

        The momentum buffer must exist (set ``momentum_N`` to zeros of ``theta_N``'s shape, on the device and in
        the memory of the caller's choice, before the first step). Raises :class:`ValueError` for a missing or
        mismatched momentum buffer, indices and values of different lengths, or ``chunk_numel < 1``; an index
        out of range raises :class:`IndexError` (``theta_N`` may then be partly updated).
        """
        if self.momentum_N is None:
            raise ValueError("step_sparse needs a momentum buffer: set momentum_N before the first step")
        if self.momentum_N.shape != theta_N.shape or theta_N.dim() != 1:
            raise ValueError(f"momentum {tuple(self.momentum_N.shape)} and theta {tuple(theta_N.shape)} differ")
        if indices_K.shape != values_K.shape:
            raise ValueError(f"indices {tuple(indices_K.shape)} and values {tuple(values_K.shape)} differ")
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be at least 1, got {chunk_numel}")
        indices_K = indices_K.to(theta_N.device)
        values_K = values_K.to(theta_N.device, torch.float32)
        if indices_K.numel() > 1 and not bool((indices_K[1:] > indices_K[:-1]).all()):
            indices_K, order = torch.sort(indices_K)
            values_K = values_K[order]
        numel = theta_N.numel()
        if indices_K.numel() and not (int(indices_K[0]) >= 0 and int(indices_K[-1]) < numel):
            raise IndexError(f"pseudo-gradient indices outside [0, {numel})")
        stops = torch.arange(chunk_numel, numel + chunk_numel, chunk_numel, dtype=torch.int64)
        cuts = [0, *torch.searchsorted(indices_K.cpu(), stops).tolist()]
        for j, start in enumerate(range(0, numel, chunk_numel)):
            stop = min(start + chunk_numel, numel)
            gradient_C = torch.zeros(stop - start, dtype=torch.float32, device=theta_N.device)
            gradient_C[indices_K[cuts[j] : cuts[j + 1]] - start] = values_K[cuts[j] : cuts[j + 1]]
            self._step_chunk(theta_N[start:stop], gradient_C, self.momentum_N[start:stop])

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
