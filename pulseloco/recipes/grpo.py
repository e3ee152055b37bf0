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
ddp`` is the Trainer's own data parallelism across the processes of one ``accelerate launch``. The held-out greedy
reward before and after training is printed and written to ``<output_dir>/grpo_eval.json``; TRL's logs (loss,
reward, ...) to ``<output_dir>/trainer_state.json``; PulseLoCo's rounds to ``pulseloco_rounds.jsonl``. The configs
report to TensorBoard (``report_to: tensorboard``; ``--report_to wandb`` etc. for another tracker, ``none`` for
none): event files in ``<output_dir>/tensorboard`` (:func:`common.tensorboard_logging_dir`) with TRL's loss and
reward, the rollout loop's ``rollouts/*``, and the callbacks' ``pulseloco/*`` per outer round and ``pulsesync/*``
per published version; ``tensorboard --logdir <output_dir>`` shows them.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulseloco.recipes import common, tasks

PROG = "grpo.py"


@dataclass(kw_only=True)
class TaskArguments(tasks.TaskArguments):
    """The verifiable task (:mod:`pulseloco.recipes.tasks`) and how many of its prompts GRPO uses."""

    num_train_prompts: int = field(default=4096, metadata={"help": "Training prompts (drawn with --seed)."})
    num_eval_prompts: int = field(
        default=64,
        metadata={"help": "Held-out prompts scored greedily before and after (all of them where the task has fewer)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_train_prompts", "num_eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def greedy_reward(engine: object, spec: tasks.TaskSpec, num_prompts: int, max_new_tokens: int) -> float:
    """Mean exact-match reward of greedy completions on the held-out problems."""
    problems = tasks.eval_problems(spec, num_prompts)
    completions = engine.generate([p for p, _ in problems], max_new_tokens=max_new_tokens)  # type: ignore[attr-defined]
    return tasks.score(completions, problems)


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
    Also used by ``scripts/sparsity_study.py``."""
    from trl import GRPOTrainer

    from pulseloco.integrations.models import load_causal_lm, load_tokenizer

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

    from pulseloco.integrations.rollout import TransformersEngine

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
    reward_before = (
        greedy_reward(TransformersEngine(model, tokenizer), spec, task_args.num_eval_prompts,
                      training_args.max_completion_length)
        if state.is_main_process
        else None
    )  # fmt: skip
    state.print(
        f"grpo: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters from "
        f"{model_args.model_name_or_path}, strategy={pulse_args.strategy}, rollouts={rollout_args.rollouts}, "
        f"processes={state.num_processes}, "
        f"max_steps={training_args.max_steps}, task={spec.task} max_operand={spec.max_operand}, "
        f"held-out greedy reward {reward_before}"
    )
    started = time.monotonic()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    seconds = time.monotonic() - started
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    if state.is_main_process:
        engine = TransformersEngine(trainer.model, tokenizer)
        reward_after = greedy_reward(engine, spec, task_args.num_eval_prompts, training_args.max_completion_length)
        result = {"reward_before": reward_before, "reward_after": reward_after, "seconds": seconds}
        result["num_eval_prompts"] = len(tasks.eval_problems(spec, task_args.num_eval_prompts))
        (Path(training_args.output_dir) / "grpo_eval.json").write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"grpo: done steps={trainer.state.global_step} greedy_reward {reward_before:.3f} -> {reward_after:.3f} "
            f"seconds={seconds:.1f} output_dir={training_args.output_dir}",
            flush=True,
        )
    state.wait_for_everyone()


def run() -> None:
    """The command line (``accelerate launch recipes/grpo.py ...``): :func:`main` on ``sys.argv``; exits 2 on a
    bad configuration and 1 on a run-time failure, with one line (:func:`common.run_recipe`)."""
    common.run_recipe(PROG, lambda: main(sys.argv[1:], own_process=True))


if __name__ == "__main__":
    run()
