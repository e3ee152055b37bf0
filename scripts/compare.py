#!/usr/bin/env python
"""The paper's table on this machine: ddp, diloco, pulseloco, sparseloco (and pulseloco with BF16 values) in GRPO
post-training of a warm model; reward against bytes sent, wall time, density per round and PULSESync patch sizes.

    .venv/bin/python scripts/compare.py                       # the table: GRPO, 4 workers, lr 5e-5, 3 seeds
    .venv/bin/python scripts/compare.py --quick               # a few minutes: one learning rate, one seed, 32 steps
    .venv/bin/python scripts/compare.py --lrs 3e-6 --seeds 3  # one learning rate, three seeds
    .venv/bin/python scripts/compare.py --bandwidth 100mbit   # each worker behind a 100 Mbit/s link (root)
    .venv/bin/python scripts/compare.py --recipe pretrain     # recipes/pretrain.py, configs/pretrain-tiny.yaml
    .venv/bin/python scripts/compare.py -- --beta 0.04        # after --: to every recipe run

Run it with the project's Python (``.venv/bin/python``, made by ``scripts/demo.sh`` or ``scripts/test.sh``): it
starts the ``pulseloco`` command from beside ``sys.executable`` (and says so in one line if it is not there), and
accelerate's launcher as ``python -m accelerate.commands.launch``: the code ``accelerate launch`` runs, without the
console script's import of accelerate's other subcommands (4 CPU-s per launch).

**What runs.** For every learning rate of ``--lrs`` (``--learning_rate`` of the inner AdamW; default 5e-5, the
lowest at which DiLoCo clearly learns on the demo warm model within the run: 4 workers, 160 steps, greedy reward
0.52 -> 0.65 at 5e-5 and 0.54 at 2e-5, one seed each, 2026-11-25) and every seed, each strategy of ``--strategies``
trains the same warm model (``scripts/warm_model.py --size demo``, ``--warm-size``, or ``--model_name_or_path``) on
the same task with the same config (``recipes/configs/grpo-demo.yaml``: 16 prompts x 8 completions per step, the
peers' weights averaged every round; ``--steps`` optimizer steps, default 160, H = ``inner_steps`` = 8) and the
same number of workers (``--workers``, default 4). The earlier default, the tiny model at lr 1e-6 / 3e-6 / 1e-5, is
``--warm-size tiny --config recipes/configs/grpo-tiny.yaml --lrs 1e-6,3e-6,1e-5 --seeds 1,1,3 --steps 256``:

* ``ddp``: one ``accelerate launch --config_file recipes/accelerate_configs/multi_process_cpu.yaml --num_processes W``
  (the Trainer's data parallelism, gradients all-reduced every step). Nothing measures its traffic: its bytes per
  worker are a ring all-reduce of FP32 gradients every optimizer step, ``2 (W - 1) / W * 4 * num_params * steps``
  (the parameters counted in the saved model);
* ``diloco`` (dense FP32 pseudo-gradients), ``pulseloco`` (the PULSE rule, FP32 values), ``pulseloco-bf16`` (the
  PULSE rule sending BF16-rounded values, the rounding error kept in the residual: ``--pulse_values bfloat16``),
  ``sparseloco`` (top-k): W peers of one process each (``accelerate launch -q --config_file
  recipes/accelerate_configs/single_process.yaml``) joined through a bootstrap node (``pulseloco dht``), every
  round formed by all W peers (``--target_group_size W``). Their bytes are the wire bytes PulseLoCo measured
  (``bytes_sent`` in each peer's ``pulseloco_rounds.jsonl``). Peer 0 also publishes every consensus version with
  PULSESync (``--publish``, a key made by ``pulseloco keygen`` in the runs directory), so the table has the patch
  bytes per version against a full BF16 copy (``2 * num_params``) for the same run.

**Bytes, wire and payload.** Wire bytes are what a worker sent (above: for a swarm peer its pushed parts plus the
sums of its shard it served to the others, headers included). Payload bytes are its own compressed
pseudo-gradient as one frame (``payload_bytes`` in ``pulseloco_rounds.jsonl``): what the paper's all-gather
through an object store uploads; DiLoCo's is its dense FP32 frame, ddp's an estimate, ``4 * num_params`` per
optimizer step. Both per worker over the run and per worker and round (ddp: per ``inner_steps`` optimizer steps of
the swarm strategies), each against DiLoCo's and DDP's. For every swarm run, the rounds of all its peers go through
:func:`pulseloco.loco.metrics.traffic_summary` (``traffic`` in the JSON) and the wire bytes per selected entry are
split into indices, values, shard sums (index and value sections) and headers (``bytes_per_entry``; the parts add
up to the wire bytes), with the index bits per entry against the entropy bound ``log2 C(N, k) / k``.

Seed ``j`` of ``--seeds`` gives every run ``--seed SEED + 1000 j``; swarm peer ``i`` gets ``+ i`` on top (its own
prompts and samples), pretrain peers ``--data_seed`` instead (the same initial weights). ``--seeds N`` runs N seeds
at every learning rate; ``--seeds 1,1,3`` gives each learning rate its own count (default 3 with the default
``--lrs``; with other ``--lrs`` one seed each).

**Quality** is the greedy exact-match reward of the final model on the fixed evaluation prompts
(``--num_eval_prompts 100``; ``reward_after`` in ``grpo_eval.json``), before and after, as mean, standard
deviation and range over seeds (swarm peers end on the consensus model; the mean over the workers is taken). A
strategy "learned" at a learning rate when every seed improved on the warm model and the mean gain is at least
``MIN_GAIN`` (0.05, five of the 100 prompts); where it did not, no quality is claimed for it. PULSELoCo "matches
DiLoCo" at a learning rate when its mean lies within DiLoCo's range over seeds (needs at least 2 seeds).

**Outputs** (``--out``, default ``results/``): ``compare.md`` (per learning rate a table, one of wire and payload
bytes per worker and round, one of the sparse strategies' bytes per selected entry, and the targets: pulseloco
bytes <= 1/17 of DiLoCo's and <= 1/100 of DDP's, PULSESync patches <= 1/50 of a BF16 copy; the command, date,
commit and machine; also printed), ``compare.json`` (every run and every aggregate), ``compare_reward_bytes.png`` and
``compare_reward_time.png`` (the sampled training reward, seed mean, against bytes sent and training time),
``compare_final.png`` (final greedy reward, mean and range, against bytes sent) and ``compare_density.png`` (the
fraction of entries each round sent, against the round). The runs' logs and output directories go to ``--runs-dir``
(default: a temporary directory, removed unless ``--keep-runs``). ``--report compare.json`` runs nothing: it writes
the table, JSON and plots again from an earlier run's JSON (this version's aggregation and verdicts).

**Network.** On loopback by default. With ``--bandwidth RATE`` (root with ``ip netns`` and ``tc``) the bootstrap
node and every worker run in network namespaces of their own behind a veth limited to RATE each way
(scripts/netns.py), ddp as W single-process launches of a W-machine job; the first learning rate and seed of every
strategy also runs on loopback, and a table compares the training times (how close each strategy gets to an
unlimited link). Without root it says why it skipped the limit.

Runs go one after the other (``--parallel``: the strategies of one learning rate and seed at once, faster, but then
times are not comparable). Every process has a timeout (``--timeout`` per run) and is stopped (its process group)
when the script ends, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: also under `python -I` and when imported
# scripts/demo_report.py:
from demo_report import allreduce_bytes, fmt, human, mean, read_events, read_json, store_summary
from netns import NetNS, rate_label  # scripts/netns.py

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
CONFIGS = RECIPES / "configs"
DEFAULT_CONFIGS = {"pretrain": CONFIGS / "pretrain-tiny.yaml", "grpo": CONFIGS / "grpo-demo.yaml"}
ACCELERATE_CONFIGS = RECIPES / "accelerate_configs"
SINGLE_PROCESS = ["--config_file", str(ACCELERATE_CONFIGS / "single_process.yaml")]
MULTI_PROCESS = ["--config_file", str(ACCELERATE_CONFIGS / "multi_process_cpu.yaml")]
STRATEGIES: dict[str, tuple[str, list[str]]] = {
    "ddp": ("ddp", []),
    "diloco": ("diloco", []),
    "pulseloco": ("pulseloco", []),
    "pulseloco-bf16": ("pulseloco", ["--pulse_values", "bfloat16"]),
    "sparseloco": ("sparseloco", []),
}
"""Name in the table -> (the recipe's ``--strategy``, further recipe flags)."""
GRPO_DEFAULTS = {"lrs": "5e-5", "seeds": "3", "steps": 160}
GRPO_FLAGS = ["--num_eval_prompts", "100", "--logging_steps", "8"]
"""Recipe flags of every grpo run (before the user's, which win): the tiny task's 100 problems, a reward point a
round."""
QUICK = {"lrs": "5e-5", "seeds": "1", "steps": 32}
SEED_STRIDE = 1000
"""Seed j of a comparison starts at ``--seed + SEED_STRIDE * j``: its peers' seeds (``+ i``) never overlap."""
MIN_GAIN = 0.05
"""A strategy learned at a learning rate when every seed's final reward beats the starting model's and the mean
gain is at least this (5 of the 100 evaluation prompts; one answer more is 0.01)."""
TARGETS = {"diloco": 1 / 17, "ddp": 1 / 100, "pulsesync": 1 / 50}
"""The paper's claims: pulseloco's bytes against DiLoCo's and DDP's, PULSESync patches against a BF16 copy."""
STARTUP_TIMEOUT = 180.0
"""Seconds for the bootstrap node to print its multiaddr (imports are slow on a busy two-core machine)."""
PEER_STARTUP_TIMEOUT = 120.0
"""``--startup_timeout`` of the swarm peers: seconds to start their DHT and reach the bootstrap node."""
WARM_MODEL_TIMEOUT = 3600.0
"""Seconds ``scripts/warm_model.py`` may take to build a warm model (reusing a cached one takes seconds)."""
DDP_PORT = 29517
"""Rendezvous port of ddp across network namespaces (``--bandwidth``); on one machine accelerate picks a free one."""
REQUIRED_MODULES = ("torch", "transformers", "trl", "accelerate", "hivemind", "matplotlib", "yaml", "pulseloco")
"""What the recipe runs and the plots import; checked (without importing) before anything starts."""
REQUIRED_COMMANDS = ("pulseloco",)
"""Executables started from beside ``sys.executable``."""
SETUP_HINT = "run scripts/demo.sh or scripts/test.sh once to create .venv, then use .venv/bin/python scripts/compare.py"


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def environment_problem(python: str | None = None) -> str | None:
    """Why this Python cannot run the comparison (``None``: it can): modules of the project's dependencies that it
    cannot import, or the ``pulseloco`` command missing beside it. Nothing is imported."""
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
    return None


# ---- processes ---------------------------------------------------------------------------------------------------


class Proc:
    """A process in a session of its own (so that stopping it reaches accelerate's children, hivemind's DHT
    process and libp2p daemon), output to a log file, no stdin."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        self.started = time.monotonic()
        self.ended: float | None = None
        with log_path.open("wb") as fh:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, num_lines: int = 25) -> str:
        return "\n".join(self.text().splitlines()[-num_lines:])

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL it (bounded; the group may hold leftovers after an exit)."""
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
            if sig == signal.SIGTERM:
                time.sleep(0.5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.poll()


class Runner:
    """Starts processes (optionally inside a :class:`NetNS` peer namespace) and stops all of them at the end."""

    def __init__(self, runs_dir: Path, netns: NetNS | None) -> None:
        self.runs_dir = runs_dir
        self.netns = netns
        self.procs: list[Proc] = []
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
        self.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), self.env.get("PATH", "")])

    def start(
        self, name: str, argv: list[str], *, ns_index: int | None = None, env: dict[str, str] | None = None
    ) -> Proc:
        if self.netns is not None and ns_index is not None:
            argv = ["ip", "netns", "exec", self.netns.peer_ns(ns_index), *argv]
        proc = Proc(name, argv, self.runs_dir / f"{name}.log", {**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs = []


def wait_all(procs: list[Proc], timeout: float) -> None:
    """Wait until every process exited with code 0; raises RuntimeError (with the log tail) otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        for proc, code in zip(procs, codes):
            if code not in (None, 0):
                raise RuntimeError(f"{proc.name} exited with {code}; log {proc.log_path}:\n{proc.tail()}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            late = [p for p, c in zip(procs, codes) if c is None]
            raise RuntimeError(
                f"{', '.join(p.name for p in late)} still running after {timeout:.0f} s (--timeout); "
                f"log {late[0].log_path}:\n{late[0].tail()}"
            )
        time.sleep(0.5)


def wait_for_maddr(proc: Proc, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(r"multiaddr: (/ip4/\S+/p2p/\S+)", proc.text())
        if match:
            return match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise RuntimeError(f"the bootstrap node printed no multiaddr in {timeout:.0f} s; log:\n{proc.tail()}")


# ---- one run: a strategy at a learning rate and seed -------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One run of the comparison."""

    strategy: str
    lr: float | None
    """``--learning_rate`` (``None``: the config's)."""
    seed_index: int
    seed: int
    limited: bool = True
    """False: the loopback reference of a ``--bandwidth`` comparison."""

    @property
    def tag(self) -> str:
        lr = "config-lr" if self.lr is None else f"lr{self.lr:g}"
        return f"{lr}-seed{self.seed_index}{'' if self.limited else '-unlimited'}"


@dataclass
class StrategyRun:
    plan: Plan
    workers: list[Path] = field(default_factory=list)
    """Output directories that receive trainer_state.json (ddp: one, written by its main process; else one per
    peer)."""
    procs: list[Proc] = field(default_factory=list)
    error: str | None = None

    @property
    def strategy(self) -> str:
        return self.plan.strategy


def recipe_argv(
    args: argparse.Namespace, plan: Plan, output_dir: Path, extra: list[str], peer: int | None = None
) -> list[str]:
    """The recipe and its flags; ``peer``: the index of a swarm peer, which gets batches of its own."""
    strategy, flags = STRATEGIES[plan.strategy]
    argv = [str(RECIPES / f"{args.recipe}.py"), "--config", str(args.config), "--strategy", strategy, *flags]
    argv += ["--output_dir", str(output_dir), "--seed", str(plan.seed)]
    if peer is not None and args.recipe == "pretrain":
        argv += ["--data_seed", str(plan.seed + peer)]  # same initial weights (--seed), other batches
    elif peer is not None:
        argv[-1] = str(plan.seed + peer)  # grpo: the seed draws the prompts, their order and the samples
    if args.steps is not None:
        argv += ["--max_steps", str(args.steps)]
    if plan.lr is not None:
        argv += ["--learning_rate", f"{plan.lr:g}"]
    if args.model_name_or_path is not None:
        argv += ["--model_name_or_path", str(args.model_name_or_path)]
    if args.recipe == "grpo":
        argv += GRPO_FLAGS
    return argv + extra


def start_run(
    runner: Runner, args: argparse.Namespace, plan: Plan, bootstrap: str | None, extra: list[str], key: Path | None
) -> StrategyRun:
    """Start the processes of one run; peer 0 of a swarm strategy publishes with ``key`` (PULSESync) if given."""
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]  # `accelerate launch` (module docstring)
    run = StrategyRun(plan)
    out = runner.runs_dir / plan.tag / plan.strategy
    w = args.workers
    netns = runner.netns if plan.limited else None
    name = f"{plan.tag}-{plan.strategy}"
    if plan.strategy == "ddp" and netns is None:
        # one launch of W processes (gloo on a CPU machine); one process: -q keeps accelerate's own traceback out
        launch = [*MULTI_PROCESS, "--num_processes", str(w)] if w > 1 else ["-q", *SINGLE_PROCESS]
        run.procs.append(runner.start(name, [*accelerate, *launch, *recipe_argv(args, plan, out, extra)]))
        run.workers.append(out)
    elif plan.strategy == "ddp" and netns is not None:
        # one launch per namespace: a W-machine job of one process each, its gloo traffic on the limited links
        for i in range(w):
            argv = [*accelerate, *MULTI_PROCESS, "--num_machines", str(w), "--num_processes", str(w)]
            argv += ["--machine_rank", str(i), "--main_process_ip", netns.host(1), "--main_process_port"]
            argv += [str(DDP_PORT), *recipe_argv(args, plan, out, extra)]
            env = {"GLOO_SOCKET_IFNAME": "eth0"}
            run.procs.append(runner.start(f"{name}{i}", argv, ns_index=1 + i, env=env))
        run.workers.append(out)
    else:
        swarm = ["--run_id", f"compare-{os.getpid()}-{name}", "--initial_peers", str(bootstrap)]
        swarm += ["--target_group_size", str(w), "--matchmaking_time", "60", "--linger", "3"]
        swarm += ["--startup_timeout", f"{PEER_STARTUP_TIMEOUT:g}"]
        for i in range(w):
            peer_out = out / f"peer{i}"
            argv = [*accelerate, "-q", *SINGLE_PROCESS, *recipe_argv(args, plan, peer_out, extra, peer=i), *swarm]
            if netns is not None:
                argv += ["--host_maddrs", f"/ip4/{netns.host(1 + i)}/tcp/0"]
            if i == 0 and key is not None:
                argv += ["--publish", "--signing_key", str(key)]
            run.procs.append(runner.start(f"{name}-peer{i}", argv, ns_index=1 + i if netns is not None else None))
            run.workers.append(peer_out)
    return run


def make_signing_key(runner: Runner) -> Path:
    """``pulseloco keygen`` into the runs directory (removed with it unless kept; never in the repository)."""
    key = runner.runs_dir / "keys" / "publisher"
    key.parent.mkdir(parents=True, exist_ok=True)
    proc = runner.start("keygen", ["pulseloco", "keygen", "--out", str(key)])
    wait_all([proc], 120.0)
    return key


def build_warm_model(runner: Runner, size: str, timeout: float) -> Path:
    """``scripts/warm_model.py --size SIZE`` (built once and cached, else reused): the directory it prints last."""
    proc = runner.start("warm_model", [sys.executable, str(REPO / "scripts" / "warm_model.py"), "--size", size])
    wait_all([proc], timeout)
    found = re.findall(r"^warm model: (.+)$", proc.text(), flags=re.MULTILINE)
    if not found or not Path(found[-1].strip()).is_dir():
        raise RuntimeError(f"scripts/warm_model.py printed no `warm model: DIR` line; log:\n{proc.tail()}")
    return Path(found[-1].strip())


def count_parameters(model_dir: Path) -> int | None:
    """Parameters of the Hugging Face model saved in ``model_dir``: the tensors of its ``*.safetensors`` files (tied
    weights are stored once, as ``model.parameters()`` counts them), read from their headers without torch."""
    total, files = 0, sorted(model_dir.glob("*.safetensors"))
    for path in files:
        try:
            with path.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
        except (OSError, ValueError):
            return None
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total if files else None


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x), held constant beyond the last one."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


# ---- results -----------------------------------------------------------------------------------------------------


def summarize_worker(out: Path, recipe: str, num_workers: int, swarm: bool) -> dict[str, Any]:
    """What one worker's output directory says: final metric (and where it came from), bytes sent (wire) and
    payload bytes, train time, steps, rounds, density per round, its round records (swarm peers, for
    :func:`summarize`), and its curve of (bytes sent, training seconds, logged loss or reward) per logging step."""
    state = read_json(out / "trainer_state.json")
    history = [e for e in state.get("log_history", []) if isinstance(e, dict)]
    steps = state.get("global_step")
    runtime = next((e["train_runtime"] for e in reversed(history) if "train_runtime" in e), None)
    curve_key = "loss" if recipe == "pretrain" else "reward"
    logged = [e for e in history if e.get(curve_key) is not None and "step" in e]
    final, source = None, None
    evaluation = read_json(out / "grpo_eval.json")
    if recipe == "pretrain":
        evals = [e["eval_loss"] for e in history if e.get("eval_loss") is not None]
        if evals:
            final, source = evals[-1], "eval"
        elif logged:
            final, source = logged[-1][curve_key], "train"
    else:
        final, source = evaluation.get("reward_after"), "greedy"
    rounds = read_events(out / "pulseloco_rounds.jsonl")
    num_params = count_parameters(out)
    result: dict[str, Any] = {
        "final": final,
        "source": source,
        "reward_before": evaluation.get("reward_before"),
        "steps": steps,
        "train_seconds": runtime,
        "num_params": num_params,
        "rounds": len(rounds),
        "group_sizes": sorted({r["num_peers"] for r in rounds}),
        "density": [r["density"] for r in rounds],
        "incomplete_rounds": sum(1 for r in rounds if not r.get("complete", True)),
    }
    # the curve's x values at a logging step: bytes sent by then, and training seconds by then
    inner = steps // len(rounds) if swarm and rounds and steps else None  # a round every inner_steps steps
    result["round_records"] = rounds if swarm else []  # pooled over the peers by summarize()
    if inner:
        result["bytes_sent"] = sum(r["bytes_sent"] for r in rounds)
        result["bytes_received"] = sum(r["bytes_received"] for r in rounds)
        has_payload = all("payload_bytes" in r for r in rounds)  # files written before the field: unknown
        result["payload_bytes"] = sum(r["payload_bytes"] for r in rounds) if has_payload else None
        ends = [inner * (r["round"] + 1) for r in rounds]  # round r ends at step (r + 1) H, after its outer step
        sent = [(end, r["bytes_sent"]) for end, r in zip(ends, rounds)]

        def sent_by(step: float) -> float:
            return float(sum(num for end, num in sent if end <= step))

        clock = [(0.0, 0.0)]
        for end, r in zip(ends, rounds):
            clock.append((float(end), clock[-1][1] + r["seconds_inner"] + r["seconds_sync"]))
    else:
        per_step = allreduce_bytes(num_params, num_workers) if num_params is not None and not swarm else None
        result["bytes_sent"] = per_step * steps if per_step is not None and steps is not None else None
        result["bytes_received"] = result["bytes_sent"]
        # ddp's payload: its FP32 gradient once per optimizer step, as an all-gather through a store would upload it
        payload_per_step = 4 * num_params if num_params is not None and not swarm else None
        result["payload_bytes"] = payload_per_step * steps if payload_per_step is not None and steps else None

        def sent_by(step: float) -> float:
            return per_step * step if per_step is not None else 0.0

        clock = [(0.0, 0.0), (float(steps or 0), float(runtime or 0.0))]  # the Trainer logs no time per step
    result["curve"] = [(sent_by(e["step"]), _interpolate(clock, e["step"]), e[curve_key]) for e in logged]
    store = out / "versions"
    if store.is_dir() and num_params:
        sizes = store_summary(store)
        patches = list(sizes["patches"].values())
        result["pulsesync"] = {
            "versions": len(sizes["anchors"]) + len(patches),
            "anchors": len(sizes["anchors"]),
            "patches": len(patches),
            "mean_patch_bytes": sum(patches) / len(patches) if patches else None,
            "mean_anchor_bytes": sum(sizes["anchors"].values()) / len(sizes["anchors"]) if sizes["anchors"] else None,
            "bf16_copy_bytes": 2 * num_params,
        }
    return result


def _per(totals: dict[str, Any] | None, numerator: str, denominator: str) -> float | None:
    """``totals[numerator] / totals[denominator]``; ``None`` without ``totals``, either key, or a denominator."""
    if not totals or totals.get(numerator) is None or not totals.get(denominator):
        return None
    return float(totals[numerator] / totals[denominator])


def entry_split(traffic: dict[str, Any] | None) -> dict[str, float | None] | None:
    """A :func:`~pulseloco.loco.metrics.traffic_summary` as bytes per selected entry: the wire bytes and their
    parts (``index_bytes + value_bytes + sum_bytes + header_bytes == wire_bytes``: the pushed parts' index and
    value sections, the shard sums served, everything else), the payload, and the summary's index bits per entry
    (pushed parts, payload) next to the uniform-subset bound; ``None`` without a summary (ddp), a value ``None``
    where the records lacked its fields."""
    if traffic is None:
        return None
    selected = traffic["num_sent"]

    def per_entry(key: str) -> float | None:
        return traffic[key] / selected if traffic[key] is not None and selected else None

    return {
        "wire_bytes": traffic["wire_bytes_per_entry"],
        "index_bytes": per_entry("sent_index_bytes"),
        "value_bytes": per_entry("sent_value_bytes"),
        "sum_bytes": per_entry("sent_sum_bytes"),
        "header_bytes": traffic["header_bytes_per_entry"],
        "payload_bytes": traffic["payload_bytes_per_entry"],
        "index_bits_pushed": traffic["index_bits_per_entry"],
        "index_bits_payload": traffic["payload_index_bits_per_entry"],
        "index_bits_bound": traffic["index_bound_bits_per_entry"],
        "sum_bytes_per_union_entry": traffic["sum_bytes_per_entry"],
    }


def summarize(run: StrategyRun, recipe: str, num_workers: int) -> dict[str, Any]:
    """One run: final metric (mean over workers), wire and payload bytes per worker (in total and per round),
    train seconds (slowest worker), wall seconds, density per round (mean over the peers), the byte split of
    every peer's rounds together (swarm strategies: ``traffic``, a :func:`~pulseloco.loco.metrics.traffic_summary`,
    and ``bytes_per_entry``, its :func:`entry_split`), PULSESync sizes; the curve of the first worker."""
    swarm = run.strategy != "ddp"
    workers = [summarize_worker(out, recipe, num_workers, swarm) for out in run.workers]
    traffic = None
    if swarm:
        from pulseloco.loco.metrics import traffic_summary  # here: importing pulseloco.loco loads torch

        traffic = traffic_summary([r for w in workers for r in w["round_records"]])  # every peer's rounds
    if not swarm:  # ddp: the processes it ran, from the recipe's start line ("processes=W")
        found = [int(m) for p in run.procs for m in re.findall(r"processes=(\d+)", p.text())]
        for worker in workers:
            worker["group_sizes"] = sorted(set(found))
    wall = [p.ended - p.started for p in run.procs if p.ended is not None]
    seconds = [w["train_seconds"] for w in workers if w["train_seconds"] is not None]
    sources = sorted({w["source"] for w in workers if w["final"] is not None})
    num_rounds = min((len(w["density"]) for w in workers), default=0)
    return {
        "strategy": run.strategy,
        "lr": run.plan.lr,
        "seed": run.plan.seed,
        "seed_index": run.plan.seed_index,
        "limited": run.plan.limited,
        "error": run.error,
        "workers": num_workers,
        "final": mean([w["final"] for w in workers]),
        "final_source": sources[0] if len(sources) == 1 else ("mixed" if sources else None),
        "reward_before": mean([w["reward_before"] for w in workers]),
        "bytes_per_worker": mean([w["bytes_sent"] for w in workers]),
        "bytes_received_per_worker": mean([w["bytes_received"] for w in workers]),
        "bytes_measured": swarm,
        "payload_bytes_per_worker": mean([w["payload_bytes"] for w in workers]),
        "wire_bytes_per_round": _per(traffic, "bytes_sent", "rounds"),
        "payload_bytes_per_round": _per(traffic, "payload_bytes", "rounds"),
        "entries_per_round": _per(traffic, "num_sent", "rounds"),
        "traffic": traffic,
        "bytes_per_entry": entry_split(traffic),
        "train_seconds": max(seconds) if seconds else None,
        "wall_seconds": max(wall) if wall and len(wall) == len(run.procs) else None,
        "steps": workers[0]["steps"] if workers else None,
        "num_params": workers[0]["num_params"] if workers else None,
        "rounds": workers[0]["rounds"] if workers else 0,
        "incomplete_rounds": sum(w["incomplete_rounds"] for w in workers),
        "group_sizes": sorted({g for w in workers for g in w["group_sizes"]}),
        "density": [mean([w["density"][r] for w in workers]) for r in range(num_rounds)],
        "pulsesync": next((w["pulsesync"] for w in workers if "pulsesync" in w), None),
        "curve": workers[0]["curve"] if workers else [],
    }


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (learning rate, strategy) over the seeds of the limited (or only) network: the final metric's mean,
    standard deviation and range, whether every seed improved on the starting model, bytes, times, density per
    round, PULSESync; ratios to DiLoCo and DDP at the same learning rate; whether the mean lies in DiLoCo's range.

    Bytes: wire (``bytes_per_worker``, ``vs_diloco``, ``vs_ddp``) and payload (``payload_bytes_per_worker``,
    ``payload_vs_diloco``, ``payload_vs_ddp``) per worker over the run, their means per worker and round
    (``wire_bytes_per_round``, ``payload_bytes_per_round``; ddp's over ``steps_per_round`` optimizer steps, the
    swarm strategies' round at that learning rate), the selected entries per worker and round, and the mean over
    seeds of every value of the runs' ``bytes_per_entry``. Results written before these fields existed give
    ``None`` there."""
    groups: dict[tuple[float | None, str], list[dict[str, Any]]] = {}
    for r in results:
        if r["limited"] and not r["error"]:
            groups.setdefault((r["lr"], r["strategy"]), []).append(r)
    rows = []
    for (lr, strategy), runs in groups.items():
        finals = [r["final"] for r in runs if r["final"] is not None]
        befores = [r["reward_before"] for r in runs if r.get("reward_before") is not None]
        rounds = min(len(r["density"]) for r in runs)
        syncs = [r["pulsesync"] for r in runs if r["pulsesync"] and r["pulsesync"]["mean_patch_bytes"]]
        rows.append(
            {
                "lr": lr,
                "strategy": strategy,
                "seeds": len(runs),
                "final_mean": mean(finals),
                "final_std": statistics.stdev(finals) if len(finals) > 1 else None,
                "final_min": min(finals, default=None),
                "final_max": max(finals, default=None),
                "reward_before": mean(befores),
                "improved": bool(finals)
                and len(befores) == len(finals)
                and all(f > b for f, b in zip(finals, befores))
                and statistics.fmean(finals) - statistics.fmean(befores) >= MIN_GAIN,
                "bytes_per_worker": mean([r["bytes_per_worker"] for r in runs]),
                "bytes_measured": runs[0]["bytes_measured"],
                "payload_bytes_per_worker": mean([r.get("payload_bytes_per_worker") for r in runs]),
                "wire_bytes_per_round": mean([r.get("wire_bytes_per_round") for r in runs]),
                "payload_bytes_per_round": mean([r.get("payload_bytes_per_round") for r in runs]),
                "steps": mean([r.get("steps") for r in runs]),
                "steps_per_round": mean([_per(r, "steps", "rounds") for r in runs]),
                "entries_per_round": mean([r.get("entries_per_round") for r in runs]),
                "bytes_per_entry": _mean_dicts([r.get("bytes_per_entry") for r in runs]),
                "train_seconds": mean([r["train_seconds"] for r in runs]),
                "wall_seconds": mean([r["wall_seconds"] for r in runs]),
                "density": [mean([r["density"][i] for r in runs]) for i in range(rounds)],
                "patch_bytes": mean([s["mean_patch_bytes"] for s in syncs]),
                "bf16_copy_bytes": syncs[0]["bf16_copy_bytes"] if syncs else None,
                "incomplete_rounds": sum(r["incomplete_rounds"] for r in runs),
            }
        )
    for row in rows:  # ddp has no rounds: its bytes over as many optimizer steps as the swarm's round
        swarm_round = mean([r["steps_per_round"] for r in rows if r["lr"] == row["lr"] and r["strategy"] != "ddp"])
        if row["strategy"] == "ddp" and swarm_round and row["steps"]:
            row["steps_per_round"] = swarm_round
            for key in ("wire_bytes_per_round", "payload_bytes_per_round"):
                total = row["bytes_per_worker" if key.startswith("wire") else "payload_bytes_per_worker"]
                row[key] = total * swarm_round / row["steps"] if total is not None else None
    for row in rows:
        same_lr = {r["strategy"]: r for r in rows if r["lr"] == row["lr"]}
        for base in ("diloco", "ddp"):
            b = same_lr.get(base, {}).get("bytes_per_worker")
            row[f"vs_{base}"] = row["bytes_per_worker"] / b if row["bytes_per_worker"] is not None and b else None
            p = same_lr.get(base, {}).get("payload_bytes_per_worker")
            own = row["payload_bytes_per_worker"]
            row[f"payload_vs_{base}"] = own / p if own is not None and p else None
        diloco = same_lr.get("diloco")
        row["within_diloco_range"] = (
            diloco["final_min"] <= row["final_mean"] <= diloco["final_max"]
            if diloco and diloco["seeds"] > 1 and row["final_mean"] is not None and diloco["final_min"] is not None
            else None
        )
        row["patch_vs_bf16"] = row["patch_bytes"] / row["bf16_copy_bytes"] if row["patch_bytes"] else None
    return rows


def _mean_dicts(dicts: list[dict[str, float | None] | None]) -> dict[str, float | None] | None:
    """Key by key :func:`_mean` of the dicts given (``None`` entries skipped); ``None`` when there are none."""
    present = [d for d in dicts if d]
    return {key: mean([d.get(key) for d in present]) for key in present[0]} if present else None


def fraction(value: float | None) -> str:
    """``0.0588`` as ``1/17``; ``-`` for none."""
    if value is None:
        return "-"
    return f"1/{1 / value:.3g}" if 0 < value < 1 else f"{value:.3g}x"


def reward_cell(row: dict[str, Any]) -> str:
    if row["final_mean"] is None:
        return "-"
    text = f"{row['final_mean']:.3f}"
    if row["final_std"] is not None:
        text += f" ± {row['final_std']:.3f} [{row['final_min']:.3f}, {row['final_max']:.3f}]"
    return text


def machine_note() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ""
    with contextlib.suppress(OSError):
        load = f", load average {os.getloadavg()[0]:.1f} at the end"
    return f"{platform.node()}: {os.cpu_count()} CPU cores ({cpu}), Python {platform.python_version()}{load}"


def git_revision() -> str:
    try:
        proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() or "unknown"


def lr_label(lr: float | None) -> str:
    return "the config's learning rate" if lr is None else f"lr {lr:g}"


def verdict(value: float | None, target: float) -> str:
    if value is None:
        return "not measured"
    return f"{fraction(value)} ({'met' if value <= target else f'missed by {value / target:.2g}x'})"


def quality_verdict(row: dict[str, Any], diloco: dict[str, Any] | None) -> str:
    if diloco is None:
        return "no diloco run to compare with"
    if not diloco["improved"] or not row["improved"]:
        who = [name for name, r in (("diloco", diloco), (row["strategy"], row)) if not r["improved"]]
        return (
            f"not judged: {' and '.join(who)} did not learn (every seed above the warm model, mean gain >= "
            f"{MIN_GAIN:g})"
        )
    if row["within_diloco_range"] is None:
        return "not judged: DiLoCo needs at least 2 seeds for a range"
    where = "within" if row["within_diloco_range"] else "outside"
    return (
        f"mean {row['final_mean']:.3f} {where} DiLoCo's range [{diloco['final_min']:.3f}, {diloco['final_max']:.3f}] "
        f"over {diloco['seeds']} seeds"
    )


def byte_tables(at: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of the two byte tables of one learning rate's rows: wire and payload bytes per worker
    and round with their ratios to DiLoCo and DDP (every strategy), then the wire bytes per selected entry split
    into indices, values, shard sums and headers, with the index bits per entry against the entropy bound (the
    sparse strategies: swarm rows other than diloco). Rows without the fields (an older compare.json): ``-``."""
    lines = [
        "| strategy | wire B / worker / round | wire vs DiLoCo | wire vs DDP | payload B / worker / round | "
        "payload vs DiLoCo | payload vs DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in at:
        est = "" if r["bytes_measured"] else " (est.)"
        wire, payload = r.get("wire_bytes_per_round"), r.get("payload_bytes_per_round")
        cells = [
            r["strategy"],
            "-" if wire is None else human(wire) + est,
            fraction(r["vs_diloco"]),
            fraction(r["vs_ddp"]),
            "-" if payload is None else human(payload) + est,
            fraction(r.get("payload_vs_diloco")),
            fraction(r.get("payload_vs_ddp")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    sparse = [r for r in at if r["strategy"] not in ("ddp", "diloco") and r.get("bytes_per_entry")]
    if not sparse:
        return lines
    lines += [
        "| strategy | entries / worker / round | wire B/entry | = indices | + values | + sums (index + value) | "
        "+ headers | payload B/entry | index bits/entry: pushed / payload / bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sparse:
        e = r["bytes_per_entry"]
        bits = " / ".join(fmt(e[k], ".2f") for k in ("index_bits_pushed", "index_bits_payload", "index_bits_bound"))
        cells = [r["strategy"], fmt(r.get("entries_per_round"), ",.0f")]
        cells += [fmt(e[k], ".2f") for k in ("wire_bytes", "index_bytes", "value_bytes", "sum_bytes")]
        cells += [fmt(e["header_bytes"], ".3f"), fmt(e["payload_bytes"], ".2f"), bits]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def write_markdown(path: Path, rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    metric = meta["metric_label"]
    lrs = list(dict.fromkeys(r["lr"] for r in rows))
    lines = [f"# {meta['recipe']}: {', '.join(meta['strategies'])}", ""]
    lines += [f"Command: `{meta['command']}` ({meta['seconds'] / 60:.0f} min)", ""]
    lines += [f"{meta['date']}, commit {meta['commit']}, {meta['machine']}.", ""]
    for lr in lrs:
        at = [r for r in rows if r["lr"] == lr]
        diloco = next((r for r in at if r["strategy"] == "diloco"), None)
        before = next((r["reward_before"] for r in at if r["reward_before"] is not None), None)
        seeds = sorted({r["seeds"] for r in at})
        head = f"## {lr_label(lr)}, {'/'.join(map(str, seeds))} seed{'s' if seeds != [1] else ''}"
        lines += [head + (f", {metric} before training {before:.3f}" if before is not None else ""), ""]
        lines += [
            f"| strategy | final {metric}: mean ± sd [min, max] | learned | bytes sent per worker | "
            "vs DiLoCo | vs DDP | density: round 1 → last | PULSESync patch / BF16 copy | train s | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in at:
            b = r["bytes_per_worker"]
            density = r["density"]
            cells = [
                r["strategy"],
                reward_cell(r),
                ("yes" if r["improved"] else "no") if r["reward_before"] is not None else "-",
                "-" if b is None else f"{human(b)}{'' if r['bytes_measured'] else ' (est.)'}",
                fraction(r["vs_diloco"]),
                fraction(r["vs_ddp"]),
                f"{density[0]:.2%} → {density[-1]:.2%}" if density else "-",
                fraction(r["patch_vs_bf16"]),
                "-" if r["train_seconds"] is None else f"{r['train_seconds']:.0f}",
                "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += byte_tables(at)
        for r in at:
            if r["strategy"].startswith("pulseloco"):
                lines.append(
                    f"- {r['strategy']} targets: bytes vs DiLoCo {verdict(r['vs_diloco'], TARGETS['diloco'])}, "
                    f"vs DDP {verdict(r['vs_ddp'], TARGETS['ddp'])}; payload vs DiLoCo "
                    f"{verdict(r.get('payload_vs_diloco'), TARGETS['diloco'])}, vs DDP "
                    f"{verdict(r.get('payload_vs_ddp'), TARGETS['ddp'])}; PULSESync patch vs BF16 copy "
                    f"{verdict(r['patch_vs_bf16'], TARGETS['pulsesync'])}; quality: {quality_verdict(r, diloco)}."
                )
        lines.append("")
    failed = [r for r in results if r["error"]]
    if failed:
        lines += ["## Failed runs", ""]
        lines += [
            f"- {r['strategy']} {lr_label(r['lr'])} seed {r['seed']}: {r['error'].splitlines()[0]}" for r in failed
        ]
        lines.append("")
    reference = [r for r in results if not r["limited"] and not r["error"]]
    if reference:
        lines += [f"## Training time at {meta['bandwidth']} against loopback", ""]
        lines += ["| strategy | train s, loopback | train s, limited | slowdown |", "|---|---|---|---|"]
        for ref in reference:
            limited = next(
                (r for r in results if r["limited"] and not r["error"] and (r["strategy"], r["lr"], r["seed"])
                 == (ref["strategy"], ref["lr"], ref["seed"])), None,
            )  # fmt: skip
            slow = limited["train_seconds"] if limited else None
            fast = ref["train_seconds"]
            cells = [ref["strategy"], f"{fast:.0f}" if fast else "-", f"{slow:.0f}" if slow else "-"]
            cells.append(f"{slow / fast:.2f}x" if slow and fast else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    params = next((r["num_params"] for r in results if r.get("num_params")), None)
    lines += [
        "## How these numbers were made",
        "",
        f"- {meta['workers']} workers per strategy, {meta['steps'] or 'the config’s'} optimizer steps each, the same "
        f"batch size per worker; ddp is {meta['ddp_launch']}; the swarm strategies are peers of one process each "
        "(`accelerate launch`) through a bootstrap DHT, every round averaged by all of them.",
        "- bytes sent per worker: the swarm strategies' wire bytes measured by PulseLoCo (`bytes_sent` summed over "
        "the rounds in each peer's `pulseloco_rounds.jsonl`, mean over the peers and seeds); ddp's (est.) are not "
        f"measured: a ring all-reduce of FP32 gradients every optimizer step, 2(W-1)/W x 4 bytes x "
        f"{f'{params:,}' if params else 'N'} parameters x steps per worker, W = {meta['workers']}.",
        f"- final {metric}: {meta['metric_note']}; mean over the workers (swarm peers end on the consensus model), "
        "then mean, sample standard deviation and range over the seeds. 'learned': every seed's final reward above "
        f"the warm model's and the mean gain at least {MIN_GAIN:g}; where a strategy did not, it is not judged on "
        "quality at that learning rate. "
        "Quality matches DiLoCo when the mean lies within DiLoCo's range over its seeds.",
        "- wire vs payload (second table): wire bytes are what a worker sent, as above (a swarm peer's pushed "
        "parts plus the sums of its shard it served to the others, with headers); payload bytes are its own "
        "compressed pseudo-gradient as ONE frame of the same codec and value precision (`payload_bytes` in "
        "`pulseloco_rounds.jsonl`): what an all-gather through an object store, as in the paper, would upload. "
        "DiLoCo's payload is its dense FP32 frame, measured the same way; ddp's (est.) is its FP32 gradient, 4 "
        "bytes x parameters, once per optimizer step. Per worker and round: over every peer's rounds of a run, "
        "then mean over seeds; ddp has no rounds, so its bytes are over as many optimizer steps as one round of the "
        "swarm strategies at that learning rate (inner_steps). The ratios are of the totals per worker over the "
        "run (the same steps for every strategy).",
        "- bytes per selected entry (third table, sparse strategies): each total over every peer's rounds of a "
        "run divided by the entries the peers selected (`num_sent`), then mean over seeds; indices + values + "
        "sums + headers = wire (up to the cells' rounding). Indices and values: the sections of the parts pushed "
        "to the other shard owners; sums: the index and value sections of the shard sums a peer served (the "
        "union of the group's indices in its shard, with FP32 sums), once per member served; headers: everything "
        "else (stream and frame headers, checksums, protobuf framing, fetch requests, replies). Index bits per "
        "entry: of the pushed parts per entry pushed, and of the payload per entry selected, against the bound "
        "log2 C(N, k) / k of k uniformly random positions of N (`pulseloco.loco.metrics.traffic_summary`, "
        "`index_entropy_bits`).",
        "- density: the fraction of the parameters a peer sent in a round (mean over peers and seeds); DiLoCo "
        "sends all of them, top-k its fixed share.",
        "- PULSESync: peer 0 of each swarm run published every consensus version (`--publish`); the mean size of "
        "a version's patch file plus its signed envelope in the version store, against a full BF16 copy "
        "(2 bytes x parameters). The store also holds a full anchor every `anchor_every` versions (not counted).",
        "- train time: the Trainer's `train_runtime` of the slowest worker (swarm peers: with the outer rounds); "
        "wall time: from launch to exit, with imports, DHT start, evaluation and saving; mean over the seeds.",
        f"- network: {meta['network']}; "
        + (
            "the runs of one learning rate and seed ran concurrently (times are not comparable)."
            if meta["parallel"]
            else "runs ran one at a time."
        ),
        f"- recipe `{meta['recipe_path']}`, config `{meta['config']}`, seeds {meta['seed_note']}, "
        + (f"model `{meta['model']}`, " if meta.get("model") else "")
        + f"extra arguments: `{' '.join(meta['extra']) or 'none'}`.",
        "- plots: `compare_reward_bytes.png` and `compare_reward_time.png` (the "
        f"{meta['curve_label']} logged every few steps by the first worker, mean over seeds, running mean over "
        f"{SMOOTH} points, against bytes sent by then and training time), `compare_final.png` (final metric, mean "
        "and range, against bytes sent), `compare_density.png` (density per round). Every run is in `compare.json`.",
    ]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


SMOOTH = 4
"""The curve plots show a running mean over this many logged points (the sampled reward of 16 completions is
noisy)."""


def _smooth(values: list[float], window: int) -> list[float]:
    """Running mean over the last ``window`` values (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def _mean_curve(curves: list[list[tuple[float, float, float]]]) -> list[tuple[float, float, float]]:
    """The pointwise mean of curves logged at the same steps (cut to the shortest)."""
    length = min((len(c) for c in curves), default=0)
    return [tuple(statistics.fmean(c[i][k] for c in curves) for k in range(3)) for i in range(length)]  # type: ignore[misc]


def plot(out_dir: Path, rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Write the four plots (one panel per learning rate) and return their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = list(dict.fromkeys(r["lr"] for r in rows)) or [None]
    styles = {"ddp": "-", "diloco": "--", "pulseloco": "-", "pulseloco-bf16": "-.", "sparseloco": ":"}
    colors = dict(zip(STRATEGIES, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))  # every plot
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    names = ["compare_reward_bytes.png", "compare_reward_time.png", "compare_final.png", "compare_density.png"]

    def panels() -> tuple[Any, list[Any]]:
        fig, axes = plt.subplots(1, len(lrs), figsize=(5.0 * len(lrs), 4.0), squeeze=False)
        for ax, lr in zip(axes[0], lrs):
            ax.set_title(lr_label(lr))
            ax.grid(True, alpha=0.3)
        return fig, list(axes[0])

    def save(fig: Any, axes: list[Any], name: str) -> None:
        handles, labels = axes[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)

    for name, x_index, x_label in ((names[0], 0, "bytes sent per worker"), (names[1], 1, "training time (s)")):
        fig, axes = panels()
        for ax, lr in zip(axes, lrs):
            for strategy in strategies:
                curves = [r["curve"] for r in results if r["lr"] == lr and r["strategy"] == strategy
                          and r["limited"] and not r["error"] and r["curve"]]  # fmt: skip
                curve = _mean_curve(curves)
                if curve:
                    xs, ys = [p[x_index] for p in curve], _smooth([p[2] for p in curve], SMOOTH)
                    ax.plot(xs, ys, styles[strategy], color=colors[strategy], marker="o", markersize=2, label=strategy)
            if x_index == 0:
                ax.set_xscale("symlog", linthresh=1e4)
            ax.set_xlabel(x_label)
            ax.set_ylabel(meta["curve_label"])
        save(fig, axes, name)

    fig, axes = panels()
    for ax, lr in zip(axes, lrs):
        for r in (r for r in rows if r["lr"] == lr and r["final_mean"] is not None and r["bytes_per_worker"]):
            low = r["final_mean"] - (r["final_min"] if r["final_min"] is not None else r["final_mean"])
            high = (r["final_max"] if r["final_max"] is not None else r["final_mean"]) - r["final_mean"]
            ax.errorbar([r["bytes_per_worker"]], [r["final_mean"]], yerr=[[low], [high]], fmt="o", capsize=3,
                        color=colors[r["strategy"]], label=r["strategy"])  # fmt: skip
        before = next((r["reward_before"] for r in rows if r["lr"] == lr and r["reward_before"] is not None), None)
        if before is not None:
            ax.axhline(before, color="grey", linewidth=0.8, linestyle=":", label="before training")
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker")
        ax.set_ylabel(f"final {meta['metric_label']}")
    save(fig, axes, names[2])

    fig, axes = panels()
    for ax, lr in zip(axes, lrs):
        for r in (r for r in rows if r["lr"] == lr and r["density"]):
            rounds = range(1, len(r["density"]) + 1)
            ax.plot(
                rounds,
                r["density"],
                styles[r["strategy"]],
                color=colors[r["strategy"]],
                marker="o",
                markersize=2,
                label=r["strategy"],
            )
        ax.set_yscale("log")
        ax.set_xlabel("outer round")
        ax.set_ylabel("fraction of parameters sent")
    save(fig, axes, names[3])
    return names


# ---- main --------------------------------------------------------------------------------------------------------


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


def make_plans(strategies: list[str], lrs: list[float | None], seeds: list[int], base_seed: int,
               reference: bool) -> list[Plan]:  # fmt: skip
    """Every run, learning rate by learning rate, seed by seed; with ``reference`` the loopback runs of the first
    learning rate and seed first."""
    plans = [Plan(s, lrs[0], 0, base_seed, limited=False) for s in strategies] if reference else []
    for lr, count in zip(lrs, seeds):
        for j in range(count):
            plans += [Plan(s, lr, j, base_seed + SEED_STRIDE * j) for s in strategies]
    return plans


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join([".venv/bin/python", "scripts/compare.py", *argv])
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--recipe", choices=("grpo", "pretrain"), default="grpo", help="recipes/<recipe>.py (default grpo)")
    ap.add_argument(
        "--config", type=Path, default=None, help="recipe config (default configs/grpo-demo.yaml or pretrain-tiny.yaml)"
    )
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {', '.join(STRATEGIES)}")
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
    ap.add_argument("--quick", action="store_true", help=f"a few minutes: --lrs {QUICK['lrs']} --seeds "
                    f"{QUICK['seeds']} --steps {QUICK['steps']} (unless given)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="--seed of seed 0 (seed j: + 1000 j; swarm peer i: + i)")
    ap.add_argument(
        "--model_name_or_path", "--model-name-or-path", default=None,
        help="the model every run starts from (grpo default: scripts/warm_model.py --size WARM_SIZE)",
    )  # fmt: skip
    ap.add_argument("--warm-size", default="demo", help="scripts/warm_model.py --size for grpo (default demo)")
    ap.add_argument("--no-publish", action="store_true", help="no PULSESync publishing by the swarm's peer 0")
    ap.add_argument("--bandwidth", default=None, help="limit each worker's link, e.g. 100mbit (needs root)")
    ap.add_argument("--parallel", action="store_true", help="the strategies of a run at once (times not comparable)")
    ap.add_argument("--out", type=Path, default=REPO / "results", help="where compare.md, .json and the plots go")
    ap.add_argument("--runs-dir", type=Path, default=None, help="logs and outputs (default: a temporary directory)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the temporary runs directory")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take (default 1800)")
    ap.add_argument("--json", type=Path, default=None, help="the results as JSON (default OUT/compare.json)")
    ap.add_argument("--report", type=Path, default=None, help="no runs: the table and plots again from a compare.json")
    args = ap.parse_args(argv)
    json_path = args.json or args.out / "compare.json"
    if args.report is not None:
        return report_again(args.report.resolve(), args.out, json_path)
    problem = environment_problem()
    if problem is not None:  # before anything is created or started: one line, no traceback
        print(f"compare.py: error: {problem}; {SETUP_HINT}", file=sys.stderr, flush=True)
        return 2
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown or not strategies:
        ap.error(f"--strategies: unknown {', '.join(unknown) or '(none given)'} (choose from {', '.join(STRATEGIES)})")
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if args.workers < 2 and "ddp" in strategies:
        log("warning: ddp with one worker sends nothing")
    defaults: dict[str, Any] = (
        (QUICK if args.quick else GRPO_DEFAULTS) if args.recipe == "grpo" else {"lrs": None, "seeds": "1"}
    )
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

    temp_runs = args.runs_dir is None
    runs_dir = Path(tempfile.mkdtemp(prefix="pulseloco-compare-")) if temp_runs else args.runs_dir.resolve()
    if not temp_runs:  # the recipes refuse a used output_dir: a rerun starts clean
        for old in [*runs_dir.glob("lr*-seed*"), *runs_dir.glob("config-lr-seed*"), runs_dir / "keys"]:
            shutil.rmtree(old, ignore_errors=True)
    runs_dir.mkdir(parents=True, exist_ok=True)

    network = "loopback (127.0.0.1), no bandwidth limit"
    netns: NetNS | None = None
    if args.bandwidth:
        reason = NetNS.unavailable_reason()
        if reason is None:
            netns = NetNS(args.workers + 1, args.bandwidth, prefix="plcmp")
            try:
                netns.setup()
                network = (
                    f"each worker (and the bootstrap node) in its own network namespace behind a veth limited to "
                    f"{rate_label(args.bandwidth)} each way (tc tbf)"
                )
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                netns.teardown()
                netns, reason = None, f"namespace setup failed: {exc}"
        if reason is not None:
            network = f"loopback (127.0.0.1); --bandwidth {args.bandwidth} skipped: {reason}"
            log(f"--bandwidth {args.bandwidth}: skipped ({reason})")
    plans = make_plans(strategies, lrs, seeds, args.seed, reference=netns is not None)
    swarm_runs = [p for p in plans if p.strategy != "ddp"]

    runner = Runner(runs_dir, netns)
    stop: dict[str, int | None] = {"signal": None}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum
        raise KeyboardInterrupt

    def remove_temp_runs() -> None:
        if temp_runs and not args.keep_runs:
            shutil.rmtree(runs_dir, ignore_errors=True)
        elif temp_runs:
            log(f"runs kept in {runs_dir}")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    runs: list[StrategyRun] = []
    started_at = time.monotonic()
    try:
        if args.recipe == "grpo" and args.model_name_or_path is None:
            log(f"warm model: scripts/warm_model.py --size {args.warm_size} (built once, minutes; then reused)")
            args.model_name_or_path = str(build_warm_model(runner, args.warm_size, WARM_MODEL_TIMEOUT))
            log(f"warm model: {args.model_name_or_path}")
        key = make_signing_key(runner) if swarm_runs and not args.no_publish else None
        bootstraps: dict[bool, str] = {}  # limited -> multiaddr
        for limited in sorted({p.limited for p in swarm_runs}):
            in_ns = limited and netns is not None
            host = netns.host(0) if in_ns and netns is not None else "127.0.0.1"
            dht = runner.start(f"bootstrap{'' if limited else '-loopback'}",
                               ["pulseloco", "dht", "--host-maddrs", f"/ip4/{host}/tcp/0"],
                               ns_index=0 if in_ns else None)  # fmt: skip
            bootstraps[limited] = wait_for_maddr(dht, STARTUP_TIMEOUT)
            log(f"bootstrap node: {bootstraps[limited]}")
        batches = (
            [list(g) for _, g in itertools.groupby(plans, key=lambda p: p.tag)]
            if args.parallel
            else [[p] for p in plans]
        )
        for n, batch in enumerate(batches, 1):
            started = [start_run(runner, args, p, bootstraps.get(p.limited), extra, key) for p in batch]
            names = ", ".join(p.strategy for p in batch)
            log(f"[{n}/{len(batches)}] {batch[0].tag}: {names} ({args.workers} workers each); logs in {runs_dir}")
            for run in started:
                try:
                    wait_all(run.procs, args.timeout)
                    log(f"{run.strategy}: done in {max(p.ended or 0 for p in run.procs) - run.procs[0].started:.1f} s")
                except RuntimeError as exc:
                    run.error = str(exc)
                    log(f"{run.strategy}: FAILED: {exc}")
                finally:
                    for proc in run.procs:
                        proc.stop()
            runs += started
    except KeyboardInterrupt:
        log("interrupted; stopping everything")
        runner.stop_all()
        remove_temp_runs()
        return 130 if stop["signal"] in (None, signal.SIGINT) else 143
    except RuntimeError as exc:  # the warm model, the key or a bootstrap node failed: nothing to compare
        log(f"error: {exc}")
        runner.stop_all()
        remove_temp_runs()
        return 1
    finally:
        runner.stop_all()
        if netns is not None:
            netns.teardown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    results = [summarize(run, args.recipe, args.workers) for run in runs]
    sources = sorted({r["final_source"] for r in results if r["final_source"] in ("eval", "train")})
    if args.recipe == "grpo":
        metric_label, curve_label = "greedy reward", "sampled reward"
        metric_note = "greedy exact-match reward on the fixed evaluation prompts (`reward_after` in grpo_eval.json)"
    elif sources == ["train"]:
        metric_label, curve_label = "training loss", "training loss"
        metric_note = "pretrain.py logged no eval loss (no held-out blocks?), so the last logged training loss"
    else:
        metric_label, curve_label = ("eval loss" if sources != ["eval", "train"] else "loss"), "training loss"
        metric_note = "held-out loss of the final model (pretrain.py's evaluation after training)"
        if sources == ["eval", "train"]:
            metric_note += "; (training): that run logged no eval loss, the last logged training loss instead"
    ddp_launch = (
        f"{args.workers} `accelerate launch --num_machines {args.workers}` of one process, one per namespace"
        if netns is not None
        else f"one `accelerate launch --config_file recipes/accelerate_configs/multi_process_cpu.yaml "
        f"--num_processes {args.workers}`"
    )
    meta = {
        "command": command,
        "recipe": args.recipe,
        "recipe_path": f"recipes/{args.recipe}.py",
        "config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(REPO) else str(args.config),
        "model": args.model_name_or_path,
        "strategies": strategies,
        "lrs": lrs,
        "seeds": seeds,
        "seed_note": (
            f"{args.seed} + {SEED_STRIDE} j for seed j, "
            + ("swarm peer i: --data_seed + i" if args.recipe == "pretrain" else "swarm peer i: + i")
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
        "metric_label": metric_label,
        "metric_sources": sources,
        "curve_label": curve_label,
        "metric_note": metric_note,
        "targets": TARGETS,
        "seconds": round(time.monotonic() - started_at, 1),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "commit": git_revision(),
        "machine": machine_note(),
    }
    write_outputs(args.out, json_path, results, meta)
    log(f"done in {meta['seconds'] / 60:.1f} min: {args.out / 'compare.md'}, {json_path}, plots in {args.out}")
    remove_temp_runs()
    return 1 if any(r["error"] for r in results) else 0


def write_outputs(out: Path, json_path: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Aggregate ``results`` and write compare.md (also printed), the plots and the JSON."""
    rows = aggregate(results)
    out.mkdir(parents=True, exist_ok=True)
    meta["plots"] = plot(out, rows, results, meta)
    print(write_markdown(out / "compare.md", rows, results, meta))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows, "results": results}, indent=1) + "\n")


def report_again(source: Path, out: Path, json_path: Path) -> int:
    """``--report``: the table, plots and JSON again from an earlier compare.json (this version's aggregation and
    verdicts; the runs' numbers, command, date and machine as recorded). Exit code 2 on an unreadable file."""
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
        results, meta = data["results"], data["meta"]
        rows = aggregate(results)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"compare.py: error: --report {source}: not a compare.json this script wrote ({exc})", file=sys.stderr)
        return 2
    meta["reported_by"] = git_revision()
    write_outputs(out, json_path, results, meta)
    log(f"{out / 'compare.md'} and the plots from {source} ({len(results)} runs, {len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
