"""GRPO post-training of a pretrained model with TRL's GRPOTrainer; trainers are PULSELoCo swarm peers and publish
their versions to rollout workers with PULSESync.

    python scripts/warm_model.py --size demo                       # prints `warm model: DIR` (made once, cached)
    pulseloco keygen --out keys/publisher
    accelerate launch --config_file recipes/accelerate_configs/single_process.yaml recipes/grpo.py \\
        --config recipes/configs/grpo-tiny.yaml --model_name_or_path DIR --output_dir runs/peer0 \\
        --publish --signing_key keys/publisher
    accelerate launch --config_file recipes/accelerate_configs/single_process.yaml recipes/grpo.py \\
        --config recipes/configs/grpo-tiny.yaml --model_name_or_path DIR --output_dir runs/peer1 \\
        --initial_peers MADDR_PRINTED_BY_PEER0
    python recipes/rollout_worker.py --model_name_or_path DIR --run_id tiny --initial_peers MADDR \\
        --public_key keys/publisher.pub --output_dir runs/worker

The task (:mod:`pulseloco.recipes.tasks`): arithmetic prompts such as ``37+45=`` with an exact-match reward. Everything
about GRPO (the loss, ``beta``, clipping, ``num_iterations``, ``num_generations``, sampling) is TRL's ``GRPOConfig``;
``--strategy`` and the swarm options are :class:`pulseloco.integrations.args.PulseLoCoArguments`. ``--strategy
ddp`` is the Trainer's own data parallelism across the processes of one ``accelerate launch``. The held-out rewards
before and after training (greedy, and sampled at ``--temperature`` with ``--num_eval_samples`` draws per prompt,
with its standard error) are printed and written to ``<output_dir>/grpo_eval.json``; TRL's logs (loss,
reward, ...) to ``<output_dir>/trainer_state.json``; PulseLoCo's rounds to ``pulseloco_rounds.jsonl``. The configs
report to TensorBoard (``report_to: tensorboard``; ``--report_to wandb`` etc. for another tracker, ``none`` for
none): event files in ``<output_dir>/tensorboard`` (:func:`common.tensorboard_logging_dir`) with TRL's loss and
reward, the rollout loop's ``rollouts/*``, and the callbacks' ``pulseloco/*`` per outer round and ``pulsesync/*``
per published version; ``tensorboard --logdir <output_dir>`` shows them.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pulseloco.recipes import common, tasks

PROG = "grpo.py"


@dataclass(kw_only=True)
class TaskArguments(tasks.TaskArguments):
    """The verifiable task (:mod:`pulseloco.recipes.tasks`) and how many of its prompts GRPO uses."""

    _argument_group_name: ClassVar[str] = "task"

    num_train_prompts: int = field(default=4096, metadata={"help": "Training prompts (drawn with --seed)."})
    num_eval_prompts: int = field(
        default=64,
        metadata={"help": "Held-out prompts scored greedily before and after (all of them where the task has fewer)."},
    )

    num_eval_samples: int = field(
        default=8,
        metadata={
            "help": "Completions sampled per held-out prompt at --temperature for the sampled reward (pass@1) "
            "before and after, with its standard error; 0: greedy only."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_train_prompts", "num_eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_eval_samples < 0:
            raise ValueError(f"num_eval_samples must be 0 (greedy only) or more, got {self.num_eval_samples}")


def greedy_reward(engine: object, spec: tasks.TaskSpec, num_prompts: int, max_new_tokens: int) -> float:
    """Mean exact-match reward of greedy completions on the held-out problems."""
    problems = tasks.eval_problems(spec, num_prompts)
    completions = engine.generate([p for p, _ in problems], max_new_tokens=max_new_tokens)  # type: ignore[attr-defined]
    return tasks.score(completions, problems)


def sampled_reward(
    engine: object,
    spec: tasks.TaskSpec,
    num_prompts: int,
    max_new_tokens: int,
    *,
    temperature: float,
    samples: int,
    seed: int,
) -> tuple[float, float]:
    """``(mean, standard error)`` of the exact-match reward of ``samples`` completions sampled at ``temperature``
    for every held-out problem (pass@1 estimated from ``samples`` draws). The problems are fixed, so the error is
    the sampling error alone: sqrt(sum_i p_i (1 - p_i) / (samples - 1)) / n over the n problems' sample means p_i
    (for one sample, the binomial sqrt(p (1 - p) / n)). The draws are keyed by ``seed`` and leave the global torch
    random state as it was. Raises ``ValueError`` for fewer than one sample or a temperature that is not positive.
    """
    import torch

    if samples < 1 or not temperature > 0:
        raise ValueError(f"need samples >= 1 and temperature > 0, got {samples} and {temperature}")
    problems = tasks.eval_problems(spec, num_prompts)
    prompts = [prompt for prompt, _ in problems for _ in range(samples)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        completions = engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature)  # type: ignore[attr-defined]
    answers = [answer for _, answer in problems for _ in range(samples)]
    rewards = tasks.exact_match_reward(completions, answers)
    means = [sum(rewards[i * samples : (i + 1) * samples]) / samples for i in range(len(problems))]
    n, mean = len(problems), sum(rewards) / len(rewards)
    if samples == 1:
        return mean, math.sqrt(mean * (1 - mean) / n)
    return mean, math.sqrt(sum(p * (1 - p) for p in means) / (samples - 1)) / n


def build_trainer(
    spec: tasks.TaskSpec,
    task_args: TaskArguments,
    training_args: Any,
    model_name_or_path: str,
    *,
    dtype: Any = None,
    num_local_processes: int = 1,
    callbacks: list[Any] | None = None,
    rollout_func: Any = None,
) -> Any:
    """This recipe's TRL ``GRPOTrainer``: the model (``load_causal_lm`` in ``dtype``, default the checkpoint's) and
    tokenizer from ``model_name_or_path``, the task's prompts (``task_args.num_train_prompts``, drawn with
    ``training_args.seed``), the exact-match reward. Its model is untrained when this returns. Raises
    ``ConfigError`` as ``load_causal_lm`` does (missing or unreadable weights, too large for this machine).
    ``rollout_func``: TRL's, for completions generated elsewhere (``--rollouts swarm``). TensorBoard's event
    files (``report_to``) go to ``<output_dir>/tensorboard`` (:func:`common.tensorboard_logging_dir`).
    Also used by ``experiments/sparsity/sparsity_study.py``."""
    from trl import GRPOTrainer

    from pulseloco.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(
        model_name_or_path, dtype=dtype, num_local_processes=num_local_processes, device="cpu"
    )  # the Trainer moves it to its device
    tokenizer = load_tokenizer(model_name_or_path)
    conversational = getattr(tokenizer, "chat_template", None) is not None
    train_dataset = tasks.grpo_dataset(
        spec, task_args.num_train_prompts, training_args.seed, conversational=conversational
    )
    with common.tensorboard_logging_dir(training_args.output_dir):
        return GRPOTrainer(
            model=model,
            reward_funcs=[tasks.exact_match_reward],  # type: ignore[list-item]  # TRL's list[float | None]: ours never None
            args=training_args,
            train_dataset=train_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            rollout_func=rollout_func,
        )


def main(argv: list[str] | None = None, *, own_process: bool = False) -> None:
    """Parse ``argv`` and run GRPO. ``own_process``: this process runs the recipe alone (as a script), so that
    vLLM, when TRL's own ``--use_vllm`` is off, need not be imported
    (:func:`pulseloco.integrations.skip_vllm_import`)."""
    from trl import GRPOConfig, ModelConfig

    from pulseloco.integrations import skip_vllm_import
    from pulseloco.integrations.args import PulseLoCoArguments, RolloutArguments

    task_args, training_args, model_args, pulse_args, rollout_args = common.parse_args(
        (TaskArguments, GRPOConfig, ModelConfig, PulseLoCoArguments, RolloutArguments), argv, PROG
    )
    if not model_args.model_name_or_path:
        raise common.ConfigError(
            "--model_name_or_path is required: a Hugging Face model directory (python scripts/warm_model.py "
            "makes one) or a hub name"
        )
    if own_process and not training_args.use_vllm:
        skip_vllm_import()
    spec = tasks.spec_for_model(model_args.model_name_or_path, task_args.task, task_args.max_operand)
    common.check_output_dir(training_args.output_dir, training_args.resume_from_checkpoint)
    callbacks = pulse_args.callbacks(output_dir=training_args.output_dir, max_steps=training_args.max_steps)
    rollout_func = rollout_args.rollout_func(pulse_args, output_dir=training_args.output_dir)

    from accelerate import PartialState

    from pulseloco.rollouts.engines.hf import TransformersEngine

    state = PartialState()
    trainer = build_trainer(
        spec,
        task_args,
        training_args,
        model_args.model_name_or_path,
        dtype=model_args.dtype if model_args.dtype not in (None, "auto") else None,
        num_local_processes=state.num_processes,
        callbacks=callbacks,
        rollout_func=rollout_func,
    )
    model, tokenizer = trainer.model, trainer.processing_class

    def evaluate(engine: TransformersEngine) -> dict[str, Any]:
        """The held-out rewards of grpo_eval.json: greedy, and sampled (mean and standard error) unless off."""
        length = training_args.max_completion_length
        result: dict[str, Any] = {"greedy": greedy_reward(engine, spec, task_args.num_eval_prompts, length)}
        if task_args.num_eval_samples:
            result["sampled"], result["sampled_se"] = sampled_reward(
                engine, spec, task_args.num_eval_prompts, length, temperature=training_args.temperature,
                samples=task_args.num_eval_samples, seed=training_args.seed,
            )  # fmt: skip
        return result

    before = evaluate(TransformersEngine(model, tokenizer)) if state.is_main_process else {}
    reward_before = before.get("greedy")
    state.print(
        f"grpo: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters from "
        f"{model_args.model_name_or_path}, strategy={pulse_args.strategy}, rollouts={rollout_args.rollouts}, "
        f"processes={state.num_processes}, "
        f"max_steps={training_args.max_steps}, task={spec.task} max_operand={spec.max_operand}, "
        f"held-out greedy reward {reward_before}"
    )
    started, cpu_started = time.monotonic(), time.process_time()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    seconds = time.monotonic() - started
    cpu_seconds = time.process_time() - cpu_started  # every thread of this process; not its DHT's processes
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    if state.is_main_process:
        after = evaluate(TransformersEngine(trainer.model, tokenizer))
        reward_after = after["greedy"]
        result = {
            "reward_before": reward_before,
            "reward_after": reward_after,
            "seconds": seconds,
            "cpu_seconds": round(cpu_seconds, 2),
        }
        result["num_eval_prompts"] = len(tasks.eval_problems(spec, task_args.num_eval_prompts))
        sampled = ""
        if task_args.num_eval_samples:
            result.update(
                sampled_reward_before=before["sampled"], sampled_se_before=before["sampled_se"],
                sampled_reward_after=after["sampled"], sampled_se_after=after["sampled_se"],
                num_eval_samples=task_args.num_eval_samples, eval_temperature=training_args.temperature,
            )  # fmt: skip
            sampled = (
                f" sampled_reward {before['sampled']:.3f} ± {before['sampled_se']:.3f} -> {after['sampled']:.3f} ± "
                f"{after['sampled_se']:.3f}"
            )
        (Path(training_args.output_dir) / "grpo_eval.json").write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"grpo: done steps={trainer.state.global_step} greedy_reward {reward_before:.3f} -> {reward_after:.3f}"
            f"{sampled} seconds={seconds:.1f} output_dir={training_args.output_dir}",
            flush=True,
        )
    state.wait_for_everyone()


def run() -> None:
    """The command line (``accelerate launch recipes/grpo.py ...``): :func:`main` on ``sys.argv``; exits 2 on a
    bad configuration and 1 on a run-time failure, with one line (:func:`common.run_recipe`)."""
    common.run_recipe(PROG, lambda: main(sys.argv[1:], own_process=True))


if __name__ == "__main__":
    run()
