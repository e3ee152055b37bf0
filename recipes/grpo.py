"""GRPO post-training; the trainers are PULSELoCo peers and publish their versions to rollout workers.

    accelerate launch recipes/grpo.py --help

The program is :mod:`pulseloco.recipes.grpo` (its docstring shows complete commands, and
``python -m pulseloco.recipes.grpo`` runs the same); this file is its entry point for ``accelerate launch``.
"""

from pulseloco.recipes.grpo import run

if __name__ == "__main__":
    run()
