"""What users add to the tools they already run.

- :class:`PulseLoCoCallback` / :class:`PulseSyncCallback` (``transformers.TrainerCallback``): make any Trainer
  (TRL's ``GRPOTrainer``, ``SFTTrainer``, a plain ``Trainer``) a PULSELoCo peer that publishes its versions;
- :class:`PulseLoCoArguments`: the same options as one dataclass for ``TrlParser`` / ``HfArgumentParser``;
- :mod:`~pulseloco.integrations.models`: loading pretrained checkpoints with one-line errors;
- :mod:`~pulseloco.integrations.rollout`: rollout engines that PULSESync keeps current;
- :class:`SwarmRollouts`: a TRL ``rollout_func`` whose completions come from the swarm's rollout workers.

Importing this package is cheap: the submodules (transformers, torch, hivemind) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pulseloco.integrations.args import PulseLoCoArguments
    from pulseloco.integrations.rollout import RolloutEngine, TransformersEngine
    from pulseloco.integrations.swarm_rollouts import SwarmRollouts
    from pulseloco.integrations.trainer import PulseLoCoCallback, PulseSyncCallback

__all__ = [
    "PulseLoCoArguments",
    "PulseLoCoCallback",
    "PulseSyncCallback",
    "RolloutEngine",
    "SwarmRollouts",
    "TransformersEngine",
]

_LAZY = {
    "PulseLoCoArguments": "pulseloco.integrations.args",
    "PulseLoCoCallback": "pulseloco.integrations.trainer",
    "PulseSyncCallback": "pulseloco.integrations.trainer",
    "RolloutEngine": "pulseloco.integrations.rollout",
    "TransformersEngine": "pulseloco.integrations.rollout",
    "SwarmRollouts": "pulseloco.integrations.swarm_rollouts",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pulseloco.integrations' has no attribute {name!r}")
