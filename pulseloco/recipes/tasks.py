"""Verifiable offline tasks for RL post-training: arithmetic prompts with exact-match rewards.

A problem is a prompt such as ``"37+45="`` and its answer ``"82"``. A completion earns reward 1 when its text
(up to the end-of-sequence token, which TRL strips) equals the answer exactly, else 0. Everything is generated
from a seed, so every peer, the rollout workers and the tests see the same held-out problems.

The same problems serve three uses:

* the supervised warm-up of ``scripts/warm_model.py`` (prompt + completion pairs, TRL's ``SFTTrainer``);
* GRPO in ``recipes/grpo.py`` (a ``datasets.Dataset`` with ``prompt`` and ``answer`` columns; TRL passes
  ``answer`` to :func:`exact_match_reward`);
* scoring by the rollout worker and the demo (:func:`score`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TASKS = ("add", "sub")
EVAL_SEED = 12345
"""Seed of the held-out problems (disjoint from the training seeds in practice: prompts are drawn at random)."""


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """Which arithmetic problems: ``add`` (``a+b=``) or ``sub`` (``a-b=`` with ``a >= b``), operands 0..max."""

    task: str = "add"
    max_operand: int = 99

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be at least 1, got {self.max_operand}")


@dataclass(kw_only=True)
class TaskArguments:
    """The task options of the recipes that use it (GRPO trainers and rollout workers); an unset one follows the
    warm model (:func:`spec_for_model`). Raises ``ValueError`` naming a bad value."""

    task: str | None = field(
        default=None, metadata={"help": "add (a+b=) or sub (a-b=, a >= b); default: the warm model's, else add."}
    )
    max_operand: int | None = field(
        default=None, metadata={"help": "Operands 0..max_operand; default: what the warm model was taught, else 99."}
    )

    def __post_init__(self) -> None:
        TaskSpec(task=self.task or "add", max_operand=self.max_operand or 99)  # validates what was given


def spec_for_model(model_name_or_path: str, task: str | None, max_operand: int | None) -> TaskSpec:
    """The task spec a run uses: the values given, else those the warm model was taught
    (``pulseloco_warm.json`` beside a model made by ``scripts/warm_model.py``), else the defaults."""
    import json
    from pathlib import Path

    taught: dict[str, Any] = {}
    marker = Path(model_name_or_path) / "pulseloco_warm.json"
    if marker.is_file():
        try:
            taught = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            taught = {}
    defaults = TaskSpec()
    return TaskSpec(
        task=task or str(taught.get("task", defaults.task)),
        max_operand=max_operand if max_operand is not None else int(taught.get("max_operand", defaults.max_operand)),
    )


def make_problems(spec: TaskSpec, num: int, seed: int) -> list[tuple[str, str]]:
    """``num`` (prompt, answer) pairs drawn with ``seed``."""
    rng = random.Random(seed)
    problems = []
    for _ in range(num):
        a, b = rng.randint(0, spec.max_operand), rng.randint(0, spec.max_operand)
        if spec.task == "add":
            problems.append((f"{a}+{b}=", str(a + b)))
        else:
            a, b = max(a, b), min(a, b)
            problems.append((f"{a}-{b}=", str(a - b)))
    return problems


def all_problems(spec: TaskSpec) -> list[tuple[str, str]]:
    """Every distinct problem of ``spec``, in a fixed order (``(max_operand + 1) ** 2`` for add, half that for sub)."""
    n = spec.max_operand + 1
    if spec.task == "add":
        return [(f"{a}+{b}=", str(a + b)) for a in range(n) for b in range(n)]
    return [(f"{a}-{b}=", str(a - b)) for a in range(n) for b in range(a + 1)]


def eval_problems(spec: TaskSpec, num: int) -> list[tuple[str, str]]:
    """The fixed problems every run scores with: ``num`` drawn with :data:`EVAL_SEED`, or, when the task has at most
    ``num`` distinct problems (single-digit sums: 100), every one of them once. Such a task is too small to hold
    any problem out, so its score is the exact accuracy on the whole task rather than an estimate of it."""
    everything = all_problems(spec)
    return everything if len(everything) <= num else make_problems(spec, num, EVAL_SEED)


def exact_match_reward(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
    """TRL reward function: 1.0 where the completion's text equals the answer, else 0.0.

    ``completions`` are strings (standard prompts) or lists of messages (conversational prompts, when the
    tokenizer has a chat template); the text is then the last message's content.
    """
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        if not isinstance(completion, str):
            completion = completion[-1]["content"] if completion else ""
        rewards.append(1.0 if completion.strip() == expected else 0.0)
    return rewards


def score(completions: Sequence[str], problems: Sequence[tuple[str, str]]) -> float:
    """Mean exact-match reward of ``completions`` for ``problems``."""
    if not problems:
        raise ValueError("no problems to score")
    rewards = exact_match_reward(list(completions), [answer for _, answer in problems])
    return sum(rewards) / len(rewards)


def grpo_dataset(spec: TaskSpec, num: int, seed: int, *, conversational: bool = False) -> Any:
    """A ``datasets.Dataset`` of ``num`` problems with ``prompt`` and ``answer`` columns for TRL's GRPOTrainer.

    ``conversational`` wraps each prompt as a user message (for models with a chat template).
    """
    from datasets import Dataset

    problems = make_problems(spec, num, seed)
    prompts: list[Any] = [[{"role": "user", "content": p}] if conversational else p for p, _ in problems]
    return Dataset.from_dict({"prompt": prompts, "answer": [a for _, a in problems]})


def sft_dataset(spec: TaskSpec, num: int, seed: int) -> Any:
    """A prompt-completion ``datasets.Dataset`` for TRL's SFTTrainer (the loss covers the completion only)."""
    from datasets import Dataset

    problems = make_problems(spec, num, seed)
    return Dataset.from_dict({"prompt": [p for p, _ in problems], "completion": [a for _, a in problems]})
