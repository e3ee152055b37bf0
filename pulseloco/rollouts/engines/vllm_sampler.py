"""The replayable sampling rule as a vLLM logits processor: :class:`GumbelSampler`, with which
:meth:`pulseloco.rollouts.engines.vllm.VLLMEngine.generate_ids` samples.

A request whose ``SamplingParams.extra_args`` hold :data:`SAMPLER_ARGS` (the lease's seed, the request's sequence
index and the temperature) and that vLLM decodes greedily gets the token :func:`pulseloco.rollouts.sampling.choose`
picks, and vLLM, run with ``logprobs_mode`` :data:`LOGPROBS_MODE`, reports that token's log-probability under
``softmax(logits / temperature)``, which the trainer's checks replay. The processor runs inside vLLM's engine
processes.

This module imports without vLLM (the processor's base is then ``object``).

Failure behaviour: :meth:`GumbelSampler.validate_params` raises ``ValueError`` for malformed sampler arguments
(vLLM turns it into its validation error); requests without them pass through untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from pulseloco.rollouts.sampling import choose

__all__ = ["LOGPROBS_MODE", "SAMPLER_ARGS", "GumbelSampler"]

#: vLLM's ``logprobs_mode`` here: the logits after the logits processors. :class:`GumbelSampler` leaves one finite
#: value per row, the chosen token's log-probability under ``softmax(logits / temperature)`` (what the sample was
#: drawn from), which the trainer's importance-sampling correction compares with its own.
LOGPROBS_MODE = "processed_logits"

#: The key of ``SamplingParams.extra_args`` that turns :class:`GumbelSampler` on for a request: a dict with the
#: lease's ``seed``, the request's ``sequence`` index and the ``temperature``.
SAMPLER_ARGS = "pulseloco_sampler"


def _sampler_base() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return LogitsProcessor


try:  # exists only where vLLM is installed (this module imports without it)
    _SamplerBase: type = _sampler_base()
except ImportError:  # pragma: no cover - depends on the environment
    _SamplerBase = object


class GumbelSampler(_SamplerBase):
    """The replayable sampling rule (:func:`pulseloco.rollouts.sampling.choose`) as a vLLM logits processor.

    It acts on the requests whose ``SamplingParams.extra_args`` hold :data:`SAMPLER_ARGS` (seed, sequence index,
    temperature) and that vLLM decodes greedily (``temperature=0``): each of their rows becomes ``-inf`` except at
    the chosen token, which holds its log-probability, so vLLM's greedy step takes the choice and reports that
    value (``logprobs_mode=processed_logits``). The position is the length of the request's output so far (vLLM
    passes a live reference to it). Other requests pass through untouched.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.requests: dict[int, tuple[int, int, float, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Refuse malformed sampler arguments (a ``ValueError`` vLLM turns into its validation error)."""
        args = (sampling_params.extra_args or {}).get(SAMPLER_ARGS)
        if args is None:
            return
        seed, sequence, temperature = args.get("seed"), args.get("sequence"), args.get("temperature")
        if not (isinstance(seed, int) and 0 <= seed < 2**63 and isinstance(sequence, int) and sequence >= 0):
            raise ValueError(f"{SAMPLER_ARGS} needs an integer seed in [0, 2**63) and a sequence index >= 0")
        if not (isinstance(temperature, int | float) and temperature > 0):
            raise ValueError(f"{SAMPLER_ARGS} needs a positive temperature, got {temperature!r}")
        if sampling_params.temperature != 0:
            raise ValueError(f"{SAMPLER_ARGS} samples itself: the request must be greedy (temperature 0)")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        from vllm.v1.sample.logits_processor.builtin import process_dict_updates

        def state(params: Any, prompt: Any, output: list[int]) -> tuple[int, int, float, list[int]] | None:
            args = (params.extra_args or {}).get(SAMPLER_ARGS)
            if args is None:
                return None
            return int(args["seed"]), int(args["sequence"]), float(args["temperature"]), output

        process_dict_updates(self.requests, batch_update, state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.requests:
            return logits
        rows = sorted(i for i in self.requests if i < logits.shape[0])
        if not rows:
            return logits
        entries = [self.requests[i] for i in rows]
        index = torch.tensor(rows, device=logits.device)
        chosen = choose(
            logits[index],
            torch.tensor([e[2] for e in entries]),
            torch.tensor([e[0] for e in entries], dtype=torch.int64),
            torch.tensor([e[1] for e in entries], dtype=torch.int64),
            torch.tensor([len(e[3]) for e in entries], dtype=torch.int64),
        )
        logits[index] = chosen.to(logits.dtype)
        return logits
