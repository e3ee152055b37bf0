#!/usr/bin/env python
"""Benchmark the PULSESync patch codec against two baselines measured in the same run.

Inputs:
  * real updates: a Qwen2 (Llama-style) model built from a config with random init, FP32 master weights
    and a BF16 copy, taking AdamW steps on a synthetic LM loss (random token ids). For every learning
    rate two windows are measured: one step (after step W vs after step W+1, W = --warmup, so Adam is
    past its first step, whose update is exactly lr*sign(g) on every element) and the multi-step
    windows of --steps (after step 0 vs after step K).
  * synthetic: a Gaussian (std 0.02) BF16 state with the model's tensor shapes, in which a seeded random
    mask of each --densities fraction of elements moves to the neighbouring BF16 value.

Codecs: pulseloco absolute and delta (`make_patch`), and two baselines (experiments/codec/codec_baselines.py:
``naive``: flat int32 indices + BF16 values + zstd-1; ``authors``: the PULSE authors' production
codec as docs/design.md section 6.2 describes it, per-tensor 2-D row/column gaps narrowed to u8/u16 + raw BF16
values + zstd-1). Every codec is timed as encode (diff + pack) and apply (decode + scatter into a copy of
the base), as a ratio to ``torch.clone`` of the same state timed in the same run (interleaved with the
measured calls; glibc malloc is told to keep freed memory so that page faults do not dominate, see
``harness.memory.tune_malloc``), and every round trip is checked bit for bit.

Prints a fixed-width table and a Targets section; ``--json PATH`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

import torch
from codec_baselines import State
from codec_timing import CLONES_PER_RUN, CODECS, Row, make_codec, measure_input, to_device
from harness import memory
from harness.logs import progress
from harness.models import MODEL_CONFIGS, SyntheticLM, build_model
from harness.report import Column, fixed_table, fmt, parse_floats, parse_ints

BATCH_SIZE = 2
SEQ_LEN = 64

log = progress("bench_codec")


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def bf16_state(model: torch.nn.Module) -> State:
    """The BF16 copy of the FP32 master weights, as a fresh name -> tensor dict."""
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


def real_updates(
    config_name: str, lr: float, windows: list[tuple[int, int]], seed: int, device: str = "cpu"
) -> dict[tuple[int, int], tuple[State, State]]:
    """Train a fresh model (same seed for every lr) with AdamW at ``lr`` and snapshot the BF16 state.

    Returns ``{(start, end): (bf16 state after step start, bf16 state after step end)}`` for each window;
    step 0 is the initial state. The synthetic loss is LM cross-entropy on seeded random token ids,
    a new batch of BATCH_SIZE x SEQ_LEN every step.
    """
    training = SyntheticLM(config_name, seed, lr, device=device, batch_size=BATCH_SIZE, seq_len=SEQ_LEN)
    wanted = sorted({s for w in windows for s in w})
    snaps: dict[int, State] = {}
    if 0 in wanted:
        snaps[0] = bf16_state(training.model)
    for step in range(1, max(wanted) + 1):
        loss, seconds = training.step()
        if step in wanted:
            snaps[step] = bf16_state(training.model)
        log(f"lr={lr:g} step={step} loss={loss:.4f} took={seconds:.2f}s")
    del training
    return {w: (snaps[w[0]], snaps[w[1]]) for w in windows}


def synthetic_base(shapes: dict[str, torch.Size], seed: int) -> State:
    """A BF16 state with the given shapes and Gaussian (std 0.02) weights, seeded."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in sorted(shapes.items())
    }


def synthetic_update(base: State, density: float, seed: int) -> State:
    """Copy of ``base`` where a seeded Bernoulli(density) mask of elements moves to the next BF16 value.

    The move adds 1 to the int16 bit pattern: the neighbouring representable value, away from zero for
    negatives. Gaussian weights are far from the int16 overflow at the NaN boundary.
    """
    gen = torch.Generator().manual_seed(seed)
    new: State = {}
    for name, t in base.items():
        mask = torch.rand(t.shape, generator=gen) < density
        bits = t.view(torch.int16)
        new[name] = torch.where(mask, bits + 1, bits).view(torch.bfloat16)
    return new


# --------------------------------------------------------------------------------------------------
# Targets and output
# --------------------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    input: str
    measured: float | None
    limit: float
    passed: bool


def _timing_ratio(row: Row, op: str) -> float:
    """Time of ``op`` ("encode" or "apply") over clone time, for a target verdict.

    A stalled clone sample can only flatter a median/median ratio; min/min is immune to that, so a
    timing target passes only when both ratios do.
    """
    return max(getattr(row, f"{op}_x_clone"), getattr(row, f"{op}_x_clone_min"))


def evaluate_targets(rows: list[Row]) -> list[Target]:
    """The issue's targets. Byte targets hold on every real update; timing targets on every input."""
    by = {(r.input, r.codec): r for r in rows}
    inputs = list(dict.fromkeys(r.input for r in rows))
    targets: list[Target] = []

    def add(name: str, inp: str, measured: float | None, limit: float) -> None:
        targets.append(Target(name, inp, measured, limit, measured is not None and measured <= limit))

    for inp in inputs:
        auth = by.get((inp, "authors"))
        if auth is None or auth.kind != "real":
            continue
        for codec, limit in (("pulseloco-abs", 0.8), ("pulseloco-delta", 0.45)):
            if (inp, codec) in by:
                ratio = by[inp, codec].patch_bytes / auth.patch_bytes
                add(f"{codec} bytes / authors bytes", inp, ratio, limit)
    for inp in inputs:
        r = by.get((inp, "pulseloco-abs"))
        if r is not None and r.kind == "random" and abs(r.meta.get("target_density", 0) - 0.01) < 1e-12:
            add("pulseloco index bytes / n*H(p)/8 at 1% random", inp, r.index_vs_bound, 1.10)
    timing_limits = {0.01: (3.0, 2.0), 0.1: (6.0, 6.0)}  # density: (encode, apply) as multiples of a clone
    for codec in ("pulseloco-abs", "pulseloco-delta"):
        for r in rows:
            if r.codec != codec or r.kind != "random":
                continue
            for density, (encode_limit, apply_limit) in timing_limits.items():
                if abs(r.meta.get("target_density", 0) - density) < 1e-12:
                    add(
                        f"{codec} encode / clone at {density:.0%} random",
                        r.input,
                        _timing_ratio(r, "encode"),
                        encode_limit,
                    )
                    add(
                        f"{codec} apply / clone at {density:.0%} random",
                        r.input,
                        _timing_ratio(r, "apply"),
                        apply_limit,
                    )
    return targets


COLUMNS: list[Column[Row]] = [
    ("input", 26, lambda r: r.input),
    ("codec", 15, lambda r: r.codec),
    ("density", 8, lambda r: f"{100 * r.density:.3f}%"),
    ("patch_MB", 9, lambda r: f"{r.patch_bytes / 1e6:.3f}"),
    ("B/elem", 7, lambda r: f"{r.bytes_per_changed:.3f}"),
    ("vs_full_bf16", 12, lambda r: f"{r.ratio_vs_full_bf16:.5f}"),
    ("idx_B/elem", 10, lambda r: fmt(r.index_bytes_per_changed, ".3f")),
    ("idx_vs_bound", 12, lambda r: fmt(r.index_vs_bound, ".3f")),
    ("enc_x_clone", 11, lambda r: f"{r.encode_x_clone:.2f}"),
    ("apply_x_clone", 13, lambda r: f"{r.apply_x_clone:.2f}"),
    ("clone_ms", 8, lambda r: f"{r.clone_s * 1e3:.0f}"),
    ("rt", 4, lambda r: "ok" if r.roundtrip_ok else "FAIL"),
]
"""The main table: the first two columns (labels) align left, numbers right; a blank line between inputs."""


def format_table(rows: list[Row]) -> str:
    return fixed_table(COLUMNS, rows, group=lambda r: r.input)


def format_scaling(rows: list[Row], thread_counts: list[int]) -> str:
    """Encode and apply time per thread count on the random inputs, and the speed-up over one thread count."""
    lines = [f"Thread scaling (random inputs; speed-up against {thread_counts[0]} thread(s))"]
    lines.append(
        f"  {'input':<12} {'codec':<16} {'threads':>7} {'enc_ms':>8} {'apply_ms':>8} {'enc_x':>6} {'app_x':>6}"
    )
    first = {(r.input, r.codec): r for r in rows if r.meta.get("threads") == thread_counts[0]}
    for r in sorted(rows, key=lambda r: (r.input, r.codec, r.meta.get("threads", 0))):
        ref = first[r.input, r.codec]
        lines.append(
            f"  {r.input:<12} {r.codec:<16} {r.meta.get('threads'):>7} {r.encode_s * 1e3:>8.1f} "
            f"{r.apply_s * 1e3:>8.1f} {ref.encode_s / r.encode_s:>6.2f} {ref.apply_s / r.apply_s:>6.2f}"
        )
    return "\n".join(lines)


def format_targets(targets: list[Target]) -> str:
    lines = ["Targets"]
    for t in targets:
        verdict = "PASS" if t.passed else "MISS"
        lines.append(f"  {verdict}  {t.name:<48} {fmt(t.measured, '.3f'):>7} <= {t.limit:<5g} [{t.input}]")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lrs", type=parse_floats, default=[1e-6, 3e-6, 1e-5], help="AdamW learning rates (comma list)")
    ap.add_argument(
        "--steps",
        type=parse_ints,
        default=[1, 8],
        help="update windows in optimizer steps (comma list): 1 = after step W vs W+1, K > 1 = after step 0 vs K",
    )
    ap.add_argument("--warmup", type=int, default=2, help="W: optimizer steps before the 1-step window")
    ap.add_argument("--densities", type=parse_floats, default=[0.001, 0.01, 0.05, 0.1], help="synthetic mask densities")
    ap.add_argument("--codecs", type=lambda s: s.split(","), default=list(CODECS), help=f"subset of {','.join(CODECS)}")
    ap.add_argument("--small", action="store_true", help="~7M-parameter model instead of ~122M (smoke run)")
    ap.add_argument(
        "--model",
        choices=sorted(MODEL_CONFIGS),
        default=None,
        help="model config (default: default, or small; tiny: the test suite's)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the states live (cuda: the GPU path; timings are then against a clone on the GPU, and the "
        "JSON rows also hold the time of a device-to-host copy of the patch's size)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=parse_ints,
        default=None,
        help="thread counts (comma list; torch.set_num_threads, which sizes pulseloco's codec pool): the table "
        "and targets use the largest, the random inputs are also measured at the others (scaling table); "
        "default: torch's choice",
    )
    ap.add_argument("--reps", type=int, default=3, help="timing repetitions; the median is reported")
    ap.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="leave glibc's malloc defaults (clone times then depend on page faults; see harness.memory.tune_malloc)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write rows and targets as JSON to PATH")
    return ap


def measure_real(args: argparse.Namespace, config_name: str, windows: list[tuple[int, int]]) -> list[Row]:
    """Every codec on the real updates: each learning rate's windows."""
    rows: list[Row] = []
    for lr in args.lrs:
        updates = real_updates(config_name, lr, windows, args.seed, args.device)
        for (s0, s1), (base, new) in updates.items():
            label = f"lr={lr:g} {s1 - s0}-step ({s0}->{s1})"
            meta = {"lr": lr, "start_step": s0, "end_step": s1}
            rows += measure_input(label, "real", base, new, args.codecs, args.reps, meta)
        del updates
    return rows


def measure_random(
    args: argparse.Namespace, shapes: dict[str, torch.Size], thread_counts: list[int]
) -> tuple[list[Row], list[Row]]:
    """Every codec on the synthetic updates at every thread count; returns the rows at the largest count (the
    table's) and all of them (the scaling table's)."""
    base_cpu = synthetic_base(shapes, args.seed + 2)
    base = to_device(base_cpu, args.device)
    rows: list[Row] = []
    scaling: list[Row] = []
    for i, p in enumerate(args.densities):
        new = to_device(synthetic_update(base_cpu, p, args.seed + 3 + i), args.device)
        for n in reversed(thread_counts):
            torch.set_num_threads(n)
            meta = {"target_density": p, "threads": n}
            measured = measure_input(f"random {100 * p:g}%", "random", base, new, args.codecs, args.reps, meta)
            scaling += measured
            if n == thread_counts[-1]:
                rows += measured
        del new
    torch.set_num_threads(thread_counts[-1])
    return rows, scaling


def print_report(
    args: argparse.Namespace,
    header: str,
    rows: list[Row],
    scaling: list[Row],
    thread_counts: list[int],
    targets: list[Target],
    load: tuple[float, float],
) -> None:
    """The header lines, the table, the scaling table (several thread counts) and the targets, on stdout."""
    print(header)
    print(f"1-step windows start after {args.warmup} warm-up AdamW steps; longer windows start at step 0.")
    print(
        f"Timing: median of {args.reps} runs, each right after {CLONES_PER_RUN} timed clones of the new BF16 "
        "state (torch.clone per tensor); *_x_clone = median time / median clone time."
    )
    print("B/elem = patch bytes per changed element; idx_vs_bound = index bytes / (n*H(p)/8).")
    print(
        "Timing targets use the larger of the median/median and min/min ratios "
        "(a stalled clone sample only flatters the median ratio)."
    )
    if max(load) > (os.cpu_count() or 1):
        print(
            f"WARNING: load average {max(load):.1f} exceeds {os.cpu_count()} CPUs: "
            "other processes were running; timing columns are unreliable (compare clone_ms across rows)."
        )
    print()
    print(format_table(rows))
    if len(thread_counts) > 1:
        print()
        print(format_scaling(scaling, thread_counts))
    print()
    print(format_targets(targets))


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    unknown = set(args.codecs) - set(CODECS)
    if unknown:
        ap.error(f"unknown codecs {sorted(unknown)}; choose from {','.join(CODECS)}")
    thread_counts = sorted(set(args.threads or [torch.get_num_threads()]))
    if thread_counts[0] < 1:
        ap.error("--threads must be positive")
    torch.set_num_threads(thread_counts[-1])
    malloc_tuned = not args.no_malloc_tuning and memory.tune_malloc()
    if any(c.startswith("pulseloco") for c in args.codecs):
        make_codec("pulseloco-abs")  # fail before the slow part if the library is missing

    config_name = args.model or ("small" if args.small else "default")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        ap.error(f"--device {args.device}: only cpu, or cuda where torch sees a CUDA GPU")
    t_start = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    shapes = {n: p.shape for n, p in build_model(config_name, args.seed).named_parameters()}
    num_params = sum(math.prod(s) for s in shapes.values())
    log(f"model={config_name} params={num_params} tensors={len(shapes)} threads={torch.get_num_threads()}")

    windows = sorted(
        {(args.warmup, args.warmup + 1) if k == 1 else (0, k) for k in args.steps}, key=lambda w: w[1] - w[0]
    )
    rows = measure_real(args, config_name, windows)
    random_rows, scaling = measure_random(args, shapes, thread_counts)
    rows += random_rows
    targets = evaluate_targets(rows)
    elapsed = time.perf_counter() - t_start
    header = (
        f"pulseloco codec benchmark: model={config_name} ({num_params / 1e6:.1f}M params, "
        f"BF16 {2 * num_params / 1e6:.1f} MB), device={args.device}, threads={torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f} (at start {load_at_start:.2f})\n"
        f"malloc tuned to keep freed memory: {malloc_tuned}"
    )
    print_report(args, header, rows, scaling, thread_counts, targets, (load_at_start, os.getloadavg()[0]))
    print(f"\nTotal time {elapsed:.0f}s")
    if args.json:
        out = {
            "config": {
                "model": config_name,
                "model_config": MODEL_CONFIGS[config_name],
                "num_params": num_params,
                "lrs": args.lrs,
                "windows": windows,
                "densities": args.densities,
                "seed": args.seed,
                "threads": torch.get_num_threads(),
                "thread_counts": thread_counts,
                "device": args.device,
                "reps": args.reps,
                "malloc_tuned": malloc_tuned,
                "batch_size": BATCH_SIZE,
                "seq_len": SEQ_LEN,
            },
            "rows": [asdict(r) for r in rows],
            "scaling": [asdict(r) for r in scaling],
            "targets": [asdict(t) for t in targets],
            "elapsed_s": elapsed,
            "load_average": {"start": load_at_start, "end": os.getloadavg()[0]},
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
