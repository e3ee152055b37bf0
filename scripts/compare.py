#!/usr/bin/env python
"""Compare ddp, diloco, pulseloco and sparseloco on one recipe: loss (or reward), bytes sent, wall time.

    python scripts/compare.py                                   # recipes/pretrain.py, recipes/configs/tiny.yaml
    python scripts/compare.py --recipe grpo --steps 32          # GRPO (the reward instead of the loss)
    python scripts/compare.py --bandwidth 100mbit               # each worker behind a 100 Mbit/s link (root)
    python scripts/compare.py --steps 16 -- --pretrain.lr 1e-3  # arguments after -- go to every recipe run

Every strategy runs the same recipe and config with the same seed, steps and batch size per worker, and the same
number of workers (``--workers``, default 2), so each sees the same number of samples:

* ``ddp``: one ``accelerate launch --multi_gpu --num_processes W`` (gradients all-reduced every step; its bytes
  are the recipe's ring all-reduce estimate ``2 (W - 1) / W * 4 * params`` per step, the others' are measured);
* ``diloco``, ``pulseloco``, ``sparseloco``: W peers of one process each (``accelerate launch``), joined through a
  bootstrap node (``pulseloco dht``) on 127.0.0.1, every round formed by all W peers (``--target-group-size W``).

Strategies run one after the other (``--parallel``: all at once, faster, but then wall times are not comparable).
With ``--bandwidth RATE`` (as root with ``ip netns`` and ``tc``) the bootstrap node and every worker run in
network namespaces of their own behind a veth limited to RATE each way (scripts/netns.py, as scripts/bench_sync.py
does), ddp then as W single-process launches of a two-machine job; without root it says why it skipped the limit.

Writes ``OUT/compare.md`` (a table: final loss or reward, bytes sent per worker, ratios to DDP and DiLoCo, wall
time; the config, date and machine), ``OUT/compare_bytes.png`` (loss against bytes sent) and
``OUT/compare_time.png`` (loss against wall time), and with ``--json PATH`` the numbers. The runs' logs and
metrics go to ``--runs-dir`` (default: a temporary directory, removed unless ``--keep-runs``). Every process
has a timeout and is stopped (its process group) when the script ends, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
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

from netns import NetNS, rate_label  # scripts/netns.py (scripts/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
DEFAULT_CONFIG = RECIPES / "configs" / "tiny.yaml"
STRATEGIES = ("ddp", "diloco", "pulseloco", "sparseloco")
LAUNCH_FLAGS = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
STARTUP_TIMEOUT = 180.0
"""Seconds for the bootstrap node to print its multiaddr (imports are slow on a busy two-core machine)."""
DDP_PORT = 29517


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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
    """Output directories (metrics.jsonl) of the workers that write metrics (ddp: the main process only)."""
    procs: list[Proc] = field(default_factory=list)
    error: str | None = None


def recipe_argv(args: argparse.Namespace, strategy: str, output_dir: Path, extra: list[str]) -> list[str]:
    argv = [str(RECIPES / f"{args.recipe}.py"), "--config", str(args.config), "--strategy", strategy]
    argv += ["--output-dir", str(output_dir), "--seed", str(args.seed)]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    return argv + extra


def start_strategy(
    runner: Runner, args: argparse.Namespace, strategy: str, bootstrap: str | None, extra: list[str]
) -> StrategyRun:
    accelerate = [str(Path(sys.executable).parent / "accelerate"), "launch"]
    run = StrategyRun(strategy)
    out = runner.runs_dir / strategy
    w, netns = args.workers, runner.netns
    if strategy == "ddp" and netns is None:
        multi = ["--multi_gpu"] if w > 1 else []
        argv = [*accelerate, *multi, "--num_processes", str(w), *LAUNCH_FLAGS, "--main_process_port", str(DDP_PORT)]
        run.procs.append(runner.start("ddp", [*argv, *recipe_argv(args, "ddp", out, extra)]))
        run.workers.append(out)
    elif strategy == "ddp" and netns is not None:
        # one launch per namespace: a W-machine job of one process each, its gloo traffic on the limited links
        for i in range(w):
            argv = [*accelerate, "--multi_gpu", "--num_machines", str(w), "--num_processes", str(w)]
            argv += ["--machine_rank", str(i), "--main_process_ip", netns.host(1), "--main_process_port"]
            argv += [str(DDP_PORT), "--mixed_precision", "no", "--dynamo_backend", "no"]
            argv += recipe_argv(args, "ddp", out, extra)
            run.procs.append(runner.start(f"ddp{i}", argv, ns_index=1 + i, env={"GLOO_SOCKET_IFNAME": "eth0"}))
        run.workers.append(out)
    else:
        swarm = ["--run-id", f"compare-{os.getpid()}-{strategy}", "--initial-peers", str(bootstrap)]
        swarm += ["--target-group-size", str(w), "--matchmaking-time", "60", "--linger", "3"]
        for i in range(w):
            peer_out = out / f"peer{i}"
            argv = [*accelerate, "--num_processes", "1", *LAUNCH_FLAGS]
            argv += [*recipe_argv(args, strategy, peer_out, extra), *swarm, "--peer-index", str(i)]
            if netns is not None:
                argv += ["--host-maddrs", f"/ip4/{netns.host(1 + i)}/tcp/0"]
            run.procs.append(runner.start(f"{strategy}-peer{i}", argv, ns_index=1 + i))
            run.workers.append(peer_out)
    return run


# ---- results -----------------------------------------------------------------------------------------------------


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


def summarize(run: StrategyRun, metric: str, num_workers: int) -> dict[str, Any]:
    """Final metric (mean over workers), bytes sent per worker, seconds; curves of the first worker."""
    done, curves = [], []
    for out in run.workers:
        events = read_events(out / "metrics.jsonl")
        finished = [e for e in events if e["event"] == "done"]
        if finished:
            done.append(finished[-1])
        steps = [e for e in events if e["event"] == "step" and e.get(metric) is not None]
        curves.append([(s["bytes_sent_total"], s["seconds"], s[metric]) for s in steps])
    key = "eval_loss" if metric == "loss" else "reward"
    wall = [p.ended - p.started for p in run.procs if p.ended is not None]
    return {
        "strategy": run.strategy,
        "error": run.error,
        "workers": num_workers,
        "final": sum(d[key] for d in done) / len(done) if done else None,
        "bytes_per_worker": sum(d["bytes_sent_total"] for d in done) / len(done) if done else None,
        "train_seconds": max(d["seconds"] for d in done) if done else None,
        "wall_seconds": max(wall) if wall and len(wall) == len(run.procs) else None,
        "curve": curves[0] if curves else [],
    }


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
        cells = [
            r["strategy"],
            "-" if r["final"] is None else f"{r['final']:.4f}",
            "-" if b is None else f"{human_bytes(b)} ({b:,.0f} B)",
            ratio(b, ddp),
            ratio(b, diloco),
            "-" if r["train_seconds"] is None else f"{r['train_seconds']:.1f}",
            "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"- {meta['workers']} workers per strategy; ddp is {meta['ddp_launch']} (bytes: the recipe's ring "
        "all-reduce estimate, 2(W-1)/W x 4 bytes x params per step); "
        "the swarm strategies are peers of one process each through a bootstrap DHT (bytes: measured by "
        "PulseLoCo, the wire bytes each peer sent).",
        f"- final {metric}: {meta['metric_note']}; mean over the workers that log it.",
        "- train time: the training loop of the slowest worker (the recipe's `seconds`); wall time: from launch to "
        "exit, with imports, DHT start and evaluation.",
        f"- network: {meta['network']}.",
        f"- strategies ran {'concurrently (wall times are not comparable)' if meta['parallel'] else 'one at a time'}.",
        f"- recipe `{meta['recipe_path']}`, config `{meta['config']}`, seed {meta['seed']}, "
        f"steps {meta['steps'] or 'from the config'}, extra arguments: `{' '.join(meta['extra']) or 'none'}`.",
        f"- {meta['date']}, commit {meta['commit']}, {meta['machine']}.",
        f"- plots: `{meta['plots'][0]}` (step-level {meta['curve_label']} against bytes sent), `{meta['plots'][1]}` "
        f"({meta['curve_label']} against training time), of each strategy's first worker.",
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
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="recipe config (default: tiny.yaml)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset of the four")
    ap.add_argument("--workers", type=int, default=2, help="workers per strategy (default 2)")
    ap.add_argument("--steps", type=int, default=None, help="inner steps per worker (default: the config's)")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of every run")
    ap.add_argument("--bandwidth", default=None, help="limit each worker's link, e.g. 100mbit (needs root)")
    ap.add_argument("--parallel", action="store_true", help="run the strategies at once (wall times not comparable)")
    ap.add_argument("--out", type=Path, default=REPO / "results", help="where compare.md and the plots go")
    ap.add_argument("--runs-dir", type=Path, default=None, help="logs and metrics (default: a temporary directory)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the temporary runs directory")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one strategy may take (default 1800)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown or not strategies:
        ap.error(f"--strategies: unknown {', '.join(unknown) or '(none given)'} (choose from {', '.join(STRATEGIES)})")
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if args.workers < 2 and "ddp" in strategies:
        log("warning: ddp with one worker sends nothing")
    args.config = args.config.resolve()
    if not args.config.exists():
        ap.error(f"--config: {args.config} does not exist")

    temp_runs = args.runs_dir is None
    runs_dir = Path(tempfile.mkdtemp(prefix="pulseloco-compare-")) if temp_runs else args.runs_dir.resolve()
    if not temp_runs:
        for strategy in strategies:  # metrics files are appended to: a rerun starts clean
            shutil.rmtree(runs_dir / strategy, ignore_errors=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

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

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    runs: list[StrategyRun] = []
    try:
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
        return 130 if stop["signal"] in (None, signal.SIGINT) else 143
    finally:
        runner.stop_all()
        if netns is not None:
            netns.teardown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    metric = "loss" if args.recipe == "pretrain" else "reward"
    results = [summarize(run, metric, args.workers) for run in runs]
    meta = {
        "recipe": args.recipe,
        "recipe_path": f"recipes/{args.recipe}.py",
        "config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(REPO) else str(args.config),
        "seed": args.seed,
        "steps": args.steps,
        "extra": extra,
        "workers": args.workers,
        "parallel": args.parallel,
        "network": network,
        "bandwidth": args.bandwidth,
        "bandwidth_applied": netns is not None,
        "ddp_launch": (
            f"{args.workers} `accelerate launch --num_machines {args.workers}` of one process, one per namespace"
            if netns is not None
            else f"one `accelerate launch --multi_gpu --num_processes {args.workers}`"
        ),
        "metric_label": "eval loss" if metric == "loss" else "greedy reward",
        "curve_label": "training loss" if metric == "loss" else "sampled reward",
        "metric_note": "held-out loss at the end" if metric == "loss" else "greedy exact-match reward at the end",
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "commit": git_revision(),
        "machine": machine_note(),
    }
    meta["plots"] = plot(args.out, results, meta["curve_label"])
    text = write_markdown(args.out / "compare.md", results, meta)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    if temp_runs and not args.keep_runs:
        shutil.rmtree(runs_dir, ignore_errors=True)
    elif temp_runs:
        log(f"runs kept in {runs_dir}")
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
