"""What the scripts in ``scripts/`` and the experiments in ``experiments/`` share: the harness around them.

A script imports it by name (``from harness import procs``): Python puts ``scripts/`` first on ``sys.path`` when it
runs a script there, and pytest does the same for the tests (``pythonpath = ["scripts"]`` in pyproject.toml). The
modules import nothing heavy at import time (torch, transformers, hivemind and matplotlib load inside the functions
that need them), so a coordinator process stays light.

- :mod:`harness.procs`: processes in process groups of their own, with log files, bounded waits and a cleanup that
  kills whole groups and reaps them (:class:`~harness.procs.Proc`, :class:`~harness.procs.Runner`); spawned
  ``multiprocessing`` workers with a timeout; signals turned into a clean exit.
- :mod:`harness.netns`: private rate-limited networks (Linux network namespaces, veth pairs, ``tc tbf``), and
  ``tc`` rate strings.
- :mod:`harness.channel`: a coordinator's message hub and its workers' connection (AF_UNIX, works across
  network namespaces).
- :mod:`harness.models`: the models the benchmarks build (Qwen2 configs, tiny Llamas), seeded synthetic training
  steps, the cached warm models of ``scripts/warm_model.py`` and a warm model grown in depth and width.
- :mod:`harness.machine`: facts about the machine and the code (CPU, cores, memory, GPU, library versions, git
  revision, load average).
- :mod:`harness.memory`: a process's resident and peak memory from /proc, glibc malloc control, and whether a run
  fits the memory available.
- :mod:`harness.report`: tables (markdown, aligned text, fixed-width columns, key/value lines), number formatting,
  tolerant readers of a run's JSON files, comma-list argument parsers, matplotlib without a display.
- :mod:`harness.logs`: progress lines on stderr, so that stdout holds only what a script reports.
- :mod:`harness.recipe_runs`: launching the recipes as a benchmark does (accelerate's launcher, a bootstrap node, a
  signing key, swarm flags); :mod:`harness.run_outputs`: a recipe run's output directory read back.

- :mod:`harness.audit`: the outside ledger of a swarm's processes, written as they go (a SIGKILL loses nothing
  written), and its exactly-once check (the churn soak, the WAN swarm); :mod:`harness.ledger`: the in-memory ledger
  of the tests' in-process swarms.

Also :mod:`harness.warm`: warm_model's sizes, training and cache (its command line is ``scripts/warm_model.py``).

An experiment under ``experiments/`` (one folder each: its program, the modules only it uses, its results) imports
this package the same way: its program puts ``scripts/`` on ``sys.path`` in one line before its imports.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (scripts/harness/ is two levels below it): the working directory of started processes."""
SCRIPTS = REPO / "scripts"
