"""Replayable sampling: a keyed, counter-based Gumbel-max rule that a trainer can check at any position.

Every completion of a lease is sampled as follows. At position ``t`` of the lease's completion ``i`` (prompt-major:
``i = prompt * num_samples + sample``), with the lease's ``seed`` and temperature ``T``, the token is::

    argmax_k  logits_k / T + g(seed, i, t, k)        g = -log(-log(u)),  u = (hash(seed, i, t, k) + 0.5) / 2**24

where ``hash`` is a fixed integer mix (:func:`gumbel_noise`). The maximum of Gumbel-perturbed scores is an exact
sample of ``softmax(logits / T)`` (the Gumbel-max trick), so the workers' completions are ordinary samples of the
policy and their log-probabilities are ``log_softmax(logits / T)`` at the chosen token. But the noise is a function
of ``(seed, i, t, k)`` alone: a trainer that has the logits of a completion (from the forward pass over it) can
regenerate the noise for any position without replaying the others and recompute the choice
(:func:`check_completions`). A worker that samples with other weights, another seed of its own (cherry-picking the
best of several samples), or writes a chosen text, picks tokens that are not the perturbed argmax.

Both engines sample with this rule: :class:`pulseloco.rollouts.engines.hf.TransformersEngine` through a
``transformers`` logits processor, :class:`pulseloco.rollouts.engines.vllm.VLLMEngine` through a vLLM logits processor.
The processors (:func:`choose`) turn each row of logits into a row that is ``-inf`` except at the chosen token,
whose value is that token's log-probability; the engines then decode greedily and report that value (vLLM's
``processed_logits``, transformers' processed scores) as the sampling log-probability.

The hash uses 32-bit lanes inside int64 tensors and never overflows, so it gives the same bits on every device;
the noise is computed in float32, whose rounding (an ulp of ``log``) differs between devices far below the margin
the checks allow (:mod:`pulseloco.rollouts.tolerances`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["CheckResult", "check_completions", "choose", "gumbel_noise", "lead_lost"]

_MASK = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_TOKEN_SALT = 0x7F4A7C15


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``x`` in [0, 2**32) without int64 overflow (16-bit halves of the constant)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


_TOKEN_KEYS: dict[tuple[int, str], torch.Tensor] = {}


def _token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The per-token half of the hash, computed once per vocabulary size and device."""
    key = (vocab_size, str(device))
    cached = _TOKEN_KEYS.get(key)
    if cached is None:
        cached = _fmix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _TOKEN_SALT)
        _TOKEN_KEYS[key] = cached
    return cached


def _keys(seed: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, sequence, position) row (int64 tensors of one shape; seed < 2**63)."""
    seed_low, seed_high = seed & _MASK, (seed >> 32) & _MASK
    key = _fmix32((position & _MASK) ^ _GOLDEN)
    key = _fmix32(key ^ (sequence & _MASK))
    key = _fmix32(key ^ seed_high)
    return _fmix32(key ^ seed_low)


def gumbel_noise(
    seed: torch.Tensor | int, sequence: torch.Tensor | int, position: torch.Tensor | int, vocab_size: int
) -> torch.Tensor:
    """The Gumbel noise ``g(seed, i, t, k)`` for every token id ``k < vocab_size``: float32 of shape
    ``(*rows, vocab_size)``, where ``seed``, ``sequence`` and ``position`` broadcast to ``rows`` (int64; a seed
    is in [0, 2**63)). Deterministic: the same arguments give the same bits on any device."""
    seed_t = torch.as_tensor(seed, dtype=torch.int64)
    device = seed_t.device
    sequence_t = torch.as_tensor(sequence, dtype=torch.int64, device=device)
    position_t = torch.as_tensor(position, dtype=torch.int64, device=device)
    seed_t, sequence_t, position_t = torch.broadcast_tensors(seed_t, sequence_t, position_t)
    keys = _keys(seed_t, sequence_t, position_t).unsqueeze(-1)
    tokens = _token_keys(vocab_size, device)
    bits = _fmix32(keys ^ tokens) >> 8  # 24 bits: exact in float32
    # u = (bits + 0.5) / 2**24. -log(u) is computed from whichever of u and 1 - u is below 1/2, where float32 holds
    # it exactly (23 bits and a half): log(u) below, log1p(-(1 - u)) above, accurate to rounding even for u near 1
    scale = 1.0 / (1 << 24)
    low = (bits.to(torch.float32) + 0.5) * scale
    high = (((1 << 24) - 1 - bits).to(torch.float32) + 0.5) * scale
    neg_log = torch.where(bits < (1 << 23), -torch.log(low), -torch.log1p(-high))
    return -torch.log(neg_log)


def choose(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    seed: torch.Tensor,
    sequence: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """The sampling rule for one step of a batch: ``logits`` ``(rows, vocab)``; per row its temperature (a number
    or a ``(rows,)`` tensor), seed, sequence index and position. Returns a float32 ``(rows, vocab)`` tensor that
    is ``-inf`` except at each row's chosen token, where it holds that token's log-probability under
    ``softmax(logits / temperature)``: a greedy decoder picks the chosen token and reports its log-probability."""
    temperature_t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if temperature_t.dim() == 1:
        temperature_t = temperature_t.unsqueeze(-1)
    scaled = logits.float() / temperature_t
    noise = gumbel_noise(seed.to(torch.int64), sequence, position, logits.shape[-1]).to(logits.device)
    chosen = (scaled + noise).argmax(dim=-1, keepdim=True)
    logprob = scaled.log_softmax(dim=-1).gather(-1, chosen)
    out = torch.full_like(scaled, float("-inf"))
    return out.scatter_(-1, chosen, logprob)


@dataclass(frozen=True)
class CheckResult:
    """What :func:`check_completions` found in one completion.

    ``checked``: positions whose choice was recomputed; ``mismatches``: of those, positions where the completion's
    token trails the perturbed argmax by more than the margin (or is not a token of the vocabulary, or its
    log-probability is not a finite number); ``near``: positions where it is not the argmax but within the margin;
    ``band_positions`` and ``band_near``: per band of spread (the argmax's lead over the runner-up; the bands'
    upper edges are :func:`check_completions`'s ``bands``), the checked positions and the near misses among them;
    ``worst_gap``: the largest gap (perturbed score of the
    argmax minus that of the completion's token) over the checked positions; ``lead``: the smallest lead of the
    completion's token over every other token's perturbed score (negative where it is not the argmax; ``inf`` for
    no position); ``logprob_error``: the mean absolute difference between the worker's log-probabilities and the
    trainer's; ``max_logprob_error``: the largest one (``inf`` for a log-probability that is not finite).
    """

    checked: int
    mismatches: int
    near: int
    band_positions: tuple[int, ...]
    band_near: tuple[int, ...]
    worst_gap: float
    lead: float
    logprob_error: float
    max_logprob_error: float


@torch.no_grad()
def check_completions(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor,
    *,
    temperature: float,
    seeds: torch.Tensor,
    sequences: torch.Tensor,
    margin: float | torch.Tensor,
    bands: torch.Tensor | None = None,
    check: torch.Tensor | None = None,
    gaps_out: list[float] | None = None,
    logprobs_out: list[list[float]] | None = None,
    winners_out: list[tuple[list[int], list[float]]] | None = None,
) -> list[CheckResult]:
    """Check completions against the trainer's own logits.

    ``logits``: ``(n, length, vocab)``, the trainer's logits that predict each completion token; ``tokens``,
    ``mask`` (1 for a real token) and the worker's ``logprobs``: ``(n, length)``; ``seeds`` and ``sequences``: the
    lease seed and the sequence index ``i`` of each completion (``(n,)``); ``margin``: one for all, or one per
    completion (``(n,)``); ``bands``: the upper edges of the spread bands, ``(n, B)`` (default: one band, the
    margin). ``check``: the positions whose choice is recomputed (a boolean
    ``(n, length)`` subset of ``mask``; default: all of them). ``gaps_out``: a list that receives the gap of every
    checked position (to measure the margin); ``logprobs_out``: a list that receives, per completion, the trainer's
    log-probability of each of its real tokens under ``softmax(logits / T)``; ``winners_out``: a list that receives,
    per completion, the perturbed argmax at each of its real tokens and its lead over the runner-up (what
    :func:`lead_lost` compares another model's logits with). Returns one :class:`CheckResult` per completion. It
    never raises for what a worker sent: a token id outside ``[0, vocab)`` is a mismatch (its gap
    infinite), a log-probability that is not finite an infinite error; the caller decides.
    """
    n, length, vocab = logits.shape
    device = logits.device
    mask = mask.to(device=device, dtype=torch.bool)
    check = mask if check is None else (check.to(device=device, dtype=torch.bool) & mask)
    tokens = tokens.to(device=device, dtype=torch.int64)
    foreign = ((tokens < 0) | (tokens >= vocab)) & mask
    tokens = tokens.clamp(0, vocab - 1)
    positions = torch.arange(length, device=device).expand(n, length)
    scaled = logits.float() / temperature
    own = scaled.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    error = (own - logprobs.to(device=device, dtype=torch.float32)).abs()
    error = torch.where(torch.isfinite(error) & ~foreign, error, torch.inf).masked_fill(~mask, 0.0)
    leads = torch.full((n, length), torch.inf, dtype=torch.float32, device=device)
    spreads = torch.full((n, length), torch.inf, dtype=torch.float32, device=device)
    winners = torch.zeros((n, length), dtype=torch.int64, device=device)
    rows, cols = check.nonzero(as_tuple=True)
    if rows.numel():
        seed_rows = seeds.to(device=device, dtype=torch.int64)[rows]
        sequence_rows = sequences.to(device=device, dtype=torch.int64)[rows]
        chunk = max(1, (1 << 24) // max(vocab, 1))  # bounds the noise tensor to about 64 MiB
        for start in range(0, rows.numel(), chunk):
            r, c = rows[start : start + chunk], cols[start : start + chunk]
            scores = scaled[r, c] + gumbel_noise(
                seed_rows[start : start + chunk], sequence_rows[start : start + chunk], positions[r, c], vocab
            )
            mine_index = tokens[r, c].unsqueeze(-1)
            mine = scores.gather(-1, mine_index).squeeze(-1)
            others = scores.scatter(-1, mine_index, float("-inf")).max(dim=-1).values if vocab > 1 else mine - mine
            leads[r, c] = mine - others
            if vocab > 1:
                top = scores.topk(2, dim=-1)
                spreads[r, c] = top.values[:, 0] - top.values[:, 1]
                winners[r, c] = top.indices[:, 0]
    leads = torch.where(foreign, -torch.inf, leads)
    gaps = (-leads).clamp(min=0.0).masked_fill(~check, 0.0)
    if gaps_out is not None:
        gaps_out.extend(gaps[check].tolist())
    if logprobs_out is not None or winners_out is not None:
        lengths = mask.sum(-1).tolist()
        if logprobs_out is not None:
            logprobs_out.extend(values[:count] for values, count in zip(own.tolist(), lengths))
        if winners_out is not None:
            pairs = zip(winners.tolist(), spreads.tolist(), lengths)
            winners_out.extend((ids[:count], leads[:count]) for ids, leads, count in pairs)
    margins = torch.as_tensor(margin, dtype=torch.float32, device=device).expand(n).unsqueeze(1)
    edges = margins if bands is None else bands.to(device=device, dtype=torch.float32)
    near = (gaps > 0) & (gaps <= margins) & check
    band_of = torch.searchsorted(edges.contiguous(), spreads.clamp(min=0.0).contiguous(), right=False)
    in_band = [(band_of == b) & check for b in range(edges.shape[1])]
    # one tensor of per-row statistics, moved to the host once (a GPU would otherwise sync per row and value)
    empty = torch.zeros(n, device=device)
    columns = [
        check.sum(-1).float(),
        ((gaps > margins) & check).sum(-1).float(),
        near.sum(-1).float(),
        gaps.amax(-1) if length else empty,
        leads.masked_fill(~check, torch.inf).amin(-1) if length else empty + torch.inf,
        error.sum(-1) / mask.sum(-1).clamp(min=1),
        error.amax(-1) if length else empty,
    ]
    columns += [band.sum(-1).float() for band in in_band] + [(band & near).sum(-1).float() for band in in_band]
    stats = torch.stack(columns, dim=1).tolist()
    count = len(in_band)
    return [
        CheckResult(
            checked=int(row[0]),
            mismatches=int(row[1]),
            near=int(row[2]),
            band_positions=tuple(int(v) for v in row[7 : 7 + count]),
            band_near=tuple(int(v) for v in row[7 + count :]),
            worst_gap=row[3],
            lead=row[4],
            logprob_error=row[5],
            max_logprob_error=row[6],
        )
        for row in stats
    ]


@torch.no_grad()
def lead_lost(
    logits: torch.Tensor,
    winners: torch.Tensor,
    leads: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float,
    seeds: torch.Tensor,
    sequences: torch.Tensor,
) -> float:
    """The most lead another model's perturbed argmax loses under ``logits`` at any masked position: that model's
    winning token ``winners`` led its runner-up by ``leads`` (both ``(n, length)``, from
    :func:`check_completions`'s ``winners_out``); under ``logits`` (``(n, length, vocab)``, predicting the same
    tokens; ``seeds`` and ``sequences`` key the noise as there) it leads the best other token by less, or trails
    it. A token that leads under the other model by more than the result keeps the lead under ``logits`` at every
    position measured. 0.0 for no position."""
    n, length, vocab = logits.shape
    device = logits.device
    rows, cols = mask.to(device=device, dtype=torch.bool).nonzero(as_tuple=True)
    if not rows.numel() or vocab < 2:
        return 0.0
    positions = torch.arange(length, device=device).expand(n, length)
    seed_rows = seeds.to(device=device, dtype=torch.int64)[rows]
    sequence_rows = sequences.to(device=device, dtype=torch.int64)[rows]
    winners, leads = winners.to(device), leads.to(device=device, dtype=torch.float32)
    worst = torch.tensor(0.0, device=device)
    chunk = max(1, (1 << 24) // vocab)
    for start in range(0, rows.numel(), chunk):
        r, c = rows[start : start + chunk], cols[start : start + chunk]
        scores = logits[r, c].float() / temperature + gumbel_noise(
            seed_rows[start : start + chunk], sequence_rows[start : start + chunk], positions[r, c], vocab
        )
        winner = winners[r, c].unsqueeze(-1)
        lead = scores.gather(-1, winner).squeeze(-1) - scores.scatter(-1, winner, float("-inf")).max(dim=-1).values
        worst = torch.maximum(worst, (leads[r, c] - lead).max())
    return float(worst)
