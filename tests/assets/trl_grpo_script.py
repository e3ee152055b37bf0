"""A user's GRPO script that knows nothing of pulseloco (tests/test_recipes.py adds the README's two lines).

python trl_grpo_script.py MODEL_DIR OUTPUT_DIR SEED
"""

import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer


def reward_digits(completions, **kwargs):
    return [float(sum(c.isdigit() for c in completion)) for completion in completions]


model_dir, output_dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
dataset = Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(64)]})
args = GRPOConfig(
    output_dir=output_dir,
    max_steps=8,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=4,
    learning_rate=1e-4,
    use_cpu=True,
    bf16=False,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
    seed=seed,
)
trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_digits, args=args, train_dataset=dataset)
trainer.train()
trainer.save_model(output_dir)
