#!/usr/bin/env python
"""Measure the trainer's replay check of the rollout workers' sampling per engine and precision: the numerical
differences its tolerances must cover (:mod:`pulseloco.rollouts.tolerances`) and what it costs against a GRPO step.

    source .venv/bin/activate
    python scripts/bench_verify.py                     # the demo's warm model, every engine (~4 min on 2 cores)
    python scripts/bench_verify.py --engines transformers --prompts 64 --samples 8
    python scripts/bench_verify.py --model_name_or_path DIR --max-new-tokens 64

What it does: loads the model (default: the demo's warm model, ``scripts/warm_model.py --size demo``) as a rollout
worker would (BF16 weights; transformers in BF16 and in FP32, vLLM in BF16 and in FP32 on the same BF16 values) and
as a trainer does (FP32), has each engine sample ``--samples`` completions of ``--prompts`` arithmetic problems with
the replayable rule (:mod:`pulseloco.rollouts.sampling`, one lease seed), then runs the trainer's check
(:class:`pulseloco.rollouts.verify.RolloutVerifier`, with the version's weights) on them with the tolerances of
the engine's precision, every gap recorded. Reported per engine: positions, positions whose token is not the
trainer's perturbed argmax, the largest gap and the margin, the near misses and positions per band of spread (the
near-miss guard's rates), the mean and largest per-token log-probability error,
whether the lease passed; then the check's seconds against a GRPO step on the same batch (a forward and backward
pass of the trainer's model over it, as TRL's loss does, plus TRL's own no-gradient forward for the old
log-probabilities when importance sampling is on).

Output: a table on stdout and ``bench_verify.json`` / ``.md`` in ``--out`` (default: a new folder under
``experiments/benchmarks/results/``). Bad flags exit 2 with argparse's one line; a warm model that cannot be built
raises RuntimeError; the engines' errors pass through."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness.models import warm_model_dir
from harness.report import default_out, md_table, write_report

from pulseloco.recipes import tasks
from pulseloco.rollouts.client import GroupResult
from pulseloco.rollouts.tolerances import precision_of
from pulseloco.rollouts.verify import RolloutVerifier, stop_ids
from pulseloco.rollouts.verify_config import VerifyConfig
from pulseloco.rollouts.version_states import VersionStates

ENGINES = ("transformers", "transformers-fp32", "vllm-bf16", "vllm-fp32")


def make_engine(name: str, model: str, device: str) -> Any:
    """A rollout engine of ``ENGINES`` on ``model`` (transformers in BF16 on ``device``; vLLM in BF16 or FP32).
    Raises ImportError where the engine's library is missing."""
    if name.startswith("transformers"):
        from pulseloco.rollouts.engines.hf import TransformersEngine

        dtype = torch.float32 if name == "transformers-fp32" else torch.bfloat16
        return TransformersEngine.from_pretrained(model, device=device, dtype=dtype)
    from pulseloco.rollouts.engines.vllm import VLLMEngine

    return VLLMEngine.from_pretrained(model, dtype="bfloat16" if name == "vllm-bf16" else "float32", max_model_len=128)


def sample(engine: Any, prompts: list[list[int]], samples: int, args: argparse.Namespace) -> list[GroupResult]:
    """One lease's worth: ``samples`` completions of each prompt, prompt-major, as a worker answers a lease (in
    the engine's compute dtype)."""
    repeated = [p for p in prompts for _ in range(samples)]
    completions = engine.generate_ids(
        repeated, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed
    )
    results = []
    for g in range(len(prompts)):
        mine = completions[g * samples : (g + 1) * samples]
        results.append(
            GroupResult(
                0,
                "",
                [c.token_ids for c in mine],
                [c.logprobs for c in mine],
                "w",
                "lease",
                args.seed,
                g * samples,
                compute_dtype=engine.compute_dtype,
            )
        )
    return results


def step_seconds(model: Any, prompts: list[list[int]], results: list[GroupResult], repeats: int = 3) -> float:
    """A GRPO step's compute on this batch: TRL's no-gradient forward (old log-probabilities) plus a forward and
    backward pass, the fastest of ``repeats``."""
    rows = [p + c for p, r in zip(prompts, results) for c in r.completion_ids]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        loss = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def synchronize(device: torch.device | str) -> None:
    """Wait for the GPU's queued work on a CUDA ``device`` (nothing on a CPU), so that timings are whole."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def quantile(values: list[float], q: float) -> float:
    """The value at index ``int(q * n)`` of the sorted ``values`` (the last one at most); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags; exits 2 with one line for unknown engines, counts below one or a device torch cannot use."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model_name_or_path", default=None, help="a Hugging Face model directory (default: demo)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=4, help="the demo's max_completion_length")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu", help="the transformers worker's device (cpu, cuda)")
    ap.add_argument("--trainer-device", default=None, help="the trainer's replay device (default: --device)")
    ap.add_argument(
        "--out", type=Path, default=None,
        help="where bench_verify.json and .md go (default: a new folder experiments/benchmarks/results/"
        "bench-verify-ENGINES-STAMP, named after the engines and start time)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown or not args.engines or args.prompts < 1 or args.samples < 1 or args.max_new_tokens < 1:
        ap.error(f"--engines must name some of {', '.join(ENGINES)}; counts must be positive (got {unknown or ''})")
    args.trainer_device = args.trainer_device or args.device
    if args.out is None:
        engines = "all" if args.engines == list(ENGINES) else "_".join(args.engines)
        args.out = default_out("benchmarks", f"bench-verify-{engines}-{args.device}")
    for flag, device in (("--device", args.device), ("--trainer-device", args.trainer_device)):
        if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
            ap.error(f"{flag} {device}: only cpu, or cuda where torch sees a CUDA GPU")
    return args


def load_trainer(model_dir: str, device: str) -> Any:
    """The trainer's model: FP32 holding the BF16-rounded values a worker serves."""
    from pulseloco.models import load_causal_lm

    trainer = load_causal_lm(model_dir, dtype=torch.float32, device=device)
    with torch.no_grad():
        for p in trainer.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return trainer


def measure(
    name: str, model_dir: str, trainer: Any, prompts: list[list[int]], stops: set[int], args: argparse.Namespace
) -> dict[str, Any]:
    """One engine's row: its samples checked by the trainer's check with the weights of their version (the BF16
    values the trainer holds) and the tolerances of the engine's precision, every gap recorded; the gaps'
    statistics, the near misses per position in each band of spread (the guard's rates), the largest
    log-probability error, whether the lease passed, and the check's seconds against a GRPO step's."""
    engine = make_engine(name, model_dir, args.device)
    try:
        results = sample(engine, prompts, args.samples, args)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    states = VersionStates(None, "bench", None, {}, keep=1)
    states.add(0, {n: t.detach().to(torch.bfloat16).clone() for n, t in trainer.state_dict().items()})
    verifier = RolloutVerifier(
        VerifyConfig(verify_weights="version"), states=states, states_wait=0.0, record_gaps=True, seed=0
    )
    synchronize(args.trainer_device)
    started = time.perf_counter()
    leases = verifier.check(
        trainer, prompts, results, temperature=args.temperature, max_new_tokens=args.max_new_tokens, stop_ids=stops
    )
    check_s = time.perf_counter() - started
    gaps = verifier.gaps or []
    step_s = step_seconds(trainer, prompts, results)
    lease = next(iter(leases.values()))
    tolerance = lease.tolerance
    off = [g for g in gaps if g > 0]
    return {
        "engine": name,
        "precision": precision_of(results[0].compute_dtype, next(trainer.parameters()).dtype),
        "positions": len(gaps),
        "differ": len(off),
        "differ_rate": len(off) / max(len(gaps), 1),
        "max_gap": max(off, default=0.0),
        "p99_gap": quantile(off, 0.99),
        "margin": tolerance.margin if tolerance else None,
        "bands": list(tolerance.bands) if tolerance else [],
        "band_positions": lease.band_positions,
        "band_near": lease.band_near,
        "band_rates": [near / max(n, 1) for n, near in zip(lease.band_positions, lease.band_near)],
        "mean_logprob_error": lease.logprob_error,
        "max_logprob_error": lease.max_logprob_error,
        "passed": lease.reason is None,
        "reason": lease.reason,
        "check_seconds": check_s,
        "step_seconds": step_s,
        "check_over_step": check_s / step_s,
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The engines' rows as the markdown table printed and written to ``bench_verify.md``."""
    header = ["engine", "precision", "positions", "not the replay's argmax", "largest gap (margin)",
              "near misses / positions by spread band (upper edges)", "logprob error mean / max", "passed",
              "check s", "step s", "check / step"]  # fmt: skip
    cells = [
        [r["engine"], r["precision"], str(r["positions"]), f"{r['differ']} ({r['differ_rate']:.2%})",
         f"{r['max_gap']:.4f} ({r['margin']:g})",
         ", ".join(f"{k}/{n} ({e:g})" for k, n, e in zip(r["band_near"], r["band_positions"], r["bands"])),
         f"{r['mean_logprob_error']:.4f} / {r['max_logprob_error']:.4f}", "yes" if r["passed"] else "no",
         f"{r['check_seconds']:.3f}", f"{r['step_seconds']:.3f}", f"{r['check_over_step']:.1%}"]
        for r in rows
    ]  # fmt: skip
    return md_table(header, cells)


def main(argv: list[str] | None = None) -> int:
    """Measure every engine of ``--engines``, print each row as JSON and then the table, and write both files."""
    args = parse_args(argv)
    torch.manual_seed(0)
    model_dir = args.model_name_or_path or str(warm_model_dir("demo"))
    from pulseloco.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    trainer = load_trainer(model_dir, args.trainer_device)
    spec = tasks.spec_for_model(model_dir, None, None)
    problems = tasks.make_problems(spec, args.prompts, seed=args.seed)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in problems]
    rows = []
    for name in args.engines:
        rows.append(measure(name, model_dir, trainer, prompts, stop_ids(tokenizer, trainer), args))
        print(json.dumps(rows[-1]), flush=True)
    table = markdown_table(rows)
    print(table)
    meta = {
        "model": model_dir,
        "device": args.device,
        "trainer_device": args.trainer_device,
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
    }
    write_report(args.out, "bench_verify", argv, meta, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
