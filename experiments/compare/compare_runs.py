"""The runs of ``experiments/compare/compare.py``: which strategy runs at which learning rate and seed (:class:`Plan`,
:func:`make_plans`), and how one run starts (:func:`start_run`: ddp as one data-parallel launch, or W launches in
network namespaces; the swarm strategies as W peers of one process each through a bootstrap node, peer 0
publishing with PULSESync).

The script's module docstring says what each strategy is and how seeds are assigned. Starting raises ``OSError``
when a process cannot be started; the processes' own failures surface when the script waits for them
(:func:`harness.procs.wait_all`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from harness.procs import Proc, Runner
from harness.recipe_runs import LAUNCH, MULTI_PROCESS, SINGLE_PROCESS, recipe_path, swarm_flags

STRATEGIES: dict[str, tuple[str, list[str]]] = {
    "ddp": ("ddp", []),
    "diloco": ("diloco", []),
    "pulseloco": ("pulseloco", []),
    "pulseloco-bf16": ("pulseloco", ["--pulse_values", "bfloat16"]),
    "sparseloco": ("sparseloco", []),
    "sparseloco-k128": ("sparseloco", ["--topk_k", "128"]),
    "pulseloco-2bit": ("pulseloco", ["--pulse_values", "quantized"]),
    "pulseloco-2bit-k64": ("pulseloco", ["--pulse_values", "quantized", "--pulse_budget", "64"]),
    "sparseloco-gather": ("sparseloco", ["--exchange", "gather"]),
    "sparseloco-topk": ("sparseloco", ["--exchange", "topk"]),
    "sparseloco-topk-x1": ("sparseloco", ["--exchange", "topk", "--exchange_budget", "1"]),
    "sparseloco-topk-x4": ("sparseloco", ["--exchange", "topk", "--exchange_budget", "4"]),
    "pulseloco-2bit-topk": ("pulseloco", ["--pulse_values", "quantized", "--exchange", "topk"]),
    "pulseloco-topk": ("pulseloco", ["--exchange", "topk"]),
    "diloco-published": ("diloco", ["--clip_to_median", "false"]),
    "pulseloco-published": ("pulseloco", ["--clip_to_median", "false"]),
    "diloco-overlap": ("diloco", ["--overlap", "true"]),
    "sparseloco-overlap": ("sparseloco", ["--overlap", "true"]),
}
"""Name in the table -> (the recipe's ``--strategy``, further recipe flags): DDP, DiLoCo, the PULSE gate with FP32,
BF16 and 2-bit quantized values (``-k64``: the gate intersected with a top-64 budget per 64x64 tile), and SparseLoCo
(top-k per 64x64 tile, k = 64 or 128, 2-bit values, error feedback); then the exchange variants, each with the
library's exchange (``--exchange``; the others run its ``auto``) named: SparseLoCo as published, its parts relayed
to every member (``gather``, an all-gather), SparseLoCo and PULSE (FP32 and 2-bit values) with ``topk``
(``-x1``: the owners keep one part's budget of the aggregate per tile, Ok-Topk's rule, instead of the default
two; ``-x4``: four, nearer the union that gather applies in groups of eight); the baselines as published,
without the median clip that every other strategy here runs (``--clip_to_median false``); and DiLoCo and SparseLoCo
with overlapped rounds (``--overlap true``: each round's exchange runs during the next round's inner steps)."""
CORE_STRATEGIES = [
    "ddp", "diloco", "pulseloco", "pulseloco-bf16", "sparseloco", "sparseloco-k128", "pulseloco-2bit",
    "pulseloco-2bit-k64",
]  # fmt: skip
"""The strategies of ``--quick`` and of a pretrain comparison by default: ddp and the seven of the frontier (the
exchange variants and the published baselines run when ``--strategies`` names them)."""
GRPO_FLAGS = ["--num_eval_prompts", "100", "--logging_steps", "8"]
"""Recipe flags of every grpo run (before the user's, which win): the tiny task's 100 problems, a reward point a
round."""
SEED_STRIDE = 1000
"""Seed j of a comparison starts at ``--seed + SEED_STRIDE * j``: its peers' seeds (``+ i``) never overlap."""
PEER_STARTUP_TIMEOUT = 120.0
"""``--startup_timeout`` of the swarm peers: seconds to start their DHT and reach the bootstrap node."""
DDP_PORT = 29517
"""Rendezvous port of ddp across network namespaces (``--bandwidth``); on one machine accelerate picks a free one."""


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
        """The run's directory under the runs directory: learning rate, seed index, network."""
        lr = "config-lr" if self.lr is None else f"lr{self.lr:g}"
        return f"{lr}-seed{self.seed_index}{'' if self.limited else '-unlimited'}"


@dataclass
class StrategyRun:
    """A started run: its plan, its workers' output directories, its processes and, once waited for, its error."""

    plan: Plan
    workers: list[Path] = field(default_factory=list)
    """Output directories that receive trainer_state.json (ddp: one, written by its main process; else one per
    peer)."""
    procs: list[Proc] = field(default_factory=list)
    error: str | None = None

    @property
    def strategy(self) -> str:
        """The strategy's name in the table."""
        return self.plan.strategy


def make_plans(strategies: list[str], lrs: list[float | None], seeds: list[int], base_seed: int,
               reference: bool) -> list[Plan]:  # fmt: skip
    """Every run, learning rate by learning rate, seed by seed; with ``reference`` the loopback runs of the first
    learning rate and seed first."""
    plans = [Plan(s, lrs[0], 0, base_seed, limited=False) for s in strategies] if reference else []
    for lr, count in zip(lrs, seeds):
        for j in range(count):
            plans += [Plan(s, lr, j, base_seed + SEED_STRIDE * j) for s in strategies]
    return plans


def recipe_argv(
    args: argparse.Namespace, plan: Plan, output_dir: Path, extra: list[str], peer: int | None = None
) -> list[str]:
    """The recipe and its flags; ``peer``: the index of a swarm peer, which gets batches of its own. ``args``: the
    comparison's ``recipe``, ``config``, ``steps`` and ``model_name_or_path``."""
    strategy, flags = STRATEGIES[plan.strategy]
    argv = [str(recipe_path(args.recipe)), "--config", str(args.config), "--strategy", strategy, *flags]
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
    """Start the processes of one run (``args.workers`` workers); peer 0 of a swarm strategy publishes with ``key``
    (PULSESync) if given. A limited plan runs in the runner's network namespaces when it has them."""
    run = StrategyRun(plan)
    out = runner.log_dir / plan.tag / plan.strategy
    w = args.workers
    netns = runner.netns if plan.limited else None
    name = f"{plan.tag}-{plan.strategy}"
    if plan.strategy == "ddp" and netns is None:
        # one launch of W processes (gloo on a CPU machine); one process: -q keeps accelerate's own traceback out
        launch = [*MULTI_PROCESS, "--num_processes", str(w)] if w > 1 else ["-q", *SINGLE_PROCESS]
        run.procs.append(runner.start(name, [*LAUNCH, *launch, *recipe_argv(args, plan, out, extra)]))
        run.workers.append(out)
    elif plan.strategy == "ddp" and netns is not None:
        # one launch per namespace: a W-machine job of one process each, its gloo traffic on the limited links
        for i in range(w):
            argv = [*LAUNCH, *MULTI_PROCESS, "--num_machines", str(w), "--num_processes", str(w)]
            argv += ["--machine_rank", str(i), "--main_process_ip", netns.host(1), "--main_process_port"]
            argv += [str(DDP_PORT), *recipe_argv(args, plan, out, extra)]
            env = {"GLOO_SOCKET_IFNAME": "eth0"}
            run.procs.append(runner.start(f"{name}{i}", argv, ns_index=1 + i, env=env))
        run.workers.append(out)
    else:
        swarm = swarm_flags(f"compare-{os.getpid()}-{name}", str(bootstrap), w, startup_timeout=PEER_STARTUP_TIMEOUT)
        for i in range(w):
            peer_out = out / f"peer{i}"
            argv = [*LAUNCH, "-q", *SINGLE_PROCESS, *recipe_argv(args, plan, peer_out, extra, peer=i), *swarm]
            if netns is not None:
                argv += ["--host_maddrs", f"/ip4/{netns.host(1 + i)}/tcp/0"]
            if i == 0 and key is not None:
                argv += ["--publish", "--signing_key", str(key)]
            run.procs.append(runner.start(f"{name}-peer{i}", argv, ns_index=1 + i if netns is not None else None))
            run.workers.append(peer_out)
    return run
