#!/usr/bin/env python
"""Compare ddp, diloco, pulseloco and sparseloco on one recipe: loss (or reward), bytes sent, wall time.

    .venv/bin/python scripts/compare.py                          # recipes/pretrain.py, configs/pretrain-tiny.yaml
    .venv/bin/python scripts/compare.py --recipe grpo --steps 32 # recipes/grpo.py, configs/grpo-tiny.yaml (reward)
    .venv/bin/python scripts/compare.py --bandwidth 100mbit      # each worker behind a 100 Mbit/s link (root)
    .venv/bin/python scripts/compare.py --steps 16 -- --learning_rate 1e-3   # after --: to every recipe run

Run it with the project's Python (``.venv/bin/python``, made by ``scripts/demo.sh`` or ``scripts/test.sh``): it
starts ``accelerate`` and ``pulseloco`` from beside ``sys.executable``, and says so in one line if they are not there.

Every strategy runs the same recipe and config (``trl.TrlParser`` flags: ``--max_steps``, ``--seed`` ...) with the
same steps and batch size per worker and the same number of workers (``--workers``, default 2), so each sees the
same number of samples:

* ``ddp``: one ``accelerate launch --config_file recipes/accelerate_configs/multi_process_cpu.yaml
  --num_processes W`` (the Trainer's own data parallelism, gradients all-reduced every step). Nothing measures its
  traffic: its bytes per worker are a ring all-reduce of FP32 gradients every optimizer step,
  ``2 (W - 1) / W * 4 * num_params * steps``, with the parameters counted in the saved model;
* ``diloco``, ``pulseloco``, ``sparseloco``: W peers of one process each (``accelerate launch -q --config_file
  recipes/accelerate_configs/single_process.yaml``), joined through a bootstrap node (``pulseloco dht``) on
  127.0.0.1, every round formed by all W peers (``--target_group_size W``); their bytes are the wire bytes PulseLoCo
  measured (``bytes_sent`` in each peer's ``pulseloco_rounds.jsonl``). Peer i gets its own batches: pretrain
  ``--data_seed SEED+i`` (the same initial weights), grpo ``--seed SEED+i`` (other prompts and samples).

``--recipe grpo`` needs a warm model: ``--model_name_or_path DIR``, else ``scripts/warm_model.py --size tiny``
(``--warm-size``) builds one (once, minutes; cached) or reuses it. The quality metric is the final held-out eval
loss of pretrain (the last logged training loss where pretrain.py logged no eval loss; the table says which) and
the greedy reward after training of grpo (``reward_after`` in ``grpo_eval.json``).

Strategies run one after the other (``--parallel``: all at once, faster, but then wall times are not comparable).
With ``--bandwidth RATE`` (as root with ``ip netns`` and ``tc``) the bootstrap node and every worker run in
network namespaces of their own behind a veth limited to RATE each way (scripts/netns.py, as scripts/bench_sync.py
does), ddp then as W single-process launches of a W-machine job; without root it says why it skipped the limit.

Writes ``OUT/compare.md`` (a table: final loss or reward, bytes sent per worker, ratios to DDP and DiLoCo, train
and wall time; the config, date and machine), ``OUT/compare_bytes.png`` (the logged training loss or reward
against bytes sent) and ``OUT/compare_time.png`` (against training time), and with ``--json PATH`` the numbers.
The runs' logs and output directories go to ``--runs-dir`` (default: a temporary directory, removed unless
``--keep-runs``). Every process has a timeout and is stopped (its process group) when the script ends, also on
errors and Ctrl-C. Use ``--logging_steps`` (after ``--``) small enough for the plots to have points.
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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: also under `python -I` and when imported
from netns import NetNS, rate_label  # scripts/netns.py

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
CONFIGS = RECIPES / "configs"
DEFAULT_CONFIGS = {"pretrain": CONFIGS / "pretrain-tiny.yaml", "grpo": CONFIGS / "grpo-tiny.yaml"}
ACCELERATE_CONFIGS = RECIPES / "accelerate_configs"
SINGLE_PROCESS = ["--config_file", str(ACCELERATE_CONFIGS / "single_process.yaml")]
MULTI_PROCESS = ["--config_file", str(ACCELERATE_CONFIGS / "multi_process_cpu.yaml")]
STRATEGIES = ("ddp", "diloco", "pulseloco", "sparseloco")
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
REQUIRED_COMMANDS = ("accelerate", "pulseloco")
"""Executables started from beside ``sys.executable``."""
SETUP_HINT = "run scripts/demo.sh or scripts/test.sh once to create .venv, then use .venv/bin/python scripts/compare.py"


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def environment_problem(python: str | None = None) -> str | None:
    """Why this Python cannot run the comparison (``None``: it can): modules of the project's dependencies that it
    cannot import, or the ``accelerate`` / ``pulseloco`` commands missing beside it. Nothing is imported."""
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


# ---- one strategy ------------------------------------------------------------------------------------------------


@dataclass
class StrategyRun:
    strategy: str
    workers: list[Path] = field(default_factory=list)
    """Output directories that receive trainer_state.json (ddp: one, written by its main process; else one per
    peer)."""
    procs: list[Proc] = field(default_factory=list)
    error: str | None = None


def recipe_argv(
    args: argparse.Namespace, strategy: str, output_dir: Path, extra: list[str], peer: int | None = None
) -> list[str]:
    """The recipe and its flags; ``peer``: the index of a swarm peer, which gets batches of its own."""
    argv = [str(RECIPES / f"{args.recipe}.py"), "--config", str(args.config), "--strategy", strategy]
    argv += ["--output_dir", str(output_dir), "--seed", str(args.seed)]
    if peer is not None and args.recipe == "pretrain":
        argv += ["--data_seed", str(args.seed + peer)]  # same initial weights (--seed), other batches
    elif peer is not None:
        argv[-1] = str(args.seed + peer)  # grpo: the seed draws the prompts, their order and the samples
    if args.steps is not None:
        argv += ["--max_steps", str(args.steps)]
    if args.model_name_or_path is not None:
        argv += ["--model_name_or_path", str(args.model_name_or_path)]
    return argv + extra


def start_strategy(
    runner: Runner, args: argparse.Namespace, strategy: str, bootstrap: str | None, extra: list[str]
) -> StrategyRun:
    accelerate = [str(Path(sys.executable).parent / "accelerate"), "launch"]
    run = StrategyRun(strategy)
    out = runner.runs_dir / strategy
    w, netns = args.workers, runner.netns
    if strategy == "ddp" and netns is None:
        # one launch of W processes (gloo on a CPU machine); one process: -q keeps accelerate's own traceback out
        launch = [*MULTI_PROCESS, "--num_processes", str(w)] if w > 1 else ["-q", *SINGLE_PROCESS]
        run.procs.append(runner.start("ddp", [*accelerate, *launch, *recipe_argv(args, "ddp", out, extra)]))
        run.workers.append(out)
    elif strategy == "ddp" and netns is not None:
        # one launch per namespace: a W-machine job of one process each, its gloo traffic on the limited links
        for i in range(w):
            argv = [*accelerate, *MULTI_PROCESS, "--num_machines", str(w), "--num_processes", str(w)]
            argv += ["--machine_rank", str(i), "--main_process_ip", netns.host(1), "--main_process_port"]
            argv += [str(DDP_PORT), *recipe_argv(args, "ddp", out, extra)]
            run.procs.append(runner.start(f"ddp{i}", argv, ns_index=1 + i, env={"GLOO_SOCKET_IFNAME": "eth0"}))
        run.workers.append(out)
    else:
        swarm = ["--run_id", f"compare-{os.getpid()}-{strategy}", "--initial_peers", str(bootstrap)]
        swarm += ["--target_group_size", str(w), "--matchmaking_time", "60", "--linger", "3"]
        swarm += ["--startup_timeout", f"{PEER_STARTUP_TIMEOUT:g}"]
        for i in range(w):
            peer_out = out / f"peer{i}"
            argv = [*accelerate, "-q", *SINGLE_PROCESS, *recipe_argv(args, strategy, peer_out, extra, peer=i)]
            argv += swarm
            if netns is not None:
                argv += ["--host_maddrs", f"/ip4/{netns.host(1 + i)}/tcp/0"]
            run.procs.append(runner.start(f"{strategy}-peer{i}", argv, ns_index=1 + i))
            run.workers.append(peer_out)
    return run


def build_warm_model(runner: Runner, size: str, timeout: float) -> Path:
    """``scripts/warm_model.py --size SIZE`` (built once and cached, else reused): the directory it prints last."""
    proc = runner.start("warm_model", [sys.executable, str(REPO / "scripts" / "warm_model.py"), "--size", size])
    wait_all([proc], timeout)
    found = re.findall(r"^warm model: (.+)$", proc.text(), flags=re.MULTILINE)
    if not found or not Path(found[-1].strip()).is_dir():
        raise RuntimeError(f"scripts/warm_model.py printed no `warm model: DIR` line; log:\n{proc.tail()}")
    return Path(found[-1].strip())


# ---- results -----------------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


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


def ddp_bytes_per_step(num_workers: int, num_params: int) -> float:
    """Bytes one worker sends per optimizer step in a ring all-reduce of FP32 gradients: 2 (W - 1) / W * 4 * N."""
    return 2 * (num_workers - 1) / num_workers * 4 * num_params


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x), held constant beyond the last one."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def summarize_worker(out: Path, recipe: str, num_workers: int, swarm: bool) -> dict[str, Any]:
    """What one worker's output directory says: final metric (and where it came from), bytes sent, train time,
    steps, rounds, and its curve of (bytes sent, training seconds, logged loss or reward) per logging step."""
    state = read_json(out / "trainer_state.json") or {}
    history = [e for e in state.get("log_history", []) if isinstance(e, dict)]
    steps = state.get("global_step")
    runtime = next((e["train_runtime"] for e in reversed(history) if "train_runtime" in e), None)
    curve_key = "loss" if recipe == "pretrain" else "reward"
    logged = [e for e in history if e.get(curve_key) is not None and "step" in e]
    final, source = None, None
    if recipe == "pretrain":
        evals = [e["eval_loss"] for e in history if e.get("eval_loss") is not None]
        if evals:
            final, source = evals[-1], "eval"
        elif logged:
            final, source = logged[-1][curve_key], "train"
    else:
        evaluation = read_json(out / "grpo_eval.json") or {}
        final, source = evaluation.get("reward_after"), "greedy"
    rounds = read_jsonl(out / "pulseloco_rounds.jsonl")
    num_params = count_parameters(out)
    result: dict[str, Any] = {
        "final": final,
        "source": source,
        "steps": steps,
        "train_seconds": runtime,
        "num_params": num_params,
        "rounds": len(rounds),
        "group_sizes": sorted({r["num_peers"] for r in rounds}),
    }
    if recipe == "grpo":
        result["reward_before"] = (read_json(out / "grpo_eval.json") or {}).get("reward_before")
    # the curve's x values at a logging step: bytes sent by then, and training seconds by then
    inner = steps // len(rounds) if swarm and rounds and steps else None  # a round every inner_steps steps
    if inner:
        result["bytes_sent"] = sum(r["bytes_sent"] for r in rounds)
        result["bytes_received"] = sum(r["bytes_received"] for r in rounds)
        ends = [inner * (r["round"] + 1) for r in rounds]  # round r ends at step (r + 1) H, after its outer step
        sent = [(end, r["bytes_sent"]) for end, r in zip(ends, rounds)]

        def sent_by(step: float) -> float:
            return float(sum(num for end, num in sent if end <= step))

        clock = [(0.0, 0.0)]
        for end, r in zip(ends, rounds):
            clock.append((float(end), clock[-1][1] + r["seconds_inner"] + r["seconds_sync"]))
    else:
        per_step = ddp_bytes_per_step(num_workers, num_params) if num_params is not None and not swarm else None
        result["bytes_sent"] = per_step * steps if per_step is not None and steps is not None else None
        result["bytes_received"] = result["bytes_sent"]

        def sent_by(step: float) -> float:
            return per_step * step if per_step is not None else 0.0

        clock = [(0.0, 0.0), (float(steps or 0), float(runtime or 0.0))]  # the Trainer logs no time per step
    result["curve"] = [(sent_by(e["step"]), _interpolate(clock, e["step"]), e[curve_key]) for e in logged]
    return result


def _mean(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def summarize(run: StrategyRun, recipe: str, num_workers: int) -> dict[str, Any]:
    """Final metric (mean over workers), bytes sent per worker, train seconds (slowest worker), wall seconds;
    the curve of the first worker."""
    swarm = run.strategy != "ddp"
    workers = [summarize_worker(out, recipe, num_workers, swarm) for out in run.workers]
    if not swarm:  # ddp: the processes it ran, from the recipe's start line ("processes=W")
        found = [int(m) for p in run.procs for m in re.findall(r"processes=(\d+)", p.text())]
        for worker in workers:
            worker["group_sizes"] = sorted(set(found))
    wall = [p.ended - p.started for p in run.procs if p.ended is not None]
    seconds = [w["train_seconds"] for w in workers if w["train_seconds"] is not None]
    sources = sorted({w["source"] for w in workers if w["final"] is not None})
    result = {
        "strategy": run.strategy,
        "error": run.error,
        "workers": num_workers,
        "final": _mean([w["final"] for w in workers]),
        "final_source": sources[0] if len(sources) == 1 else ("mixed" if sources else None),
        "bytes_per_worker": _mean([w["bytes_sent"] for w in workers]),
        "bytes_received_per_worker": _mean([w["bytes_received"] for w in workers]),
        "bytes_measured": swarm,
        "train_seconds": max(seconds) if seconds else None,
        "wall_seconds": max(wall) if wall and len(wall) == len(run.procs) else None,
        "steps": workers[0]["steps"] if workers else None,
        "num_params": workers[0]["num_params"] if workers else None,
        "rounds": workers[0]["rounds"] if workers else 0,
        "group_sizes": sorted({g for w in workers for g in w["group_sizes"]}),
        "curve": workers[0]["curve"] if workers else [],
    }
    if recipe == "grpo":
        result["reward_before"] = _mean([w.get("reward_before") for w in workers])
    return result


def human_bytes(num: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(num) < 1000 or unit == "TB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1000
    raise AssertionError("unreachable")


def ratio(value: float | None, baseline: float | None) -> str:
    if value is None or not baseline:
        return "-"
    return f"{value / baseline:.3g}x"


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


def write_markdown(path: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    by_name = {r["strategy"]: r for r in results}
    ddp = by_name.get("ddp", {}).get("bytes_per_worker")
    diloco = by_name.get("diloco", {}).get("bytes_per_worker")
    metric = meta["metric_label"]
    lines = [
        f"# {meta['recipe']}: ddp vs diloco vs pulseloco vs sparseloco",
        "",
        f"| strategy | final {metric} | bytes sent per worker | vs DDP | vs DiLoCo | train time (s) | wall time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["error"]:
            lines.append(f"| {r['strategy']} | failed: {r['error'].splitlines()[0][:80]} | | | | | |")
            continue
        b = r["bytes_per_worker"]
        final = "-" if r["final"] is None else f"{r['final']:.4f}"
        if r["final"] is not None and meta["metric_sources"] == ["eval", "train"]:
            final += " (eval)" if r["final_source"] == "eval" else " (training)"
        cells = [
            r["strategy"],
            final,
            "-" if b is None else f"{human_bytes(b)} ({b:,.0f} B){'' if r['bytes_measured'] else ' est.'}",
            ratio(b, ddp),
            ratio(b, diloco),
            "-" if r["train_seconds"] is None else f"{r['train_seconds']:.1f}",
            "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    ddp_run = by_name.get("ddp", {})
    params = ddp_run.get("num_params") or next((r["num_params"] for r in results if r.get("num_params")), None)
    steps = ddp_run.get("steps") or meta["steps"] or "max_steps"
    lines += [
        "",
        f"- {meta['workers']} workers per strategy, the same optimizer steps and batch size per worker; ddp is "
        f"{meta['ddp_launch']}; the swarm strategies are peers of one process each (`accelerate launch`) through a "
        "bootstrap DHT, every round averaged by all of them (bytes: measured by PulseLoCo, the wire bytes each "
        "peer sent, summed over its rounds in `pulseloco_rounds.jsonl`).",
        "- ddp's bytes (est.) are not measured: a ring all-reduce of FP32 gradients every optimizer step, "
        f"2(W-1)/W x 4 bytes x {f'{params:,}' if params else 'N'} parameters (counted in the saved model) x "
        f"{steps} steps per worker, W = {meta['workers']}.",
        f"- final {metric}: {meta['metric_note']}; mean over the workers.",
        "- train time: the Trainer's `train_runtime` of the slowest worker (swarm peers: with the outer rounds); "
        "wall time: from launch to exit, with imports, data, DHT start, evaluation and saving.",
        f"- network: {meta['network']}.",
        f"- strategies ran {'concurrently (wall times are not comparable)' if meta['parallel'] else 'one at a time'}.",
        f"- recipe `{meta['recipe_path']}`, config `{meta['config']}`, seed {meta['seed']} ({meta['seed_note']}), "
        f"max_steps {meta['steps'] or 'from the config'}, "
        + (f"model `{meta['model_name_or_path']}`, " if meta.get("model_name_or_path") else "")
        + f"extra arguments: `{' '.join(meta['extra']) or 'none'}`.",
        f"- {meta['date']}, commit {meta['commit']}, {meta['machine']}.",
        f"- plots: `{meta['plots'][0]}` ({meta['curve_label']} at each logging step against bytes sent by then), "
        f"`{meta['plots'][1]}` (against training time: swarm peers' summed inner and outer seconds at round ends, "
        "ddp's `train_runtime` spread evenly over its steps), of each strategy's first worker.",
    ]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(out_dir: Path, results: list[dict[str, Any]], metric_label: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["compare_bytes.png", "compare_time.png"]
    styles = {"ddp": "-", "diloco": "--", "pulseloco": "-", "sparseloco": ":"}
    for name, x_index, x_label in ((names[0], 0, "bytes sent per worker"), (names[1], 1, "training time (s)")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in results:
            if r["curve"]:
                xs = [point[x_index] for point in r["curve"]]
                ys = [point[2] for point in r["curve"]]
                ax.plot(xs, ys, styles.get(r["strategy"], "-"), marker="o", markersize=3, label=r["strategy"])
        if x_index == 0:
            ax.set_xscale("symlog", linthresh=1e3)
        ax.set_xlabel(x_label)
        ax.set_ylabel(metric_label)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
    return names


# ---- main --------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--recipe", choices=("pretrain", "grpo"), default="pretrain", help="recipes/<recipe>.py")
    ap.add_argument(
        "--config",
        type=Path,
        default=None,
        help="recipe config (default: configs/pretrain-tiny.yaml or grpo-tiny.yaml)",
    )
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset of the four")
    ap.add_argument("--workers", type=int, default=2, help="workers per strategy (default 2)")
    ap.add_argument(
        "--steps", type=int, default=None, help="--max_steps per worker (default: the config's; for the swarm "
        "strategies a multiple of inner_steps)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="--seed of every run (swarm peer i: see above)")
    ap.add_argument(
        "--model_name_or_path", "--model-name-or-path", default=None,
        help="the model every run starts from (grpo default: scripts/warm_model.py --size WARM_SIZE)",
    )  # fmt: skip
    ap.add_argument("--warm-size", default="tiny", help="scripts/warm_model.py --size for grpo (default tiny)")
    ap.add_argument("--bandwidth", default=None, help="limit each worker's link, e.g. 100mbit (needs root)")
    ap.add_argument("--parallel", action="store_true", help="run the strategies at once (wall times not comparable)")
    ap.add_argument("--out", type=Path, default=REPO / "results", help="where compare.md and the plots go")
    ap.add_argument("--runs-dir", type=Path, default=None, help="logs and outputs (default: a temporary directory)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the temporary runs directory")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one strategy may take (default 1800)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
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
    args.config = (args.config or DEFAULT_CONFIGS[args.recipe]).resolve()
    if not args.config.is_file():
        ap.error(f"--config: {args.config} does not exist")
    if args.model_name_or_path is not None and Path(args.model_name_or_path).expanduser().exists():
        args.model_name_or_path = str(Path(args.model_name_or_path).expanduser().resolve())

    temp_runs = args.runs_dir is None
    runs_dir = Path(tempfile.mkdtemp(prefix="pulseloco-compare-")) if temp_runs else args.runs_dir.resolve()
    if not temp_runs:
        for name in [*strategies, "warm_model.log"]:  # the recipes refuse a used output_dir: a rerun starts clean
            shutil.rmtree(runs_dir / name, ignore_errors=True)
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

    runner = Runner(runs_dir, netns)
    stop = {"signal": None}

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
    try:
        if args.recipe == "grpo" and args.model_name_or_path is None:
            log(f"warm model: scripts/warm_model.py --size {args.warm_size} (built once, minutes; then reused)")
            args.model_name_or_path = str(build_warm_model(runner, args.warm_size, WARM_MODEL_TIMEOUT))
            log(f"warm model: {args.model_name_or_path}")
        bootstrap = None
        if any(s != "ddp" for s in strategies):
            host = netns.host(0) if netns is not None else "127.0.0.1"
            dht = runner.start("bootstrap", ["pulseloco", "dht", "--host-maddrs", f"/ip4/{host}/tcp/0"], ns_index=0)
            bootstrap = wait_for_maddr(dht, STARTUP_TIMEOUT)
            log(f"bootstrap node: {bootstrap}")
        batches = [strategies] if args.parallel else [[s] for s in strategies]
        for batch in batches:
            started = [start_strategy(runner, args, s, bootstrap, extra) for s in batch]
            log(f"running {', '.join(batch)} ({args.workers} workers each); logs in {runs_dir}")
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
    except RuntimeError as exc:  # the warm model or the bootstrap node failed: nothing to compare
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
        metric_note = (
            "held-out greedy exact-match reward after training (`reward_after` in grpo_eval.json; before training: "
            + ", ".join(
                f"{r['strategy']} {r['reward_before']:.3f}" for r in results if r.get("reward_before") is not None
            )
            + ")"
        )
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
        "recipe": args.recipe,
        "recipe_path": f"recipes/{args.recipe}.py",
        "config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(REPO) else str(args.config),
        "model_name_or_path": args.model_name_or_path,
        "seed": args.seed,
        "seed_note": (
            "swarm peer i: --data_seed seed+i" if args.recipe == "pretrain" else "swarm peer i: --seed seed+i"
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
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "commit": git_revision(),
        "machine": machine_note(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    meta["plots"] = plot(args.out, results, meta["curve_label"])
    text = write_markdown(args.out / "compare.md", results, meta)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    remove_temp_runs()
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
