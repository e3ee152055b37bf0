"""The operator tools: the ``pulseloco`` command (:mod:`~pulseloco.cli.commands`), what ``pulseloco status``
reports (:mod:`~pulseloco.cli.status`) and the ``pulseloco monitor`` loop (:mod:`~pulseloco.cli.monitor`).

Importing this package is cheap (``pulseloco version`` stays fast): the commands import torch, hivemind and the
swarm code only when they run.
"""

from __future__ import annotations

from pulseloco.cli.commands import EXIT_USAGE, build_parser, main

__all__ = ["EXIT_USAGE", "build_parser", "main"]
