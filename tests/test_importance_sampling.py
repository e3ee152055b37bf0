"""TRL's truncated importance-sampling correction reaches the loss on the ``rollout_func`` path.

The installed TRL computes the ratio between the trainer's log-probabilities and the sampler's, and multiplies the
loss by it, only where ``use_vllm`` is set; :func:`pulseloco.integrations.swarm_rollouts.enable_importance_sampling`
turns it on for a trainer fed by a ``rollout_func`` (as :class:`SwarmRollouts` does at its first call). These tests
run TRL's own ``_generate_and_score_completions`` and ``compute_loss`` on a real ``GRPOTrainer`` whose rollout
function returns the sampling log-probabilities of :meth:`TransformersEngine.generate_ids`, honest or forged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

NUM_GENERATIONS = 4


def make_trainer(model_dir: Path, output_dir: Path, shift: float, enable: bool) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from pulseloco.integrations.swarm_rollouts import enable_importance_sampling
    from pulseloco.rollouts.engines.hf import TransformersEngine

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, list[Any]]:
        if enable:
            enable_importance_sampling(trainer)
        engine = TransformersEngine(trainer.model, trainer.processing_class, shadow=False)
        prompt_ids = [trainer.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completions = engine.generate_ids(prompt_ids, max_new_tokens=4, temperature=1.0, seed=0)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [c.token_ids for c in completions],
            # a forged sampler: ``shift`` nats per token below what was really sampled
            "logprobs": [[lp + shift for lp in c.logprobs] for c in completions],
        }

    def reward(completions: list[str], **_: Any) -> list[float]:
        # varies within a group (the samples differ), so the advantages are not all zero
        return [float(sum(map(ord, c)) % 7) for c in completions]

    args = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=2 * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=4,
        max_steps=1,
        beta=0.0,
        use_cpu=True,
        report_to="none",
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": ["1+2=", "3+4="]})
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )


def loss_and_grad(trainer: Any) -> tuple[dict[str, Any], float]:
    trainer.model.train()
    inputs = [{"prompt": p} for p in ["1+2="] * NUM_GENERATIONS + ["3+4="] * NUM_GENERATIONS]
    prepared = trainer._generate_and_score_completions(inputs)
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() for each step
    loss = trainer.compute_loss(trainer.model, prepared)
    loss.backward()
    grad = sum(float(p.grad.abs().sum()) for p in trainer.model.parameters() if p.grad is not None)
    return prepared, grad


def test_honest_logprobs_give_ratios_near_one_and_a_gradient(tiny_warm_model: Path, tmp_path: Path) -> None:
    trainer = make_trainer(tiny_warm_model, tmp_path, shift=0.0, enable=True)
    prepared, grad = loss_and_grad(trainer)
    ratio = prepared["importance_sampling_ratio"]
    assert torch.all(ratio > 0.8) and torch.all(ratio < 1.25), ratio  # the same model sampled: on-policy
    assert torch.any(prepared["advantages"] != 0)
    assert grad > 0
    assert trainer._metrics["train"]["sampling/importance_sampling_ratio/mean"]


def test_forged_logprobs_are_masked_out_of_the_loss(tiny_warm_model: Path, tmp_path: Path) -> None:
    """Log-probabilities 2 nats per token too low make every sequence's ratio exceed TRL's clip (3.0): in its
    default ``sequence_mask`` mode the ratio is 0, so the loss has no gradient at all."""
    trainer = make_trainer(tiny_warm_model, tmp_path, shift=-2.0, enable=True)
    assert trainer.args.vllm_importance_sampling_mode == "sequence_mask"
    prepared, grad = loss_and_grad(trainer)
    assert torch.all(prepared["importance_sampling_ratio"] == 0)
    assert grad == 0


def test_without_the_switch_trl_ignores_the_samplers_logprobs(tiny_warm_model: Path, tmp_path: Path) -> None:
    """The control: the installed TRL treats a rollout_func's completions as on-policy unless use_vllm is set, so
    forged log-probabilities change nothing (the reason enable_importance_sampling exists)."""
    trainer = make_trainer(tiny_warm_model, tmp_path, shift=-2.0, enable=False)
    prepared, grad = loss_and_grad(trainer)
    assert "importance_sampling_ratio" not in prepared
    assert grad > 0
