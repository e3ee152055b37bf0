"""A rollout worker: follows the trainers' published versions (PULSESync), generates and scores.

    python recipes/rollout_worker.py --help

The program is :mod:`pulseloco.recipes.rollout_worker` (its docstring shows complete commands, and
``python -m pulseloco.recipes.rollout_worker`` runs the same); this file is its entry point for ``accelerate launch``.
"""

from pulseloco.recipes.rollout_worker import run

if __name__ == "__main__":
    run()
