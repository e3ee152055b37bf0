"""The recipes: complete training and rollout programs built from the library, in the shape of TRL's scripts.

Each module is a program with a ``main(argv)`` and a ``run()`` (its command line); ``recipes/<name>.py`` in the
repository are their entry points for ``accelerate launch`` / ``python``, and ``python -m pulseloco.recipes.<name>``
runs the same program. They live in the package so that scripts and tests import them like any module:

- :mod:`~pulseloco.recipes.grpo`: GRPO post-training with TRL's ``GRPOTrainer``; trainers are PULSELoCo peers.
- :mod:`~pulseloco.recipes.rollout_worker`: follows the trainers' versions (PULSESync), generates and scores.
- :mod:`~pulseloco.recipes.pretrain`: causal-LM pretraining with transformers' ``Trainer`` (ddp or a swarm peer).
- :mod:`~pulseloco.recipes.tasks`: the verifiable arithmetic task and its reward.
- :mod:`~pulseloco.recipes.common`: what every recipe does the same way (options, output directory, exit codes).
"""
