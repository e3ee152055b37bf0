"""A steering rollout worker: the replayable sampler, except that at each position it picks, of the tokens close to
the sampler's choice, the one it prefers. What ``experiments/attacks/bench_attacks.py`` measures and the rollout tests'
rogue worker sends (tests/rollout_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["steer"]

Choose = Callable[[int, list[int], list[int]], int]
"""``choose(row, ids so far, close tokens best first) -> token``: the steering worker's pick at one position."""


def steer(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    aim: float,
    choose: Choose,
    seed: int,
    sequences: Sequence[int] | None,
    max_new_tokens: int,
    temperature: float,
    eos: int,
) -> list[Any]:
    """Completions (:class:`pulseloco.rollouts.engines.hf.Completion`) of ``prompts`` (row ``i`` is sequence
    ``sequences[i]``, default ``i``, of the noise keyed by ``seed``) where, at each position, the worker takes
    ``choose(i, ids, close)`` of the tokens whose perturbed score trails the best by less than ``aim`` nats (best
    first), reporting that token's true log-probability under ``model`` (the served weights); it stops after ``eos``.
    One unbatched forward pass per position (slow; for benchmarks and tests on small models)."""
    import torch

    from pulseloco.rollouts.engines.hf import Completion
    from pulseloco.rollouts.sampling import gumbel_noise

    out = []
    rows = range(len(prompts)) if sequences is None else sequences
    with torch.no_grad():
        for row, (prompt, sequence) in enumerate(zip(prompts, rows)):
            ids: list[int] = []
            logprobs: list[float] = []
            for position in range(max_new_tokens):
                logits = model(input_ids=torch.tensor([list(prompt) + ids])).logits[0, -1].float() / temperature
                scores = logits + gumbel_noise(int(seed), int(sequence), position, logits.shape[-1])
                order = scores.argsort(descending=True)
                close = [int(t) for t in order if scores[t] >= scores[order[0]] - aim]
                token = choose(row, ids, close)
                ids.append(token)
                logprobs.append(float(logits.log_softmax(-1)[token]))
                if token == eos:
                    break
            out.append(Completion(ids, logprobs))
    return out
