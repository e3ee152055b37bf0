"""The glue to the tools users already run: TRL, transformers and accelerate.

- :class:`PulseLoCoCallback` / :class:`PulseSyncCallback` (``transformers.TrainerCallback``): make any Trainer
  (TRL's ``GRPOTrainer``, ``SFTTrainer``, a plain ``Trainer``) a PULSELoCo peer that publishes its versions;
- :class:`PulseLoCoArguments`: the same options as one dataclass for ``TrlParser`` / ``HfArgumentParser``;
- :class:`SwarmRollouts`: a TRL ``rollout_func`` whose completions come from the swarm's rollout workers;
- :func:`skip_vllm_import`: keep TRL from importing vLLM in a process that will not use it.

Importing this package is cheap: the submodules (transformers, torch, hivemind) load on first use. It also makes
two of TRL's warnings appear once per process, with the reason they need no action, instead of once per TRL module
(:func:`dedupe_trl_warnings`, :func:`explain_trl_warnings`; import it before ``trl`` for that to cover TRL's own
import).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from pulseloco._lazy import lazy_attributes
from pulseloco.integrations.trl_warnings import dedupe_trl_warnings, explain_trl_warnings

if TYPE_CHECKING:
    from pulseloco.integrations.args import PulseLoCoArguments
    from pulseloco.integrations.pulsesync import PulseSyncCallback
    from pulseloco.integrations.swarm_rollouts import SwarmRollouts
    from pulseloco.integrations.trainer import PulseLoCoCallback

__all__ = [
    "PulseLoCoArguments",
    "PulseLoCoCallback",
    "PulseSyncCallback",
    "SwarmRollouts",
    "dedupe_trl_warnings",
    "explain_trl_warnings",
    "skip_vllm_import",
]


_LAZY = {
    "PulseLoCoArguments": "pulseloco.integrations.args",
    "PulseLoCoCallback": "pulseloco.integrations.trainer",
    "PulseSyncCallback": "pulseloco.integrations.pulsesync",
    "SwarmRollouts": "pulseloco.integrations.swarm_rollouts",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


def skip_vllm_import() -> None:
    """Keep TRL from importing vLLM in this process, which will not use it (call it before importing TRL, and only
    in a process of its own: a script, not a library a caller imports).

    TRL imports vLLM at import time whenever it is installed (``trl.import_utils.is_vllm_available``), about 6 s
    of CPU per process on 2 cores, though a trainer that generates with its own model or takes its completions
    from rollout workers never calls it. A ``None`` entry in ``sys.modules`` is Python's documented way to mark a
    module as unavailable: ``importlib.util.find_spec`` then reports it missing and TRL skips it; an ``import
    vllm`` later in the process raises ``ImportError``. Does nothing when vLLM is already imported; never raises."""
    if sys.modules.get("vllm") is None:
        sys.modules["vllm"] = None  # type: ignore[assignment]


dedupe_trl_warnings()
