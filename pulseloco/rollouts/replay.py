"""The forward passes of the rollout check: completions replayed under given weights.

:class:`~pulseloco.rollouts.verify.RolloutVerifier` decides what to replay and with which weights; this module
runs the passes. :func:`replay` checks rows (:class:`Row`: one completion each) against the replayable sampler's
choice under a model's logits (:func:`pulseloco.rollouts.sampling.check_completions`) in chunks that bound the
logits held at once; :func:`completion_logits` computes those logits with each distinct prompt run once;
:class:`PinnedWeights` holds a second model with a published version's weights.

Failure behaviour: errors of the model propagate; nothing here looks at what a worker sent beyond the rows the
caller built (token ids are checked against the vocabulary before rows reach this module).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import NamedTuple

import torch

from pulseloco.rollouts.sampling import CheckResult, check_completions, lead_lost
from pulseloco.rollouts.tolerances import Tolerance

logger = logging.getLogger(__name__)

__all__ = ["MAX_CHUNK_LOGITS", "Checked", "PinnedWeights", "Replay", "Row", "completion_logits", "replay"]

#: Logits held at once per chunk of the forward pass (elements; 2**27 float32 values are 512 MiB).
MAX_CHUNK_LOGITS = 1 << 27


class Row(NamedTuple):
    """A completion as the checks see it."""

    lease_id: str
    prompt: list[int]
    ids: list[int]
    logprobs: list[float]
    seed: int
    sequence: int
    version: int
    group: int = -1
    """The index of its group (prompt) in the call that checks it."""

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(self.prompt), tuple(self.ids)


class Checked(NamedTuple):
    """One row's check with one set of weights: its result, the trainer's log-probabilities of its tokens, and
    (when asked) the perturbed argmax at each position with its lead over the runner-up."""

    result: CheckResult
    logprobs: list[float]
    winners: tuple[list[int], list[float]] | None


class Replay(NamedTuple):
    """What :func:`replay` found: per row index its :class:`Checked`, the most lead the reference's winners lost
    under the model (0 without a reference), and the seconds spent in the model's forward passes."""

    checked: dict[int, Checked]
    lost: float
    forward_seconds: float


def replay(
    model: torch.nn.Module,
    rows: list[Row],
    indices: list[int],
    tolerances: list[Tolerance | None],
    temperature: float,
    *,
    gaps_out: list[float] | None = None,
    winners: set[int] | None = None,
    reference: dict[int, Checked] | None = None,
) -> Replay:
    """Check ``rows[i]`` for ``i`` in ``indices`` with ``model`` in eval mode, in chunks (:data:`MAX_CHUNK_LOGITS`):
    per row its result, the trainer's log-probabilities of its tokens and, for the rows in ``winners``, the
    perturbed argmax at each position with its lead. With ``reference`` (checks of the same rows with other weights,
    holding their winners), also the most lead those winners lose under ``model``. ``gaps_out`` collects every gap
    computed. The model's training mode is restored, also when it raises."""
    out: dict[int, Checked] = {}
    lost, forward_seconds = 0.0, 0.0
    if not indices:
        return Replay(out, lost, forward_seconds)
    was_training = model.training
    model.eval()
    try:
        for chunk in _chunks(rows, indices, model):
            members = [rows[i] for i in chunk]
            length = max(len(r.ids) for r in members)
            mask = torch.tensor([[True] * len(r.ids) + [False] * (length - len(r.ids)) for r in members])
            started = time.perf_counter()
            logits = completion_logits(model, members, length)
            forward_seconds += time.perf_counter() - started  # the host's; on a GPU, until the kernels are queued
            seeds = torch.tensor([r.seed for r in members], dtype=torch.int64)
            sequences = torch.tensor([r.sequence for r in members], dtype=torch.int64)
            if reference is not None:
                won = [reference[i].winners for i in chunk]
                assert all(w is not None for w in won)  # noqa: S101 (the caller kept them)
                lost = max(
                    lost,
                    lead_lost(
                        logits,
                        torch.tensor([w[0] + [0] * (length - len(w[0])) for w in won if w], dtype=torch.int64),
                        torch.tensor([w[1] + [0.0] * (length - len(w[1])) for w in won if w]),
                        mask,
                        temperature=temperature,
                        seeds=seeds,
                        sequences=sequences,
                    ),
                )
            logprobs: list[list[float]] = []
            found: list[tuple[list[int], list[float]]] = []
            results = check_completions(
                logits,
                torch.tensor([r.ids + [0] * (length - len(r.ids)) for r in members], dtype=torch.long),
                mask,
                torch.tensor([r.logprobs + [0.0] * (length - len(r.logprobs)) for r in members]),
                temperature=temperature,
                seeds=seeds,
                sequences=sequences,
                margin=torch.tensor([_margin(tolerances[i]) for i in chunk]),
                bands=_band_edges([tolerances[i] for i in chunk]),
                gaps_out=gaps_out,
                logprobs_out=logprobs,
                winners_out=found if winners else None,
            )
            for j, (i, result, values) in enumerate(zip(chunk, results, logprobs)):
                kept = found[j] if winners and i in winners else None
                out[i] = Checked(result, values, kept)
    finally:
        model.train(was_training)
    return Replay(out, lost, forward_seconds)


def completion_logits(model: torch.nn.Module, chunk: list[Row], length: int) -> torch.Tensor:
    """The logits that predict each completion token, ``(len(chunk), length, vocab)`` (past a completion's end:
    what its padding gives, for the caller to mask). A group's completions share their prompt: each distinct
    prompt runs once (rows with prompts of one length together, unpadded), its last position predicting the
    first completion token, and its KV cache, selected once per completion, serves the completions' forward
    pass (right-padded: causal attention leaves the real tokens alone). With ``G`` completions per prompt the
    prompt's share of the work is divided by ``G``."""
    device = next(model.parameters()).device
    out: torch.Tensor | None = None
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(chunk):
        by_length.setdefault(len(row.prompt), []).append(i)
    for width, members in by_length.items():
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(chunk[i].prompt), len(distinct)) for i in members]
        # the prompt's last position alone predicts a checked token (the first of each completion)
        first = model(input_ids=torch.tensor(list(distinct), device=device), use_cache=True, logits_to_keep=1)
        index = torch.tensor(which, device=device)
        parts = [first.logits[index]]
        wide = max(len(chunk[i].ids) for i in members) - 1  # a completion's last token predicts nothing checked
        if wide > 0:  # completion token j predicts token j + 1
            cache = first.past_key_values
            cache.batch_select_indices(index)
            heads = [chunk[i].ids[:wide] for i in members]
            ids = [c + [0] * (wide - len(c)) for c in heads]
            attention = [[1] * (width + len(c)) + [0] * (wide - len(c)) for c in heads]
            second = model(
                input_ids=torch.tensor(ids, device=device),
                attention_mask=torch.tensor(attention, device=device),
                past_key_values=cache,
                use_cache=False,
            )
            parts.append(second.logits)
        logits = torch.cat(parts, dim=1)[:, :length]
        if out is None:
            out = logits.new_zeros((len(chunk), length, logits.shape[-1]))
        out[torch.tensor(members, device=device), : logits.shape[1]] = logits
    assert out is not None  # noqa: S101 (a chunk has rows)
    return out


class PinnedWeights:
    """A second model of the trainer's model's class and config, in its dtypes and on its device, holding one
    published version's weights at a time: made once and reloaded when the version changes.

    Built from the config, not copied: a trainer's model may carry a ``forward`` wrapped by ``accelerate``
    (autocast, output conversion) in a closure over the original module, which a deep copy would keep calling, so
    the copy would compute with the trainer's weights. Each parameter and buffer takes the dtype of the trainer's
    (a blanket cast would round buffers the model keeps in FP32, such as rotary frequencies, and the replay would
    differ from every engine's). Its initialisation leaves the trainer's random generators as they were."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.version: int | None = None

    def load(self, model: torch.nn.Module, version: int, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The pinned model holding ``state`` (the published BF16 weights of ``version``), built like ``model``."""
        if self.model is None:
            parameter = next(model.parameters())
            # its random initialisation (overwritten below) must not draw from the trainer's generators: whether a
            # run builds this model would otherwise change its training
            cuda = [parameter.device] if parameter.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda), torch.device(parameter.device):
                pinned = type(model)(copy.deepcopy(model.config))
            self.model = _same_dtypes(pinned, model).eval()
            self.version = None
        if self.version != version:
            with torch.no_grad():
                for name, tensor in self.model.state_dict().items():
                    if name in state:
                        tensor.copy_(state[name])
            self.version = version
        return self.model


def _chunks(rows: list[Row], indices: list[int], model: torch.nn.Module) -> list[list[int]]:
    """``indices`` in chunks whose logits stay within :data:`MAX_CHUNK_LOGITS`, rows of similar lengths together
    (they pad less)."""
    vocab = int(getattr(model.config, "vocab_size", 0) or 1)
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in sorted(indices, key=lambda i: len(rows[i].prompt) + len(rows[i].ids)):
        width = len(rows[i].prompt) + len(rows[i].ids)
        if current and (len(current) + 1) * width * vocab > MAX_CHUNK_LOGITS:
            chunks.append(current)
            current = []
        current.append(i)
    if current:
        chunks.append(current)
    return chunks


def _same_dtypes(pinned: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """``pinned`` with each parameter and buffer in the dtype of ``model``'s of the same name."""
    dtypes = {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}
    for module_name, module in pinned.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            param.data = param.data.to(dtypes.get(prefix + name, param.dtype))
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(dtypes.get(prefix + name, buffer.dtype))
    return pinned


def _margin(tolerance: Tolerance | None) -> float:
    return tolerance.margin if tolerance is not None else 0.0


def _band_edges(tolerances: list[Tolerance | None]) -> torch.Tensor:
    """The rows' spread bands as one ``(rows, most bands)`` tensor, padded with infinity (a row reads its own)."""
    widest = max((len(t.bands) for t in tolerances if t is not None), default=1)
    edges = torch.full((len(tolerances), widest), torch.inf)
    for row, tolerance in enumerate(tolerances):
        if tolerance is not None:
            edges[row, : len(tolerance.bands)] = torch.tensor(tolerance.bands)
    return edges
