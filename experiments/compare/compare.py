#!/usr/bin/env python
"""The paper's table on this machine: ddp, diloco, pulseloco (FP32, BF16 and 2-bit values, the last also under a
top-64 budget) and SparseLoCo (k = 64 and 128) in GRPO post-training of a warm model; reward against bytes sent,
the frontier of held-out reward against bytes, wall time, density per round and PULSESync patch sizes.

    .venv/bin/python experiments/compare/compare.py                      # about 85 minutes: 7 strategies, one seed
    .venv/bin/python experiments/compare/compare.py --quick              # the demo model, 32 steps, ddp and the seven
    .venv/bin/python experiments/compare/compare.py --bandwidth 100mbit  # each worker behind a 100 Mbit/s link (root)
    .venv/bin/python experiments/compare/compare.py --recipe pretrain    # recipes/pretrain.py, pretrain-tiny.yaml
    .venv/bin/python experiments/compare/compare.py -- --beta 0.04       # after --: to every recipe run
    # the frontier's three strategies, three seeds each
    .venv/bin/python experiments/compare/compare.py --seeds 3 --strategies diloco,sparseloco,pulseloco-2bit-k64
    # no runs: the table and plots of earlier runs, reported together
    .venv/bin/python experiments/compare/compare.py --report a/compare.json,b/compare.json

Run it with the project's Python (``.venv/bin/python``, made by ``scripts/demo.sh`` or ``scripts/test.sh``): it
starts the ``pulseloco`` command from beside ``sys.executable`` (and says so in one line if it is not there), and
accelerate's launcher as ``python -m accelerate.commands.launch``: the code ``accelerate launch`` runs, without the
console script's import of accelerate's other subcommands (4 CPU-s per launch).

**What runs.** For every learning rate of ``--lrs`` (``--learning_rate`` of the inner AdamW) and every seed, each
strategy of ``--strategies`` trains the same warm model (``scripts/warm_model.py --size WARM_SIZE``, or
``--model_name_or_path``) on the same task with the same config (``recipes/configs/grpo-demo.yaml``: 16 prompts x 8
completions per step, the peers' weights averaged every round; ``--steps`` optimizer steps, H = ``inner_steps`` =
8) and the same number of workers (``--workers``, default 4). The default is PULSE's regime as far as this machine
reaches it: the wide warm model (``--warm-size wide``, 9.18M parameters, built once in about 9 minutes) at lr 3e-6,
the lowest rate at which DiLoCo learns on it within a few hundred steps (by the held-out sampled reward; at 1e-6 it
does not), 192 steps, one seed of diloco, pulseloco, pulseloco-bf16, sparseloco, sparseloco-k128, pulseloco-2bit
and pulseloco-2bit-k64, every run evaluated with ``--num_eval_samples 32`` (added unless given after ``--``). Each
run takes about 11-12 minutes on this 2-core machine: about 85 minutes in all. With one seed quality is not judged
against DiLoCo (no range over seeds). The frontier's three strategies with three seeds each,

    .venv/bin/python experiments/compare/compare.py --seeds 3 --strategies diloco,sparseloco,pulseloco-2bit-k64

are 9 runs, about 105 minutes; their compare.json and the default's can be reported together (``--report``; the
3-seed runs replace the default's seed-0 runs of the same strategies). ``--quick`` runs the demo warm model at 5e-5
(where it learns fast, far above the sparse regime) for 32 steps, ddp and the seven strategies above: a smoke run,
about 1.5 minutes per strategy.

* ``ddp``: one ``accelerate launch --config_file recipes/accelerate_configs/multi_process_cpu.yaml --num_processes W``
  (the Trainer's data parallelism, gradients all-reduced every step). Nothing measures its traffic: its bytes per
  worker are a ring all-reduce of FP32 gradients every optimizer step, ``2 (W - 1) / W * 4 * num_params * steps``
  (the parameters counted in the saved model);
* ``diloco`` (dense FP32 pseudo-gradients), ``pulseloco`` (the PULSE rule, FP32 values), ``pulseloco-bf16`` (the
  PULSE rule sending BF16-rounded values, the rounding error kept in the residual: ``--pulse_values bfloat16``),
  ``pulseloco-2bit`` (the PULSE rule with 2-bit quantized values: ``--pulse_values quantized``),
  ``pulseloco-2bit-k64`` (the same, the gate intersected with a top-64 budget per 64x64 tile: ``--pulse_budget
  64``), ``sparseloco`` (SparseLoCo: top-k per 64x64 tile, k = ``--topk_k`` 64, 2-bit quantized values, error
  feedback decay 0.95, SGD outer step at lr 1.0, mean over the senders) and ``sparseloco-k128`` (``--topk_k 128``):
  W peers of one process each (``accelerate launch -q --config_file
  recipes/accelerate_configs/single_process.yaml``) joined through a bootstrap node (``pulseloco dht``), every
  round formed by all W peers (``--target_group_size W``). Their bytes are the wire bytes PulseLoCo measured
  (``bytes_sent`` in each peer's ``pulseloco_rounds.jsonl``). Peer 0 also publishes every consensus version with
  PULSESync (``--publish``, a key made by ``pulseloco keygen`` in the runs directory), so the table has the patch
  bytes per version against a full BF16 copy (``2 * num_params``) for the same run;
* run only when ``--strategies`` names them, swarm strategies like those (the others run the library's
  ``--exchange auto``): ``sparseloco-gather`` (SparseLoCo as published, an all-gather: each shard owner relays the
  members' parts of its shard to every member, ``--exchange gather``; about W - 1 payloads received a round),
  ``sparseloco-topk``, ``pulseloco-topk`` and ``pulseloco-2bit-topk`` (``--exchange topk``: each owner sends the
  largest entries of its shard's aggregate per tile, about one payload a round whatever W; the entries it drops go
  back to their senders' residuals), ``diloco-published`` and ``pulseloco-published`` (``--clip_to_median false``:
  without the owners' clip of each part to the group's median norm, which every other strategy here runs).

**Bytes, wire and payload.** Wire bytes are what a worker sent (above: for a swarm peer its pushed parts plus the
sums of its shard it served to the others, headers included). Payload bytes are its own compressed
pseudo-gradient as one frame (``payload_bytes`` in ``pulseloco_rounds.jsonl``): what the paper's all-gather
through an object store uploads; DiLoCo's is its dense FP32 frame, ddp's an estimate, ``4 * num_params`` per
optimizer step. Both per worker over the run and per worker and round (ddp: per ``inner_steps`` optimizer steps of
the swarm strategies), each against DiLoCo's and DDP's; beside the wire bytes sent, those received (``bytes_received``
in ``pulseloco_rounds.jsonl``; ddp's estimate: as many as sent), and both in payloads per round (wire bytes sent or
received per round / payload bytes per round: how many of its own payloads a worker's exchange costs; ddp's:
``2 (W - 1) / W``). For every swarm run, the rounds of all its peers go through
:func:`pulseloco.loco.metrics.traffic_summary` (``traffic`` in the JSON) and the wire bytes per selected entry are
split into indices, values, shard sums (index and value sections) and headers (``bytes_per_entry``; the parts add
up to the wire bytes), with the index bits per entry against the entropy bound ``log2 C(N, k) / k``.

Seed ``j`` of ``--seeds`` gives every run ``--seed SEED + 1000 j``; swarm peer ``i`` gets ``+ i`` on top (its own
prompts and samples), pretrain peers ``--data_seed`` instead (the same initial weights). ``--seeds N`` runs N seeds
at every learning rate; ``--seeds 1,1,3`` gives each learning rate its own count (default: one seed each).

**Quality** is the reward of the final model on the fixed evaluation prompts (``--num_eval_prompts 100``), before
and after, as mean, standard deviation and range over seeds (swarm peers end on the consensus model; the mean over
the workers is taken): the held-out sampled reward (``--num_eval_samples`` draws per prompt at the training
temperature; ``sampled_reward_before/after`` and their standard errors in ``grpo_eval.json``) where every run at a
learning rate wrote it, else the greedy exact-match reward (``reward_after``). By the sampled reward a strategy
"learned" when every seed's gain exceeds ``SAMPLED_Z`` (2) standard errors of the difference; by the greedy one when
every seed improved on the warm model and the mean gain is at least ``MIN_GAIN`` (0.05, five of the 100 prompts).
Where it did not learn, no quality is claimed for it. PULSELoCo "matches DiLoCo" at a learning rate when its mean
lies within DiLoCo's range over seeds (needs at least 2 seeds). The rule used is printed under each table.

**Outputs** (``--out``, default a new folder ``experiments/compare/results/MODEL-LRS-STEPS-STAMP``): ``compare.md`` (per
learning rate a table, one of wire bytes sent and received and payload bytes per worker and round (the wire bytes also
in payloads), one of the sparse strategies' bytes per selected entry, the frontier table: per strategy its wire bytes
per worker, wire and payload bytes against DiLoCo's, the held-out sampled reward after training with its spread, whether
it learned and whether it matches DiLoCo; and the targets, each "met" or "missed by" a factor: every pulseloco
strategy's wire and payload bytes <= 1/17 of DiLoCo's and <= 1/100 of DDP's, PULSESync patches <= 1/50 of a BF16 copy;
sparseloco's (k = 64) wire bytes <= 1/146 and payload <= 1/180 of DiLoCo's; the strategy with the fewest wire bytes
among those whose quality matches DiLoCo's <= 1/146 of DiLoCo's wire bytes, or why none qualifies; the command, date,
commit and machine; also printed), ``compare.json`` (every run and every aggregate), ``compare_reward_bytes.png`` and
``compare_reward_time.png`` (the sampled training reward, seed mean, against bytes sent and training time),
``compare_final.png`` (final greedy reward, mean and range, against bytes sent), ``compare_density.png`` (the fraction
of entries each round sent, against the round) and ``frontier.png`` (the held-out sampled reward after training, mean
over seeds, against wire bytes and against payload bytes per worker on a log axis, one point per strategy; error bars:
the range over seeds, or for one seed the sampling standard error the runs recorded). The runs' logs and output
directories go to ``--runs-dir`` (default: a temporary directory, removed unless ``--keep-runs``).

**Reporting again.** ``--report FILE`` runs nothing: it writes the table, JSON and plots from the runs of earlier
compare.json files (this version's aggregation and verdicts). Several files (comma-separated, or ``--report``
repeated) are merged before aggregating: every run of every file, where two hold a run of the same strategy,
learning rate, seed and network the later file's. Files run with other settings (recipe, config, model, steps,
learning rates, workers, recipe flags after ``--``, network, ``--parallel``) are refused (exit 2, one line naming
them). compare.md lists the files, their commits and the runs each contributed.

**Network.** On loopback by default. With ``--bandwidth RATE`` (root with ``ip netns`` and ``tc``) the bootstrap
node and every worker run in network namespaces of their own behind a veth limited to RATE each way
(scripts/harness/netns.py), ddp as W single-process launches of a W-machine job; the first learning rate and seed
of every strategy also runs on loopback, and a table compares the training times (how close each strategy gets to
an unlimited link). Without root it says why it skipped the limit.

Runs go one after the other (``--parallel``: the strategies of one learning rate and seed at once, faster, but then
times are not comparable). Every process has a timeout (``--timeout`` per run) and is stopped (its process group)
when the script ends, also on errors and Ctrl-C.

**Code.** This script: the flags and the plans' execution. Beside it in ``experiments/compare/``: ``compare_runs``
(plans, one run's start), ``compare_results`` (what runs wrote, rows over seeds), ``compare_report`` (compare.md,
plots, JSON). In the shared ``scripts/harness/``: ``recipe_runs`` (launches, bootstrap node, signing key),
``procs``, ``netns``, ``models``, ``machine``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

REQUIRED_MODULES = ("torch", "transformers", "trl", "accelerate", "hivemind", "matplotlib", "yaml", "pulseloco")
"""What the recipe runs and the plots import; checked (without importing) before anything starts."""
REQUIRED_COMMANDS = ("pulseloco",)
"""Executables started from beside ``sys.executable``."""
SETUP_HINT = (
    "run scripts/demo.sh or scripts/test.sh once to create .venv, "
    "then use .venv/bin/python experiments/compare/compare.py"
)


def environment_problem(python: str | None = None) -> str | None:
    """Why this Python cannot run the comparison (``None``: it can): modules of the project's dependencies that it
    cannot import, the ``pulseloco`` command missing beside it, or ``scripts/harness`` or this folder's modules not
    importable (``python -I`` leaves the script's folder off ``sys.path``). Nothing is imported; never raises."""
    python = python if python is not None else sys.executable
    if not python:
        return "the Python running compare.py has no known executable path"
    missing = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        return f"{python} lacks the project's dependencies (no module {', '.join(missing)})"
    bin_dir = Path(python).parent
    absent = [name for name in REQUIRED_COMMANDS if not os.access(bin_dir / name, os.X_OK)]
    if absent:
        return f"{python} has no {' or '.join(absent)} command beside it in {bin_dir}"
    if importlib.util.find_spec("harness") is None or importlib.util.find_spec("compare_runs") is None:
        return f"{python} cannot import scripts/harness or compare.py's modules (run it as a script, without -I)"
    return None


if __name__ == "__main__" and importlib.util.find_spec("compare_runs") is None:
    # Before the imports below of this folder's modules: Python puts the script's folder first on sys.path when it
    # runs a script, except under `python -I` (3.11: -P). One line instead of an ImportError's traceback.
    print(f"compare.py: error: {environment_problem()}; {SETUP_HINT}", file=sys.stderr, flush=True)
    sys.exit(2)

from compare_report import TARGETS, merge_reports, write_outputs  # noqa: E402
from compare_results import aggregate, summarize  # noqa: E402
from compare_runs import (  # noqa: E402
    CORE_STRATEGIES,
    SEED_STRIDE,
    STRATEGIES,
    Plan,
    StrategyRun,
    make_plans,
    start_run,
)
from harness import REPO  # noqa: E402
from harness.logs import progress  # noqa: E402
from harness.machine import git_revision, machine_note  # noqa: E402
from harness.models import warm_model_dir  # noqa: E402
from harness.netns import NetNS, open_netns, rate_label  # noqa: E402
from harness.procs import Runner, exit_on_signals, stop_all, wait_all  # noqa: E402
from harness.recipe_runs import make_signing_key, recipe_env, start_bootstrap  # noqa: E402
from harness.report import default_out, lr_label  # noqa: E402

CONFIGS = REPO / "recipes" / "configs"
DEFAULT_CONFIGS = {"pretrain": CONFIGS / "pretrain-tiny.yaml", "grpo": CONFIGS / "grpo-demo.yaml"}
GRPO_DEFAULTS: dict[str, Any] = {
    "lrs": "3e-6",
    "seeds": "1",
    "steps": 192,
    "warm_size": "wide",
    "strategies": "diloco,pulseloco,pulseloco-bf16,sparseloco,sparseloco-k128,pulseloco-2bit,pulseloco-2bit-k64",
    "num_eval_samples": 32,
}
"""The default comparison: the RL-rate regime (module docstring, "What runs"), 7 strategies, one seed, about 85
minutes."""
QUICK: dict[str, Any] = {
    "lrs": "5e-5",
    "seeds": "1",
    "steps": 32,
    "warm_size": "demo",
    "strategies": ",".join(CORE_STRATEGIES),
}
"""``--quick``: the demo warm model at the rate where it learns fast, too few steps to learn (a smoke run), ddp and
the seven strategies of the frontier (:data:`compare_runs.CORE_STRATEGIES`)."""
EVAL_SAMPLES_FLAG = "--num_eval_samples"
WARM_MODEL_TIMEOUT = 3600.0
"""Seconds ``scripts/warm_model.py`` may take to build a warm model (reusing a cached one takes seconds)."""

log = progress("compare")


# ---- the command line ----------------------------------------------------------------------------------------------


def parse_lrs(text: str) -> list[float]:
    """``1e-6,3e-6`` -> ``[1e-06, 3e-06]``; raises ValueError naming the bad entry."""
    lrs = []
    for item in text.split(","):
        try:
            lr = float(item)
        except ValueError:
            raise ValueError(f"{item.strip()!r} is not a number") from None
        if not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"{item.strip()!r} is not a positive learning rate")
        lrs.append(lr)
    return lrs


def parse_seeds(text: str, num_lrs: int) -> list[int]:
    """``3`` -> 3 seeds at every learning rate; ``1,1,3`` -> one count per learning rate. Raises ValueError."""
    try:
        counts = [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a count or a comma-separated list of counts") from None
    if any(c < 1 for c in counts):
        raise ValueError(f"{text!r}: every count must be at least 1")
    if len(counts) == 1:
        return counts * num_lrs
    if len(counts) != num_lrs:
        raise ValueError(f"{text!r} gives {len(counts)} counts for {num_lrs} learning rates (--lrs)")
    return counts


def build_parser() -> argparse.ArgumentParser:
    """The flags (module docstring)."""
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph
    ap = argparse.ArgumentParser(description=summary, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--recipe", choices=("grpo", "pretrain"), default="grpo", help="recipes/<recipe>.py (default grpo)")
    ap.add_argument(
        "--config", type=Path, default=None, help="recipe config (default configs/grpo-demo.yaml or pretrain-tiny.yaml)"
    )
    ap.add_argument(
        "--strategies", default=None, help=f"comma-separated, of {', '.join(STRATEGIES)} (grpo default "
        f"{GRPO_DEFAULTS['strategies']}; --quick and pretrain: ddp and those)",
    )  # fmt: skip
    ap.add_argument("--workers", type=int, default=4, help="workers per strategy (default 4)")
    ap.add_argument(
        "--lrs", default=None, help=f"comma-separated inner learning rates (grpo default {GRPO_DEFAULTS['lrs']}; "
        "pretrain: the config's)",
    )  # fmt: skip
    ap.add_argument(
        "--seeds", default=None, help=f"seeds per learning rate: N, or one count per --lrs entry (grpo default "
        f"{GRPO_DEFAULTS['seeds']}; with --lrs or pretrain: 1)",
    )  # fmt: skip
    ap.add_argument(
        "--steps", type=int, default=None, help=f"--max_steps per worker (grpo default {GRPO_DEFAULTS['steps']}, "
        "pretrain: the config's; for the swarm strategies a multiple of inner_steps)",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: --warm-size {QUICK['warm_size']} --lrs "
                    f"{QUICK['lrs']} --seeds {QUICK['seeds']} --steps {QUICK['steps']}, ddp and the default's "
                    "seven (unless given)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="--seed of seed 0 (seed j: + 1000 j; swarm peer i: + i)")
    ap.add_argument(
        "--model_name_or_path", "--model-name-or-path", default=None,
        help="the model every run starts from (grpo default: scripts/warm_model.py --size WARM_SIZE)",
    )  # fmt: skip
    ap.add_argument(
        "--warm-size", default=None,
        help=f"scripts/warm_model.py --size for grpo (default {GRPO_DEFAULTS['warm_size']}; --quick: "
        f"{QUICK['warm_size']})",
    )  # fmt: skip
    ap.add_argument("--no-publish", action="store_true", help="no PULSESync publishing by the swarm's peer 0")
    ap.add_argument("--bandwidth", default=None, help="limit each worker's link, e.g. 100mbit (needs root)")
    ap.add_argument("--parallel", action="store_true", help="the strategies of a run at once (times not comparable)")
    ap.add_argument(
        "--out", type=Path, default=None,
        help="where compare.md, .json and the plots go (default: a new folder experiments/compare/results/"
        "MODEL-LRS-STEPS-STAMP, named after the run's model, learning rates, steps and start time; --report: "
        "report-STAMP)",
    )  # fmt: skip
    ap.add_argument("--runs-dir", type=Path, default=None, help="logs and outputs (default: a temporary directory)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the temporary runs directory")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take (default 1800)")
    ap.add_argument("--json", type=Path, default=None, help="the results as JSON (default OUT/compare.json)")
    ap.add_argument(
        "--report", action="append", default=None, metavar="JSON[,JSON...]",
        help="no runs: the table and plots from compare.json files (comma-separated or repeated; merged)",
    )  # fmt: skip
    return ap


def validate(
    ap: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]
) -> tuple[list[str], list[float | None], list[int], list[str]]:
    """The strategies, learning rates (``[None]``: the config's), seed counts and recipe flags (``extra``, with
    ``--num_eval_samples`` of the grpo default added unless given) of a comparison; fills in the defaults of
    ``--steps``, ``--warm-size`` and ``--config`` and resolves the paths. Exits 2 through ``ap.error`` on a bad
    flag."""
    defaults: dict[str, Any] = (
        (QUICK if args.quick else GRPO_DEFAULTS) if args.recipe == "grpo" else {"lrs": None, "seeds": "1"}
    )
    if args.strategies is None:
        args.strategies = defaults.get("strategies", ",".join(CORE_STRATEGIES))
    if args.warm_size is None:
        args.warm_size = defaults.get("warm_size", GRPO_DEFAULTS["warm_size"])
    given = any(a == EVAL_SAMPLES_FLAG or a.startswith(EVAL_SAMPLES_FLAG + "=") for a in extra)
    if "num_eval_samples" in defaults and not given:
        extra = [*extra, EVAL_SAMPLES_FLAG, str(defaults["num_eval_samples"])]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown or not strategies:
        ap.error(f"--strategies: unknown {', '.join(unknown) or '(none given)'} (choose from {', '.join(STRATEGIES)})")
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if args.workers < 2 and "ddp" in strategies:
        log("warning: ddp with one worker sends nothing")
    if args.quick and args.recipe == "pretrain":
        defaults = {**defaults, "steps": QUICK["steps"]}
    if args.steps is None:
        args.steps = defaults.get("steps")
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be at least 1")
    try:
        lrs: list[float | None] = [*parse_lrs(args.lrs or defaults["lrs"])] if (args.lrs or defaults["lrs"]) else [None]
        seeds = parse_seeds(args.seeds or (defaults["seeds"] if args.lrs is None else "1"), len(lrs))
    except ValueError as exc:
        ap.error(f"--lrs/--seeds: {exc}")
    if any(a == "--learning_rate" or a.startswith("--learning_rate=") for a in extra) and lrs != [None]:
        ap.error("give the learning rates with --lrs, not --learning_rate after --")
    args.config = (args.config or DEFAULT_CONFIGS[args.recipe]).resolve()
    if not args.config.is_file():
        ap.error(f"--config: {args.config} does not exist")
    if args.model_name_or_path is not None and Path(args.model_name_or_path).expanduser().exists():
        args.model_name_or_path = str(Path(args.model_name_or_path).expanduser().resolve())
    return strategies, lrs, seeds, extra


# ---- the runs ------------------------------------------------------------------------------------------------------


def prepare_runs_dir(runs_dir: Path | None) -> tuple[Path, bool]:
    """The runs directory and whether it is a temporary one (``runs_dir`` None); a given one loses the output
    directories of an earlier comparison (the recipes refuse a used output_dir). Raises OSError when it cannot be
    made."""
    temp_runs = runs_dir is None
    runs_dir = Path(tempfile.mkdtemp(prefix="pulseloco-compare-")) if runs_dir is None else runs_dir.resolve()
    if not temp_runs:
        for old in [*runs_dir.glob("lr*-seed*"), *runs_dir.glob("config-lr-seed*"), runs_dir / "keys"]:
            shutil.rmtree(old, ignore_errors=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    return runs_dir, temp_runs


def open_network(bandwidth: str | None, workers: int) -> tuple[NetNS | None, str]:
    """The namespaces of a ``--bandwidth`` comparison (the bootstrap node and ``workers`` workers), or None with the
    reason in the description when they cannot be made (not root, setup failed); never raises for those."""
    if not bandwidth:
        return None, "loopback (127.0.0.1), no bandwidth limit"
    netns, reason = open_netns(workers + 1, bandwidth, prefix="plcmp")
    if netns is None:
        log(f"--bandwidth {bandwidth}: skipped ({reason})")
        return None, f"loopback (127.0.0.1); --bandwidth {bandwidth} skipped: {reason}"
    return netns, (
        f"each worker (and the bootstrap node) in its own network namespace behind a veth limited to "
        f"{rate_label(bandwidth)} each way (tc tbf)"
    )


def start_bootstraps(runner: Runner, networks: set[bool]) -> dict[bool, str]:
    """A bootstrap node per network the swarm runs use (limited: in namespace 0 when the runner has them, else on
    loopback): ``{limited: multiaddr}``. Raises ProcFailed (a RuntimeError) when one does not start."""
    bootstraps: dict[bool, str] = {}
    for limited in sorted(networks):
        in_ns = limited and runner.netns is not None
        host = runner.netns.host(0) if in_ns and runner.netns is not None else "127.0.0.1"
        name = f"bootstrap{'' if limited else '-loopback'}"
        bootstraps[limited] = start_bootstrap(runner, name, host=host, ns_index=0 if in_ns else None)
        log(f"bootstrap node: {bootstraps[limited]}")
    return bootstraps


def wait_run(run: StrategyRun, timeout: float) -> None:
    """Wait for a run's processes, record a failure in ``run.error`` (never raises for it), then stop them all."""
    try:
        wait_all(run.procs, timeout, hint="--timeout")
        log(f"{run.strategy}: done in {max(p.ended or 0 for p in run.procs) - run.procs[0].started:.1f} s")
    except RuntimeError as exc:
        run.error = str(exc)
        log(f"{run.strategy}: FAILED: {exc}")
    finally:
        stop_all(run.procs)


def run_plans(runner: Runner, args: argparse.Namespace, plans: list[Plan], extra: list[str]) -> list[StrategyRun]:
    """The warm model (grpo without ``--model_name_or_path``), the signing key and the bootstrap nodes, then every
    plan, one at a time (``--parallel``: the strategies of a learning rate and seed at once). A run's failure is in
    its ``error``; raises RuntimeError when the warm model, the key or a bootstrap node fails."""
    swarm_runs = [p for p in plans if p.strategy != "ddp"]
    if args.recipe == "grpo" and args.model_name_or_path is None:
        log(f"warm model: scripts/warm_model.py --size {args.warm_size} (built once, minutes; then reused)")
        args.model_name_or_path = str(warm_model_dir(args.warm_size, timeout=WARM_MODEL_TIMEOUT))
        log(f"warm model: {args.model_name_or_path}")
    key = make_signing_key(runner) if swarm_runs and not args.no_publish else None
    bootstraps = start_bootstraps(runner, {p.limited for p in swarm_runs})
    batches = (
        [list(g) for _, g in itertools.groupby(plans, key=lambda p: p.tag)] if args.parallel else [[p] for p in plans]
    )
    runs: list[StrategyRun] = []
    for n, batch in enumerate(batches, 1):
        started = [start_run(runner, args, p, bootstraps.get(p.limited), extra, key) for p in batch]
        names = ", ".join(p.strategy for p in batch)
        log(f"[{n}/{len(batches)}] {batch[0].tag}: {names} ({args.workers} workers each); logs in {runner.log_dir}")
        for run in started:
            wait_run(run, args.timeout)
        runs += started
    return runs


# ---- the outputs ---------------------------------------------------------------------------------------------------


def metric_labels(recipe: str, sources: list[str]) -> dict[str, str]:
    """What the final metric and the curves are (``metric_label``, ``curve_label``, ``metric_note`` of the meta),
    from the recipe and where the runs' final metrics came from (``eval``, ``train``)."""
    if recipe == "grpo":
        note = (
            "greedy exact-match reward on the fixed evaluation prompts (`reward_after` in grpo_eval.json); beside it "
            "the sampled reward on the same prompts (`--num_eval_samples` draws each at the training temperature: "
            "`sampled_reward_before/after` in grpo_eval.json), ± its sampling standard error for one seed, else the "
            "mean and range over the seeds, which resolves gains the greedy reward on 100 problems cannot"
        )
        return {"metric_label": "greedy reward", "curve_label": "sampled reward", "metric_note": note}
    if sources == ["train"]:
        note = "pretrain.py logged no eval loss (no held-out blocks?), so the last logged training loss"
        return {"metric_label": "training loss", "curve_label": "training loss", "metric_note": note}
    note = "held-out loss of the final model (pretrain.py's evaluation after training)"
    if sources == ["eval", "train"]:
        note += "; (training): that run logged no eval loss, the last logged training loss instead"
    label = "eval loss" if sources != ["eval", "train"] else "loss"
    return {"metric_label": label, "curve_label": "training loss", "metric_note": note}


def make_meta(
    args: argparse.Namespace, command: str, extra: list[str], plan_lists: dict[str, Any], netns: NetNS | None,
    network: str, results: list[dict[str, Any]], started_at: float, commit: str,
) -> dict[str, Any]:  # fmt: skip
    """The ``meta`` of compare.json: the command, the settings, the network, the labels, the date, the commit the
    runs started from (``commit``: commits made while they run do not change their code) and the machine
    (``plan_lists``: the ``strategies``, ``lrs`` and ``seeds``)."""
    sources = sorted({r["final_source"] for r in results if r["final_source"] in ("eval", "train")})
    labels = metric_labels(args.recipe, sources)
    ddp_launch = (
        f"{args.workers} `accelerate launch --num_machines {args.workers}` of one process, one per namespace"
        if netns is not None
        else f"one `accelerate launch --config_file recipes/accelerate_configs/multi_process_cpu.yaml "
        f"--num_processes {args.workers}`"
    )
    pretrain = args.recipe == "pretrain"
    return {
        "command": command,
        "recipe": args.recipe,
        "recipe_path": f"recipes/{args.recipe}.py",
        "config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(REPO) else str(args.config),
        "model": args.model_name_or_path,
        **plan_lists,
        "seed_note": (
            f"{args.seed} + {SEED_STRIDE} j for seed j, "
            + ("swarm peer i: --data_seed + i" if pretrain else "swarm peer i: + i")
        ),
        "steps": args.steps,
        "extra": extra,
        "workers": args.workers,
        "parallel": args.parallel,
        "network": network,
        "bandwidth": args.bandwidth,
        "bandwidth_applied": netns is not None,
        "ddp_launch": ddp_launch,
        "ddp_bytes": "estimated: 2 (W - 1) / W * 4 * num_params * steps per worker (ring all-reduce, FP32 gradients)",
        "metric_label": labels["metric_label"],
        "metric_sources": sources,
        "curve_label": labels["curve_label"],
        "metric_note": labels["metric_note"],
        "targets": TARGETS,
        "seconds": round(time.monotonic() - started_at, 1),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "commit": commit,
        "machine": machine_note(),
    }


def report_paths(values: list[str]) -> list[Path]:
    """The files of ``--report`` (each value comma-separated), resolved, in the order given; raises ValueError for
    none or a file given twice."""
    paths = [Path(item).expanduser().resolve() for value in values for item in value.split(",") if item.strip()]
    if not paths:
        raise ValueError("no file given")
    twice = sorted({str(p) for p in paths if paths.count(p) > 1})
    if twice:
        raise ValueError(f"given more than once: {', '.join(twice)}")
    return paths


def report_again(sources: list[Path], out: Path, json_path: Path) -> int:
    """``--report``: the table, plots and JSON from the runs of earlier compare.json files, merged
    (:func:`compare_report.merge_reports`), with this version's aggregation, verdicts and targets; the runs'
    numbers, commands, dates and machines as recorded. Exit code 2 (one line) on an unreadable file or files run
    with other settings."""
    reports = []
    for source in sources:
        try:
            data = json.loads(source.read_text(encoding="utf-8"))
            if not isinstance(data["meta"], dict) or not isinstance(data["results"], list):
                raise TypeError("no meta object and results list")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            message = f"--report {source}: not a compare.json this script wrote ({exc})"
            print(f"compare.py: error: {message}", file=sys.stderr)
            return 2
        reports.append((str(source), data))
    try:
        results, meta = merge_reports(reports)
        rows = aggregate(results)
    except ValueError as exc:
        print(f"compare.py: error: --report: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError) as exc:
        print(f"compare.py: error: --report: not a compare.json this script wrote ({exc!r})", file=sys.stderr)
        return 2
    if len(reports) > 1:
        meta.update(metric_labels(meta["recipe"], meta["metric_sources"]))
    meta["reported_by"] = git_revision()
    meta["targets"] = TARGETS
    write_outputs(out, json_path, results, meta)
    names = ", ".join(map(str, sources))
    log(f"{out / 'compare.md'} and the plots from {names} ({len(results)} runs, {len(rows)} rows)")
    return 0


# ---- main ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write its outputs. Exit codes: 0; 1 when a run failed (its row is missing, the failure
    is listed) or the warm model, key or a bootstrap node failed (nothing written); 2 for bad flags or a Python
    that cannot run it (one line); 130 on Ctrl-C, 143 on SIGTERM (every process stopped)."""
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join([".venv/bin/python", "experiments/compare/compare.py", *argv])
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.report is not None:
        args.out = args.out or default_out("compare", "report")
        json_path = args.json or args.out / "compare.json"
        try:
            sources = report_paths(args.report)
        except ValueError as exc:
            ap.error(f"--report: {exc}")
        return report_again(sources, args.out, json_path)
    problem = environment_problem()
    if problem is not None:  # before anything is created or started: one line, no traceback
        print(f"compare.py: error: {problem}; {SETUP_HINT}", file=sys.stderr, flush=True)
        return 2
    strategies, lrs, seeds, extra = validate(ap, args, extra)
    if args.out is None:
        model = Path(args.model_name_or_path).name if args.model_name_or_path else args.warm_size
        args.out = default_out("compare", f"{model}-{lr_label(lrs)}-{args.steps}")
    json_path = args.json or args.out / "compare.json"
    runs_dir, temp_runs = prepare_runs_dir(args.runs_dir)

    def remove_temp_runs() -> None:  # a temporary runs directory goes unless --keep-runs
        if temp_runs and not args.keep_runs:
            shutil.rmtree(runs_dir, ignore_errors=True)
        elif temp_runs:
            log(f"runs kept in {runs_dir}")

    netns, network = open_network(args.bandwidth, args.workers)
    plans = make_plans(strategies, lrs, seeds, args.seed, reference=netns is not None)
    runner = Runner(runs_dir, netns=netns, env=recipe_env())
    previous = signal.getsignal(signal.SIGTERM)
    exit_on_signals(signal.SIGTERM)
    started_at, commit = time.monotonic(), git_revision()
    try:
        runs = run_plans(runner, args, plans, extra)
    except (KeyboardInterrupt, SystemExit) as exc:
        log("interrupted; stopping everything")
        runner.stop_all()
        remove_temp_runs()
        return 130 if isinstance(exc, KeyboardInterrupt) else 128 + signal.SIGTERM
    except RuntimeError as exc:  # the warm model, the key or a bootstrap node failed: nothing to compare
        log(f"error: {exc}")
        runner.stop_all()
        remove_temp_runs()
        return 1
    finally:
        runner.stop_all()
        if netns is not None:
            netns.teardown()
        signal.signal(signal.SIGTERM, previous)

    results = [summarize(run, args.recipe, args.workers) for run in runs]
    plan_lists = {"strategies": strategies, "lrs": lrs, "seeds": seeds}
    meta = make_meta(args, command, extra, plan_lists, netns, network, results, started_at, commit)
    write_outputs(args.out, json_path, results, meta)
    log(f"done in {meta['seconds'] / 60:.1f} min: {args.out / 'compare.md'}, {json_path}, plots in {args.out}")
    remove_temp_runs()
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
