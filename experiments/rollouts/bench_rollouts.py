#!/usr/bin/env python
"""Benchmark the rollout loop: one GRPO trainer (recipes/grpo.py) with rollout workers (recipes/rollout_worker.py).

    source .venv/bin/activate
    python experiments/rollouts/bench_rollouts.py                     # every case below (~25 min on 2 cores)
    python experiments/rollouts/bench_rollouts.py --cases local,swarm1,swarm2,swarm4 --steps 32
    python experiments/rollouts/bench_rollouts.py --cases nolimit-patch,netns-patch,netns-full --rate 100mbit \
        --rtt-ms 100 --net-steps 48                                    # as root: emulated WAN links
    python experiments/rollouts/bench_rollouts.py --cases nolimit-patch,netns-patch,netns-slow --net-workers 8
    python experiments/rollouts/bench_rollouts.py --cases local,swarm1 --seeds 0,1,2  # quality: local vs swarm, seeds
    python experiments/rollouts/bench_rollouts.py --report-only --out DIR  # rebuild DIR's tables from its JSON

Cases (``--cases``, comma-separated):
  * ``local``: the trainer generates its own completions (``--rollouts local``), the reference for (a).
  * ``swarm1``, ``swarm2``, ``swarm4``: ``--rollouts swarm`` with 1, 2, 4 rollout workers (``--serve_rollouts``)
    on loopback; same model (the cached tiny warm model, ``scripts/warm_model.py --size tiny``), seed, steps.
  * ``netns-patch``, ``netns-full``: the trainer (and the swarm's bootstrap node) and every worker each in its own
    network namespace behind an emulated access link (experiments/wan/wan_net.py: the userspace emulator
    experiments/wan/linkem.py, since this kernel has no ``netem``): ``--rate`` both ways, a round-trip time of
    ``--rtt-ms`` between the trainer and each worker (one-way delay ``rtt/4`` on every link), ``--jitter-ms``, MTU
    ``--mtu``; on a larger model (below): PULSESync patches (anchor every 10 versions) against a full BF16 copy per
    version (the trainer publishes with ``--anchor_every 1`` and the workers run with ``--full_checkpoints``).
    Workers relay what they hold to each other (every PULSESync subscriber does), so the trainer uploads a version
    to few of them.
  * ``netns-slow``: netns-patch with the last worker on its own link, ``--slow-link`` (``RATE/RTT_MS/LOSS``, by
    default 10 Mbit/s, 200 ms and 1% of packets lost each way): one volunteer on a poor home link.
  * ``nolimit-patch``: the netns-patch run on loopback without any link limit (the "ideal datacenter" reference).
  * ``netns-open``: the netns-patch run through the same namespaces and emulators with no rate, delay, jitter or
    loss (netns-patch under ``--rate 0 --rtt-ms 0``, but in the same run as the limited cases): what the userspace
    emulation itself costs (its processes share the machine's cores with the peers; every netns case reports its
    emulators' CPU seconds).

Every swarm case: a bootstrap DHT node (``python -m pulseloco dht``) first, then the workers (waited for until
each prints that it serves leases), then the trainer, a lone PULSELoCo peer with one outer round at the end
(``--strategy pulseloco --inner_steps STEPS --target_group_size 1``), publishing a version after every optimizer
step (``--publish --publish_every 1``), ``--rollouts swarm --rollout_fallback wait --max_lag 2``. The local case
runs the same trainer with ``--rollouts local``. With ``--seeds``, every case runs once per seed and a quality
table gives each case's held-out greedy reward after training (``--eval-prompts`` problems) and last logged
training reward over the seeds: the swarm's rollouts should learn as well as local generation.

Measured from the run's own files: train seconds (``grpo_eval.json``: the time in
``trainer.train``), trained samples = steps x per_device_train_batch_size, samples/s, steps/min, the sum of
``seconds_waiting`` in the trainer's ``rollouts.jsonl`` over the train seconds, the lag histogram, stale-dropped and
refused counts, rounds generated locally, the published patch sizes (``pulsesync_versions.jsonl``), and per worker
and version ``seconds_to_serve`` / ``bytes_received`` / ``path`` (the workers' ``rollouts.jsonl``). Where time went:
the trainer's train seconds split into waiting for workers, checking their completions and the rest (its own
steps and publishing), and each version's way to a worker: from publishing to the fetch's start (finding the new
head), the fetch and apply, the engine's load; and how busy the machine's cores were while the trainer ran (every
process of the case: near all of them, the processes slow each other down; ``--trainer-core N`` pins the trainer,
with one torch thread, to core N and everything else to the other cores, as if it had a machine of its own).
Throughput ratios pair each seed's case with the same seed's baseline and give every seed's and their mean.
Reward: the held-out greedy reward before and after (``grpo_eval.json``) and the last logged training reward.

The larger model of the netns cases (``--net-layers``, ``--net-intermediate``): the tiny warm model grown in
depth and MLP width (a Llama built from a config: hidden 64, extra decoder layers and a wider MLP initialised
N(0, 0.02), the new layers' RMSNorm weights scaled by ``--net-norm-scale`` so that the warm model's answers
survive), so that GRPO still has rewards to learn from while a full BF16 copy is tens of MB. It is written once to
``$PULSELOCO_CACHE``/``~/.cache/pulseloco``/models/bench-rollouts-<hash>.

Output: tables on stdout, ``bench_rollouts.json`` and ``bench_rollouts.md`` in ``--out`` (default: a new folder under
``experiments/rollouts/results/``); run directories (logs, jsonl files) under ``--workdir`` (kept with ``--keep``).
Every process this script starts is killed (its process group) and every namespace deleted on exit, errors and
Ctrl-C included; every wait is bounded (``--case-timeout``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

from harness import REPO, models, procs
from harness.logs import progress
from harness.netns import NetNS, parse_rate, rate_label
from harness.recipe_runs import LAUNCH, SINGLE_PROCESS, recipe_path, start_bootstrap
from harness.report import default_out, read_records
from rollouts_report import BATCH, summarize_run, write_outputs

sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "wan"))  # the WAN harness's emulated links
from wan_net import Link, WanNet, machine_busy_seconds, process_cpu

CONFIG = REPO / "recipes" / "configs" / "grpo-tiny.yaml"
TINY_CASES = ("local", "swarm1", "swarm2", "swarm4")
NET_CASES = ("nolimit-patch", "netns-open", "netns-patch", "netns-full", "netns-slow")
ALL_CASES = TINY_CASES + NET_CASES
READY_MARK = "rollout: serving leases"


log = progress("bench_rollouts")


# --------------------------------------------------------------------------------------------------
# Arguments and cases
# --------------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    workers: int  # 0: local generation
    model: str  # "tiny" or "net"
    netns: bool = False
    full: bool = False
    seed: int = 0
    slow: bool = False  # the last worker on --slow-link
    open_links: bool = False  # emulated links without rate, delay, jitter or loss

    @property
    def run_name(self) -> str:
        return f"{self.name}-s{self.seed}"

    @property
    def label(self) -> str:
        if self.workers == 0:
            return "local"
        link = "loopback"
        if self.netns:
            link = "netns, the last on a slow link" if self.slow else "netns, no limits" if self.open_links else "netns"
        return f"{self.workers} worker(s), {'full' if self.full else 'patch'}, {link}"


def make_case(name: str, net_workers: int) -> Case:
    if name == "local":
        return Case(name, 0, "tiny")
    if m := re.fullmatch(r"swarm(\d+)", name):
        return Case(name, int(m.group(1)), "tiny")
    if name == "nolimit-patch":
        return Case(name, net_workers, "net")
    if name == "netns-patch":
        return Case(name, net_workers, "net", netns=True)
    if name == "netns-open":
        return Case(name, net_workers, "net", netns=True, open_links=True)
    if name == "netns-full":
        return Case(name, net_workers, "net", netns=True, full=True)
    if name == "netns-slow":
        return Case(name, net_workers, "net", netns=True, slow=True)
    raise ValueError(f"unknown case {name!r}")


def parse_cases(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ValueError("--cases is empty")
    for name in names:
        if name not in ALL_CASES and not re.fullmatch(r"swarm[1-9]\d?", name):
            raise ValueError(f"unknown case {name!r}; choose from {','.join(ALL_CASES)} (or swarmN)")
    if len(set(names)) != len(names):
        raise ValueError(f"--cases has duplicates: {text}")
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma-separated subset of {','.join(ALL_CASES)}")
    ap.add_argument("--steps", type=int, default=64, help="trainer steps of the tiny-model cases")
    ap.add_argument("--net-steps", type=int, default=16, help="trainer steps of the netns / nolimit cases")
    ap.add_argument("--net-workers", type=int, default=2, help="rollout workers of the netns / nolimit cases")
    ap.add_argument(
        "--net-batch", type=int, default=16,
        help="completions per step of the netns / nolimit cases (groups of 8: one per worker needs 8 x workers)",
    )  # fmt: skip
    ap.add_argument("--rate", default="100mbit", help="rate of every namespace's emulated link, both ways (0: none)")
    ap.add_argument("--rtt-ms", type=float, default=100.0, help="round-trip time between the trainer and a worker")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="jitter of every link's one-way delay (+-, uniform)")
    ap.add_argument("--mtu", type=int, default=9000, help="MTU of the emulated links (fewer packets for the emulator)")
    ap.add_argument(
        "--slow-link", default="10mbit/200/0.01", help="netns-slow's last worker: RATE/RTT_MS/LOSS (loss per packet)"
    )
    ap.add_argument("--lr", type=float, default=None, help="learning rate of the tiny cases (default: the config's)")
    ap.add_argument("--net-lr", type=float, default=3e-6, help="learning rate of the netns / nolimit cases")
    ap.add_argument("--net-layers", type=int, default=16, help="decoder layers of the netns model (tiny: 2)")
    ap.add_argument("--net-intermediate", type=int, default=8192, help="MLP width of the netns model (tiny: 192)")
    ap.add_argument("--net-norm-scale", type=float, default=0.05, help="RMSNorm weight of the netns model's new layers")
    ap.add_argument("--max-lag", type=int, default=2, help="grpo.py --max_lag")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; every case runs once per seed")
    ap.add_argument("--eval-prompts", type=int, default=256, help="held-out problems scored greedily before/after")
    ap.add_argument("--worker-threads", type=int, default=1, help="OMP/torch threads per rollout worker")
    ap.add_argument(
        "--trainer-core", type=int, default=None,
        help="pin the trainer, with one torch thread, to this core and every other process of the run (workers, "
        "DHT, daemons, link emulators) to the other cores: the trainer as on a machine of its own (default: all "
        "processes share every core)",
    )  # fmt: skip
    ap.add_argument("--case-timeout", type=float, default=600.0, help="seconds one case may take in all")
    ap.add_argument("--startup-timeout", type=float, default=240.0, help="seconds for the workers to be serving")
    ap.add_argument("--workdir", default=None, help="run directories (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument(
        "--out", default=None,
        help="where bench_rollouts.json and .md go (default: a new folder experiments/rollouts/results/"
        "CASES-STAMP, named after the cases and start time; --report-only needs it)",
    )  # fmt: skip
    ap.add_argument("--report-only", action="store_true", help="rebuild the tables from <out>/bench_rollouts.json")
    return ap


def validate(args: argparse.Namespace) -> list[str]:
    """Checks the arguments; returns the case names. Raises ValueError naming the bad one."""
    names = parse_cases(args.cases)
    if args.net_batch < 8 or args.net_batch % 8:
        raise ValueError(f"--net-batch must be a multiple of 8 (num_generations), got {args.net_batch}")
    for name in ("steps", "net_steps", "net_workers", "net_layers", "net_intermediate", "worker_threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.net_layers < 2 or args.net_intermediate < 192:
        raise ValueError("--net-layers must be >= 2 and --net-intermediate >= 192 (the tiny model's)")
    if args.max_lag < 0:
        raise ValueError(f"--max-lag must be >= 0, got {args.max_lag}")
    for name in ("case_timeout", "startup_timeout", "net_lr", "net_norm_scale"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if not re.fullmatch(r"\d+(,\d+)*", args.seeds):
        raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if args.eval_prompts < 1:
        raise ValueError(f"--eval-prompts must be at least 1, got {args.eval_prompts}")
    if args.rate != "0" and not re.fullmatch(r"\d+(\.\d+)?[kmg]?bit", args.rate):
        raise ValueError(f"--rate must look like 100mbit (or 0: no limit), got {args.rate!r}")
    if not args.rtt_ms >= 0 or not 0 <= args.jitter_ms <= args.rtt_ms / 4:
        raise ValueError(f"--rtt-ms must be >= 0 and --jitter-ms in [0, rtt/4], got {args.rtt_ms}, {args.jitter_ms}")
    if not 576 <= args.mtu <= 65535:
        raise ValueError(f"--mtu must be in [576, 65535], got {args.mtu}")
    parse_slow_link(args.slow_link, args.rtt_ms)
    cores = sorted(os.sched_getaffinity(0))
    if args.trainer_core is not None and (args.trainer_core not in cores or len(cores) < 2):
        raise ValueError(f"--trainer-core must be one of this process's cores {cores} (and it needs two or more), "
                         f"got {args.trainer_core}")  # fmt: skip
    return names


def parse_slow_link(text: str, rtt_ms: float) -> tuple[str, float, float]:
    """``RATE/RTT_MS/LOSS`` of ``--slow-link`` as (rate, round-trip ms, loss). Raises ValueError naming what is
    wrong: a rate not like ``10mbit``, an RTT under ``--rtt-ms`` / 2 (the trainer's own link has ``rtt/4`` of it),
    a loss outside [0, 0.5]."""
    parts = text.split("/")
    if len(parts) != 3:
        raise ValueError(f"--slow-link must be RATE/RTT_MS/LOSS such as 10mbit/200/0.01, got {text!r}")
    rate, rtt, loss = parts
    if parse_rate(rate) is None:
        raise ValueError(f"--slow-link: the rate must look like 10mbit, got {rate!r}")
    try:
        rtt_value, loss_value = float(rtt), float(loss)
    except ValueError:
        raise ValueError(f"--slow-link: RTT_MS and LOSS must be numbers, got {rtt!r} and {loss!r}") from None
    if not rtt_value >= rtt_ms / 2:
        raise ValueError(f"--slow-link: the RTT must be at least --rtt-ms / 2 = {rtt_ms / 2:g} ms, got {rtt_value:g}")
    if not 0 <= loss_value <= 0.5:
        raise ValueError(f"--slow-link: the loss must be in [0, 0.5], got {loss_value:g}")
    return rate, rtt_value, loss_value


def case_links(case: Case, args: argparse.Namespace) -> list[Link]:
    """The emulated links of a netns case: the trainer's (and the bootstrap's, namespace 0), then each worker's.
    Every link has ``--rate`` both ways and a one-way delay of ``rtt/4``, so the trainer and a worker are ``--rtt-ms``
    apart; netns-slow's last worker has ``--slow-link``'s rate and loss and the delay that makes its RTT."""
    if case.open_links:
        return [Link(up="0", down="0", delay_ms=0.0, jitter_ms=0.0)] * (case.workers + 1)
    delay = args.rtt_ms / 4
    jitter = min(args.jitter_ms, delay)
    base = Link(up=args.rate, down=args.rate, delay_ms=delay, jitter_ms=jitter)
    links = [base] * (case.workers + 1)
    if case.slow:
        rate, rtt, loss = parse_slow_link(args.slow_link, args.rtt_ms)
        links[-1] = Link(up=rate, down=rate, delay_ms=rtt / 2 - delay, jitter_ms=jitter, loss=loss)
    return links


def link_label(args: argparse.Namespace) -> str:
    """The netns cases' links in words."""
    jitter = f" +-{args.jitter_ms:g} ms jitter" if args.jitter_ms else ""
    rate = "no rate limit" if args.rate == "0" else rate_label(args.rate)
    return f"{rate} both ways, {args.rtt_ms:g} ms RTT{jitter}, MTU {args.mtu} (linkem)"


def open_wan(case: Case, args: argparse.Namespace) -> WanNet:
    """The case's namespaces and emulated links, set up (torn down at exit too). Raises RuntimeError naming why
    they cannot be built (not root, no TUN devices, a failed command)."""
    reason = WanNet.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"netns cases need emulated links: {reason}")
    net = WanNet(case_links(case, args), mtu=args.mtu, prefix="plbr", seed=case.seed)
    atexit.register(net.teardown)
    try:
        net.setup()
    except Exception:
        net.teardown()
        raise
    return net


# --------------------------------------------------------------------------------------------------
# One case
# --------------------------------------------------------------------------------------------------


def start_workers(
    case: Case,
    args: argparse.Namespace,
    runner: procs.Runner,
    model: str,
    run_id: str,
    public_key: Path,
    deadline: float,
) -> list[str]:
    """Start the swarm's bootstrap node and the case's rollout workers and wait until each serves leases; returns
    the initial peers. Raises ProcFailed (a RuntimeError) or ProcTimeout (also a TimeoutError) with the log's tail."""
    host = [runner.netns.host(i) if runner.netns is not None else "127.0.0.1" for i in range(case.workers + 1)]
    started = time.monotonic()
    initial = [start_bootstrap(runner, "dht", host=host[0], ns_index=0, timeout=120)]
    workers = []
    for w in range(case.workers):
        wdir = runner.log_dir / f"worker{w}"
        cmd = [sys.executable, str(recipe_path("rollout_worker"))]
        if case.full:
            cmd += ["--full_checkpoints"]
        cmd += [
            "--model_name_or_path", model, "--run_id", run_id, "--initial_peers", *initial,
            "--host_maddrs", f"/ip4/{host[w + 1]}/tcp/0", "--public_key", str(public_key),
            "--output_dir", str(wdir), "--serve_rollouts", "--max_seconds", str(int(args.case_timeout)),
            "--update_timeout", "300", "--interval", "0.2",
        ]  # fmt: skip
        threads = str(args.worker_threads)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        wdir.mkdir()
        workers.append(runner.start(f"worker{w}", cmd, log_path=wdir / "worker.log", ns_index=w + 1, env=env))
    for worker in workers:
        worker.wait_for(re.escape(READY_MARK), max(1.0, min(args.startup_timeout, deadline - time.monotonic())))
    log(f"{case.name}: {case.workers} worker(s) serving after {time.monotonic() - started:.0f} s")
    return initial


def trainer_argv(
    case: Case, args: argparse.Namespace, model: str, out_dir: Path, swarm: list[str], steps: int, lr: float | None
) -> list[str]:
    """recipes/grpo.py under accelerate's launcher: one PULSELoCo outer round at the end (a lone trainer), a
    version published every step; ``swarm``: the flags that join the workers' swarm (none: local rollouts)."""
    cmd = [
        *LAUNCH, *SINGLE_PROCESS, str(recipe_path("grpo")), "--config", str(CONFIG), "--model_name_or_path", model,
        "--output_dir", str(out_dir), "--max_steps", str(steps), "--seed", str(case.seed),
        "--num_eval_prompts", str(args.eval_prompts),
        "--strategy", "pulseloco", "--inner_steps", str(steps), "--target_group_size", "1",
        "--matchmaking_time", "2", "--logging_steps", "4", "--linger", "2",
    ]  # fmt: skip
    if lr is not None:
        cmd += ["--learning_rate", str(lr)]
    return cmd + (swarm or ["--rollouts", "local"])


def run_case(
    case: Case, args: argparse.Namespace, model: str, workdir: Path, keys: tuple[Path, Path]
) -> dict[str, Any]:
    """One case: its network (netns cases: :func:`open_wan`), its workers (if any), the trainer to the end, then the
    metrics of its files; a case that fails or runs past ``--case-timeout`` gives the metrics so far and ``error``.
    Raises RuntimeError when a netns case's network cannot be built."""
    net = open_wan(case, args) if case.netns else None
    try:
        result = _run_case(case, args, model, workdir, keys, net)
        if net is not None:  # what the emulation took from the cores the peers share (they are still running)
            emulators = process_cpu([proc.pid for proc in net.emulators]).get("emulator", {})
            result["emulator_cpu_seconds"] = round(emulators.get("seconds", 0.0), 1)
        return result
    finally:
        if net is not None:
            net.teardown()


def _run_case(case: Case, args: argparse.Namespace, model: str, workdir: Path, keys: tuple[Path, Path],
              net: NetNS | None) -> dict[str, Any]:  # fmt: skip
    run_dir = workdir / case.run_name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # `pulseloco dht`
    runner = procs.Runner(run_dir, netns=net, env={"PATH": path})
    started = time.monotonic()
    deadline = started + args.case_timeout
    steps = args.net_steps if case.model == "net" else args.steps
    lr = args.net_lr if case.model == "net" else args.lr
    batch = args.net_batch if case.model == "net" else BATCH
    run_id = f"bench{os.getpid()}{case.name.replace('-', '')}s{case.seed}"
    try:
        swarm: list[str] = []
        if case.workers:
            initial = start_workers(case, args, runner, model, run_id, keys[1], deadline)
            host = runner.netns.host(0) if runner.netns is not None else "127.0.0.1"
            swarm = [
                "--rollouts", "swarm", "--publish", "--signing_key", str(keys[0]), "--publish_every", "1",
                "--anchor_every", "1" if case.full else "10", "--run_id", run_id, "--initial_peers", *initial,
                "--host_maddrs", f"/ip4/{host}/tcp/0", "--rollout_fallback", "wait", "--max_lag", str(args.max_lag),
            ]  # fmt: skip
        cmd = trainer_argv(case, args, model, run_dir / "trainer", swarm, steps, lr)
        cmd += ["--per_device_train_batch_size", str(batch)]
        env = None
        if args.trainer_core is not None:  # main() moved everything else off this core
            cmd = ["taskset", "--cpu-list", str(args.trainer_core), *cmd]
            env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        busy = machine_busy_seconds()[0], time.monotonic()
        trainer = runner.start("trainer", cmd, ns_index=0, env=env)
        log(f"{case.name}: trainer started ({steps} steps)")
        procs.wait_all([trainer], max(1.0, deadline - time.monotonic()), hint="--case-timeout")
        busy = machine_busy_seconds()[0] - busy[0], time.monotonic() - busy[1]
        time.sleep(1.0)  # workers write their last version's line
    except (RuntimeError, TimeoutError, OSError) as exc:  # keep what the run wrote so far
        runner.stop_all(grace=15.0)
        result = collect(case, run_dir, steps, lr, batch, partial=True)
        result["error"] = f"{case.name}: {exc}"
        result["wall_seconds"] = round(time.monotonic() - started, 1)
        return result
    finally:
        runner.stop_all(grace=15.0)
    result = collect(case, run_dir, steps, lr, batch)
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    # how busy the shared cores were while the trainer ran (every process: trainer, workers, DHT, daemons, emulators)
    result["machine_busy_seconds"] = round(busy[0], 1)
    result["machine_busy_share"] = round(busy[0] / max(1e-9, busy[1] * (os.cpu_count() or 1)), 3)
    return result


# --------------------------------------------------------------------------------------------------
# Reading a run's files
# --------------------------------------------------------------------------------------------------


def collect(
    case: Case, run_dir: Path, steps: int, lr: float | None, batch: int = BATCH, *, partial: bool = False
) -> dict[str, Any]:
    """The metrics of a run directory; ``partial``: of a run that did not finish (steps and seconds from the
    trainer's rollouts.jsonl: its rounds and the time from the first to the last)."""
    out_dir = run_dir / "trainer"
    rounds = [r for r in read_records(out_dir / "rollouts.jsonl") if r.get("mode", "train") == "train"]
    if partial or not (out_dir / "grpo_eval.json").is_file():
        seconds = rounds[-1]["time"] - rounds[0]["time"] if len(rounds) > 1 else 0.0
        evaluation = {"seconds": seconds}
        steps = max(0, len(rounds) - 1)
    else:
        evaluation = json.loads((out_dir / "grpo_eval.json").read_text())
    state_path = out_dir / "trainer_state.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    rewards = [h["reward"] for h in state.get("log_history", []) if "reward" in h]
    workers = [read_records(d / "rollouts.jsonl") for d in sorted(run_dir.glob("worker*"))]
    result = {
        **asdict(case),
        "label": case.label,
        "run_name": case.run_name,
        "learning_rate": lr,
        "reward_before": evaluation.get("reward_before"),
        "reward_after": evaluation.get("reward_after"),
        "train_reward_last": rewards[-1] if rewards else None,
        "trainer_cpu_seconds": evaluation.get("cpu_seconds"),  # the trainer's process, all its threads
        **summarize_run(
            steps=steps if partial else int(state.get("global_step", steps)),
            train_seconds=float(evaluation["seconds"]),
            rollouts=read_records(out_dir / "rollouts.jsonl"),
            published=read_records(out_dir / "pulsesync_versions.jsonl"),
            workers=workers,
            batch=batch,
            outer_rounds=read_records(out_dir / "pulseloco_rounds.jsonl"),
            leases=[read_records(d / "leases.jsonl") for d in sorted(run_dir.glob("worker*"))],
        ),
    }
    return result


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def prepare_models(args: argparse.Namespace, cases: list[Case], payload: dict[str, Any]) -> tuple[str, str | None]:
    """The tiny warm model (built once by scripts/warm_model.py) and, for net cases, the grown one; both noted in
    ``payload``. Raises RuntimeError when a model cannot be built."""
    tiny = str(models.warm_model_dir("tiny", timeout=1800))
    payload["tiny_model"] = tiny
    net_model = None
    if any(c.model == "net" for c in cases):
        seed = cases[0].seed
        net_model, payload["net_model"] = models.grow_llama(
            tiny, args.net_layers, args.net_intermediate, args.net_norm_scale, seed
        )
        log(f"netns model {net_model}: {payload['net_model']}")
    return tiny, net_model


def run_cases(args: argparse.Namespace, cases: list[Case], workdir: Path, payload: dict[str, Any]) -> None:
    """Every case in turn, each result appended to ``payload["results"]`` and the outputs written again after it."""
    from pulseloco.sync.signing import generate_key, save_keypair

    keys = save_keypair(generate_key(), workdir / "publisher.key")
    tiny, net_model = prepare_models(args, cases, payload)
    for case in cases:
        log(f"case {case.run_name}: {case.label}")
        try:
            result = run_case(case, args, net_model if case.model == "net" and net_model else tiny, workdir, keys)
        except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
            log(f"case {case.name} failed: {exc}")
            result = {**asdict(case), "label": case.label, "error": str(exc)}
        payload["results"].append(result)
        write_outputs(payload, Path(args.out))
        log(f"case {case.run_name}: {json.dumps({k: result.get(k) for k in ('samples_per_s', 'wait_fraction')})}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.report_only:
        if args.out is None:
            ap.error("--report-only needs --out DIR (the folder whose bench_rollouts.json to report)")
        out = Path(args.out)
        print(write_outputs(json.loads((out / "bench_rollouts.json").read_text()), out))
        return 0
    try:
        names = validate(args)
    except ValueError as exc:
        ap.error(str(exc))
    label = "all" if list(names) == list(ALL_CASES) else "_".join(names)
    out = Path(args.out) if args.out is not None else default_out("rollouts", label)
    args.out = str(out)
    procs.exit_on_signals()
    if args.trainer_core is not None:  # this process and all it starts, but the trainer, leave the trainer's core
        os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - {args.trainer_core})
    seeds = [int(x) for x in args.seeds.split(",")]
    cases = [replace(make_case(n, args.net_workers), seed=seed) for seed in seeds for n in names]
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="brollouts"))
    workdir.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "command": "python experiments/rollouts/bench_rollouts.py " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "rate_label": link_label(args),
        "args": vars(args),
        "results": [],
    }
    results: list[dict[str, Any]] = payload["results"]
    try:
        reason = WanNet.unavailable_reason()
        if reason is not None and any(c.netns for c in cases):
            log(f"netns cases skipped: {reason}")
            for c in [c for c in cases if c.netns]:
                results.append({**asdict(c), "label": c.label, "error": f"skipped: {reason}"})
            cases = [c for c in cases if not c.netns]
        run_cases(args, cases, workdir, payload)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif results:
            log(f"run directories kept in {workdir}")
    text = write_outputs(payload, out)
    print(text)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
