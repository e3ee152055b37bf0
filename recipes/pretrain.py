"""Causal-LM pretraining with transformers' Trainer: ddp, or a diloco / pulseloco / sparseloco swarm peer.

    accelerate launch recipes/pretrain.py --help

The program is :mod:`pulseloco.recipes.pretrain` (its docstring shows complete commands, and
``python -m pulseloco.recipes.pretrain`` runs the same); this file is its entry point for ``accelerate launch``.
"""

from pulseloco.recipes.pretrain import run

if __name__ == "__main__":
    run()
