"""A round's completions made fit to train on: stale groups dropped, every worker's group checked, failures
generated again, and the trainer's log-probabilities in place of the workers'."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from pulseloco.rollouts.client import GroupResult, RolloutClient
from pulseloco.rollouts.verify import RolloutVerifier

logger = logging.getLogger(__name__)

__all__ = ["Settled", "settle"]


@dataclass
class Settled:
    """A batch after :func:`settle`: its ``results`` (none stale, every worker's group checked), the ``newest``
    version at the last look, and the seconds spent checking."""

    results: list[GroupResult]
    newest: int | None
    verify_seconds: float


def settle(
    results: list[GroupResult],
    groups: Sequence[Sequence[int]],
    *,
    client: RolloutClient,
    verifier: RolloutVerifier | None,
    model: torch.nn.Module,
    max_lag: int,
    temperature: float,
    max_new_tokens: int,
    stop_ids: set[int],
    regenerate: Callable[[list[int], bool], list[GroupResult]],
    attempts: int,
) -> Settled:
    """Make a batch of results fit to train on: groups generated more than ``max_lag`` versions before the newest
    are dropped (counted in the client's stats), groups of workers checked by ``verifier`` (None: not checked), and
    the groups of a lease that fails the checks, or of a worker refused meanwhile, dropped too; every dropped group
    is generated again by ``regenerate(indices, last)`` (the newest version may move meanwhile, so this repeats),
    at most ``attempts`` times, then once more with ``last=True``, whose results (the trainer's own, ``version``
    -1) are taken as they are. Each failed lease is reported with
    :meth:`pulseloco.rollouts.client.RolloutClient.report_check_failure`, and a worker the near-miss guard refuses
    is refused at once (:meth:`~pulseloco.rollouts.client.RolloutClient.refuse`). ``results[g]`` answers
    ``groups[g]``. A worker's log-probabilities are replaced by the trainer's (:meth:`RolloutVerifier.sampling_logps`).
    A batch whose groups were checked in more than one call has its log-probabilities computed again in one
    (:meth:`RolloutVerifier.share`): more forward passes, only in such rounds, that keep training bit for bit what
    it is when every group passes at once (so a dishonest worker's leases, failed and generated again, change
    nothing)."""
    results = list(results)
    verified: set[int] = set()
    seconds = 0.0
    calls = 0
    newest = client.newest_version()
    for attempt in range(attempts + 1):
        if attempt:
            newest = client.newest_version()
        stale = {i for i, r in enumerate(results) if r.version >= 0 and client.lag(r.version) > max_lag}
        client.stats.stale_dropped += sum(len(results[i].completion_ids) for i in stale)
        refused = client.stats.refusals
        redo = stale | {i for i, r in enumerate(results) if r.version >= 0 and r.worker in refused}
        todo = [i for i, r in enumerate(results) if r.version >= 0 and i not in verified and i not in redo]
        if verifier is not None and todo:
            started = time.perf_counter()
            leases = verifier.check(
                model,
                [groups[i] for i in todo],
                [results[i] for i in todo],
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                stop_ids=stop_ids,
            )
            seconds += time.perf_counter() - started
            calls += 1
            for check in leases.values():
                if check.reason is not None:
                    client.report_check_failure(check.worker, check.lease_id, check.reason)
                if check.refuse is not None and check.worker not in refused:
                    client.refuse(check.worker, check.refuse)
            failed = {lease_id for lease_id, c in leases.items() if c.reason is not None or c.unverifiable}
            redo |= {i for i in todo if results[i].lease_id in failed or results[i].worker in refused}
            # a worker on probation: its groups with a near miss are generated again, not trained on
            redo |= {todo[k] for c in leases.values() for k in c.held_back}
        verified.update(i for i in todo if i not in redo)
        if not redo:
            break
        indices = sorted(redo)
        for i, result in zip(indices, regenerate(indices, attempt == attempts)):
            results[i] = result
    if verifier is not None:
        if calls > 1 and all(r.version >= 0 for r in results):
            # groups checked in several calls: their log-probabilities again in one, so that they are those of a
            # round whose groups all passed at once (the same rows, the same forward passes), bit for bit
            started = time.perf_counter()
            verifier.share(model, groups, results, temperature=temperature)
            seconds += time.perf_counter() - started
        results = [_trainers_logps(verifier, groups[g], r) for g, r in enumerate(results)]
    return Settled(results, newest, seconds)


def _trainers_logps(verifier: RolloutVerifier, prompt: Sequence[int], result: GroupResult) -> GroupResult:
    """``result`` with the trainer's log-probabilities in place of the worker's (a group the trainer generated
    itself, ``version`` -1, as it is). Raises RuntimeError for a worker's completion no check passed: a bug."""
    if result.version < 0:
        return result
    logprobs = []
    for ids in result.completion_ids:
        values = verifier.sampling_logps(prompt, ids)
        if values is None:
            raise RuntimeError(f"completion of lease {result.lease_id} reached training without passing the checks")
        logprobs.append(values)
    return replace(result, logprobs=logprobs)
