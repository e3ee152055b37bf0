"""Launching the recipes (``recipes/grpo.py``, ``recipes/pretrain.py``) as a benchmark does: under accelerate's
launcher, as swarm peers joined through a bootstrap DHT node, with a PULSESync signing key.

    runner = Runner(runs_dir, netns=net, env=recipe_env())
    maddr = start_bootstrap(runner, "bootstrap")                       # `pulseloco dht`, its multiaddr
    argv = [*LAUNCH, "-q", *SINGLE_PROCESS, str(recipe_path("grpo")), "--config", ..., *swarm_flags(...)]

accelerate's launcher runs as ``python -m accelerate.commands.launch``: the code ``accelerate launch`` runs, without
the console script's import of accelerate's other subcommands (4 CPU-s per launch). The ``pulseloco`` command is
started from beside ``sys.executable`` (:func:`recipe_env` puts that directory first on ``PATH``). Errors are those
of :mod:`harness.procs`: :class:`~harness.procs.ProcFailed` (a RuntimeError) and
:class:`~harness.procs.ProcTimeout`, with the log's tail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness import REPO
from harness.procs import Runner, wait_all

RECIPES = REPO / "recipes"
ACCELERATE_CONFIGS = RECIPES / "accelerate_configs"
SINGLE_PROCESS = ["--config_file", str(ACCELERATE_CONFIGS / "single_process.yaml")]
"""accelerate launch flags of one process (a swarm peer)."""
MULTI_PROCESS = ["--config_file", str(ACCELERATE_CONFIGS / "multi_process_cpu.yaml")]
"""accelerate launch flags of a data-parallel job on CPUs (gloo); add ``--num_processes``."""
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
"""``accelerate launch`` (module docstring)."""
BOOTSTRAP_TIMEOUT = 180.0
"""Seconds for a bootstrap node to print its multiaddr (imports are slow on a busy two-core machine)."""
KEYGEN_TIMEOUT = 120.0
"""Seconds ``pulseloco keygen`` may take."""


def recipe_path(recipe: str) -> Path:
    """``recipes/<recipe>.py``, the accelerate-launch entry point of a recipe (not checked to exist)."""
    return RECIPES / f"{recipe}.py"


def recipe_env() -> dict[str, str]:
    """What a runner adds to the environment of recipe runs: one OpenMP thread each, no progress bars, unbuffered
    output, and this Python's bin directory first on ``PATH`` (the ``pulseloco`` command beside it)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "PATH": path}


def start_bootstrap(
    runner: Runner,
    name: str,
    *,
    host: str = "127.0.0.1",
    ns_index: int | None = None,
    timeout: float = BOOTSTRAP_TIMEOUT,
) -> str:
    """Start ``pulseloco dht`` listening on ``host`` (in namespace ``ns_index`` when the runner has a network) and
    return the multiaddr it prints. Raises ProcFailed when it exits first, ProcTimeout after ``timeout`` seconds;
    the node keeps running until the runner stops it."""
    dht = runner.start(name, ["pulseloco", "dht", "--host-maddrs", f"/ip4/{host}/tcp/0"], ns_index=ns_index)
    return dht.wait_for(r"multiaddr: (/ip4/\S+/p2p/\S+)", timeout).group(1)


def make_signing_key(runner: Runner) -> Path:
    """``pulseloco keygen`` into ``<log_dir>/keys/publisher`` (removed with the runner's directory; never in the
    repository). Raises ProcFailed or ProcTimeout (:data:`KEYGEN_TIMEOUT`) when it fails."""
    key = runner.log_dir / "keys" / "publisher"
    key.parent.mkdir(parents=True, exist_ok=True)
    wait_all([runner.start("keygen", ["pulseloco", "keygen", "--out", str(key)])], KEYGEN_TIMEOUT)
    return key


def swarm_flags(run_id: str, bootstrap: str, group_size: int, *, startup_timeout: float) -> list[str]:
    """The recipe flags that make a process a peer of swarm ``run_id``: the bootstrap node, rounds formed by
    ``group_size`` peers (60 s of matchmaking), 3 s of lingering at the end, ``startup_timeout`` seconds to join."""
    flags = ["--run_id", run_id, "--initial_peers", bootstrap]
    flags += ["--target_group_size", str(group_size), "--matchmaking_time", "60", "--linger", "3"]
    return [*flags, "--startup_timeout", f"{startup_timeout:g}"]
