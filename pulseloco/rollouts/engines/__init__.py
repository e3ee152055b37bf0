"""Rollout engines: what a rollout worker generates with, and the seam where PULSESync updates its weights.

- :mod:`~pulseloco.rollouts.engines.hf`: the :class:`RolloutEngine` protocol, :class:`Completion` and
  :class:`TransformersEngine` (transformers' ``generate`` with the replayable sampling rule);
- :mod:`~pulseloco.rollouts.engines.vllm`: :class:`VLLMEngine`, the same methods on vLLM, with its weight loading
  (:mod:`~pulseloco.rollouts.engines.vllm_backend`) and sampler (:mod:`~pulseloco.rollouts.engines.vllm_sampler`).

Importing this package is cheap: each engine loads torch, transformers or vLLM on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pulseloco._lazy import lazy_attributes

if TYPE_CHECKING:
    from pulseloco.rollouts.engines.hf import Completion, RolloutEngine, TransformersEngine
    from pulseloco.rollouts.engines.vllm import VLLMEngine

__all__ = ["Completion", "RolloutEngine", "TransformersEngine", "VLLMEngine"]

__getattr__ = lazy_attributes(
    __name__,
    {
        "Completion": "pulseloco.rollouts.engines.hf",
        "RolloutEngine": "pulseloco.rollouts.engines.hf",
        "TransformersEngine": "pulseloco.rollouts.engines.hf",
        "VLLMEngine": "pulseloco.rollouts.engines.vllm",
    },
)
