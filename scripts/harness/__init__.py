"""What the scripts in ``scripts/`` share: the harness around each benchmark's experiment.

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

- :mod:`harness.steering`: a rollout worker that steers its samples within a margin (bench_attacks and the rollout
  tests' rogue worker).

Pieces of one experiment that stand on their own (each named after its script): :mod:`harness.codec_baselines`
(bench_codec's naive and authors' codecs) and :mod:`harness.codec_timing` (how it times and checks each codec),
:mod:`harness.warm` (warm_model's sizes, training and cache), :mod:`harness.sparsity` and
:mod:`harness.sparsity_report` (sparsity_study's measurements and report),
:mod:`harness.compare_runs`, :mod:`harness.compare_results` and :mod:`harness.compare_report` (compare's plans and
launches, aggregation, and outputs), :mod:`harness.rollouts_report` (bench_rollouts' run metrics, tables and output
files), :mod:`harness.sync_workers`, :mod:`harness.sync_coordinator` and :mod:`harness.sync_report` (bench_sync's
publisher and subscriber processes, the coordinator that drives and measures them, and the results, relay-tree
bound and tables), :mod:`harness.soak_audit`, :mod:`harness.soak_schedule` and :mod:`harness.soak_report` (soak's
outside ledger, written by every peer and checked at the end; its churn schedule; its other checks and table).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (scripts/harness/ is two levels below it): the working directory of started processes."""
SCRIPTS = REPO / "scripts"
