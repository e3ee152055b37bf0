"""Rollout engines: what a rollout worker generates with, and the seam where PULSESync updates its weights.

A :class:`RolloutEngine` holds the policy's BF16 weights in checkpoint coordinates (the names and shapes of the
trainer's ``state_dict``), which a :class:`pulseloco.sync.subscriber.Subscriber` patches in place, atomically
and verified by digest; then :meth:`RolloutEngine.weights_updated` tells the engine that those tensors changed
(an engine that keeps its own repacked copy reloads them there), and :meth:`RolloutEngine.generate` samples with
them. :class:`TransformersEngine` is the baseline: the BF16 weights *are* the model's parameters, so there is
nothing to reload. :class:`pulseloco.rollouts.engines.vllm.VLLMEngine` implements the same three methods on vLLM.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pulseloco.models import load_causal_lm, load_tokenizer
from pulseloco.rollouts.sampling import choose

logger = logging.getLogger(__name__)

__all__ = ["Completion", "GumbelLogitsProcessor", "RolloutEngine", "TransformersEngine", "check_generate_ids"]


def check_generate_ids(
    prompt_ids: Sequence[Sequence[int]], temperature: float, sequences: Sequence[int] | None = None
) -> list[int]:
    """What both engines' :meth:`RolloutEngine.generate_ids` refuse, and the sequence index of each prompt
    (``sequences``, default ``0, 1, ...``): raises ``ValueError`` for a temperature that is not positive, an empty
    prompt, or ``sequences`` that are not one integer in ``[0, 2**32)`` per prompt."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    if sequences is None:
        return list(range(len(prompt_ids)))
    if len(sequences) != len(prompt_ids) or not all(0 <= int(i) < 2**32 for i in sequences):
        raise ValueError(f"sequences must be one integer in [0, 2**32) per prompt ({len(prompt_ids)})")
    return [int(i) for i in sequences]


@dataclass(frozen=True)
class Completion:
    """One sampled completion in token ids.

    ``token_ids``: the generated tokens, the end-of-sequence token included when generation stopped on it, nothing
    after it. ``logprobs``: per token, its log-probability under the distribution it was sampled from (the logits
    divided by the temperature, then softmax), which is what the trainer's importance-sampling correction compares
    with its own.
    """

    token_ids: list[int]
    logprobs: list[float]


class RolloutEngine(Protocol):
    """Generates with a policy whose weights PULSESync keeps current."""

    @property
    def compute_dtype(self) -> str:
        """The precision the engine computes in (``float32``, ``bfloat16`` or ``float16``): a trainer's check
        tolerates that precision's numerical differences (:mod:`pulseloco.rollouts.tolerances`)."""
        ...

    def weights(self) -> MutableMapping[str, torch.Tensor]:
        """The BF16 weights in checkpoint coordinates, patched in place by the subscriber."""
        ...

    def weights_updated(self, changed: Mapping[str, torch.Tensor] | None = None, *, version: int | None = None) -> None:
        """Called after the subscriber changed :meth:`weights` to a complete, verified ``version``. ``changed``:
        the flat indices that changed per tensor (:attr:`pulseloco.sync.subscriber.UpdateReport.changed`); None
        when any element may have changed."""
        ...

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float | None = None) -> list[str]:
        """One completion per prompt (greedy when ``temperature`` is ``None``), without special tokens."""
        ...

    def generate_ids(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        sequences: Sequence[int] | None = None,
    ) -> list[Completion]:
        """One completion per prompt (token ids, repeated by the caller for several samples), sampled with plain
        ``temperature`` (no top-k or top-p) by the replayable rule of :mod:`pulseloco.rollouts.sampling` keyed by
        ``seed`` (prompt ``i`` is sequence ``sequences[i]``, default ``i``), and their sampling log-probabilities."""
        ...


class GumbelLogitsProcessor(LogitsProcessor):
    """The replayable sampling rule (:func:`pulseloco.rollouts.sampling.choose`) as a ``transformers`` logits
    processor: row ``i`` of the batch is sequence ``sequences[i]`` (default ``i``), the position is the number of
    tokens generated so far (the input's length minus ``prompt_width``, the left-padded prompts' width)."""

    def __init__(
        self, *, seed: int, temperature: float, prompt_width: int, sequences: Sequence[int] | None = None
    ) -> None:
        self.seed = seed
        self.temperature = temperature
        self.prompt_width = prompt_width
        self.sequences = None if sequences is None else torch.tensor(list(sequences), dtype=torch.int64)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.sequences is None:
            rows = torch.arange(scores.shape[0], device=scores.device)
        else:
            rows = self.sequences.to(scores.device)
        position = torch.full_like(rows, input_ids.shape[1] - self.prompt_width)
        chosen = choose(scores, self.temperature, torch.full_like(rows, self.seed), rows, position)
        return cast(torch.FloatTensor, chosen)


class TransformersEngine:
    """Generation with a ``transformers`` causal LM (the baseline rollout engine; also what the recipes score
    with). A rollout worker holds the published BF16 values exactly, and computes in BF16 or, widened, in FP32.

    On a BF16 model on the CPU, :meth:`weights` are the model's own floating-point state-dict tensors. Otherwise
    they are a BF16 *shadow* in host memory (``shadow``): the subscriber patches and digests the shadow on the CPU,
    and :meth:`weights_updated` copies only the changed elements into the model. On a GPU, a version so never moves
    the whole state across the bus to be hashed; on a model that computes in FP32 (a CPU without fast BF16 matrix
    products: 4.7x faster here), the model holds exactly the published BF16 values, widened. The cost is one BF16
    copy in host memory.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer (left padding is set for batched generation).
        shadow: keep a host shadow (see above); None: when the model is not on the CPU or not in BF16.
    """

    def __init__(self, model: Any, tokenizer: Any, *, shadow: bool | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        self._params = {
            name: t
            for name, t in self.model.state_dict().items()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        }
        if shadow is None:
            shadow = any(t.device.type != "cpu" or t.dtype != torch.bfloat16 for t in self._params.values())
        self.shadow = shadow
        self._weights = self._params
        if shadow:  # one host copy per storage, so tied weights stay tied in the shadow
            copies: dict[int, torch.Tensor] = {}
            self._weights = {}
            for name, t in self._params.items():
                key = t.untyped_storage().data_ptr()
                if key not in copies or copies[key].shape != t.shape:
                    pin = t.device.type == "cuda"  # pinned: the copies to the GPU run asynchronously
                    copies[key] = torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=pin).copy_(t.detach())
                self._weights[name] = copies[key]
            if any(t.dtype != torch.bfloat16 for t in self._params.values()):
                self.weights_updated(None)  # a wider model computes with exactly the shadow's rounded values

    @classmethod
    def from_pretrained(
        cls, model_name_or_path: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
    ) -> TransformersEngine:
        """Load the policy's starting checkpoint (Hugging Face format) to compute in ``dtype`` (BF16, or FP32 on
        the published BF16 values through a shadow); the publisher's first anchor replaces its weights anyway, but
        tensor names and shapes must match the trainer's.

        Raises :class:`pulseloco.errors.ConfigError` when the checkpoint cannot be loaded (see
        :func:`pulseloco.models.load_causal_lm`).
        """
        model = load_causal_lm(model_name_or_path, dtype=dtype, bytes_per_parameter=dtype.itemsize, device=device)
        tokenizer = load_tokenizer(model_name_or_path)
        return cls(model.eval(), tokenizer)

    @property
    def compute_dtype(self) -> str:
        """The dtype of the model's parameters, which its matrix products compute in."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def weights(self) -> MutableMapping[str, torch.Tensor]:
        return self._weights

    @torch.no_grad()
    def weights_updated(self, changed: Mapping[str, torch.Tensor] | None = None, *, version: int | None = None) -> None:
        """Without a shadow, nothing to do: :meth:`weights` are the model's own parameters. With one, copy the
        ``changed`` elements (every element of every tensor when None) from the shadow to the model; a tensor
        absent from ``changed`` did not change."""
        if not self.shadow:
            return
        for name, param in self._params.items():
            source = self._weights[name]
            if changed is None or not param.is_contiguous():
                param.copy_(source.to(param.device, non_blocking=True))
                continue
            indices = changed.get(name)
            if indices is None or indices.numel() == 0:
                continue
            flat = param.view(-1)
            idx = indices.to(torch.int64)
            values = source.reshape(-1).index_select(0, idx).to(param.device, param.dtype)
            flat.index_copy_(0, idx.to(param.device), values)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float | None = None) -> list[str]:
        if not prompts:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def generate_ids(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        sequences: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample one completion per prompt with the replayable rule of :mod:`pulseloco.rollouts.sampling` (plain
        ``temperature``, prompt ``i`` of the call is sequence ``sequences[i]``, default ``i``) and return each
        token's log-probability under the distribution it was drawn from (``softmax(logits / temperature)``).
        Prompts are left-padded into one batch. ``seed``: the key of the noise (None: a random one). Raises
        ``ValueError`` for an empty prompt, a temperature that is not positive, or bad ``sequences``."""
        if not prompt_ids:
            return []
        sequences = check_generate_ids(prompt_ids, temperature, sequences)
        if seed is None:
            seed = random.getrandbits(63)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        sampler = GumbelLogitsProcessor(seed=seed, temperature=temperature, prompt_width=width, sequences=sequences)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=input_ids.to(self.model.device),
                attention_mask=attention_mask.to(self.model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,  # the processor has chosen: greedy decoding takes its choice
                logits_processor=LogitsProcessorList([sampler]),
                pad_token_id=pad,
                eos_token_id=self.tokenizer.eos_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
        finally:
            self.model.train(was_training)
        tokens = out.sequences[:, width:].cpu()
        # scores: the processor's rows, -inf except at the chosen token, which holds its log-probability
        chosen = torch.stack([s.float().cpu() for s in out.scores], dim=1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        eos = self.tokenizer.eos_token_id
        completions = []
        for row in range(tokens.shape[0]):
            ids = tokens[row].tolist()
            length = len(ids)
            if eos is not None and eos in ids:
                length = ids.index(eos) + 1  # keep the end-of-sequence token, drop the padding after it
            completions.append(Completion(ids[:length], chosen[row, :length].tolist()))
        return completions

    def _generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float | None) -> list[str]:
        batch = self.tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
        batch = batch.to(self.model.device)
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        out = self.model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            **sampling,
        )
        completions = out[:, batch["input_ids"].shape[1] :]
        return [str(text) for text in self.tokenizer.batch_decode(completions, skip_special_tokens=True)]
