#!/usr/bin/env python
"""Measure what dishonest rollout workers achieve against the trainer's check, on the demo's task and model.

    source .venv/bin/activate
    python experiments/attacks/bench_attacks.py                        # every attack, 6 leases each (~5 min on 2 cores)
    python experiments/attacks/bench_attacks.py --attacks steer-right,forged-within --leases 3

What it does: loads the demo's warm model (``scripts/warm_model.py --size demo``; ``--model_name_or_path``) as the
trainer holds it (FP32 holding the published BF16 values: the version's weights, which are also its current ones)
and as a worker serves it (BF16). Each attack is one worker answering ``--leases`` leases of ``--prompts`` addition
problems x ``--samples`` completions (the demo's batch), each lease with its own seed, checked in order by one
:class:`pulseloco.rollouts.verify.RolloutVerifier` (the default shared check, with its near-miss guard) until
the worker would be refused: a lease that fails counts toward ``--max-refusals`` (the recipes' default), a lease
the guard refuses ends it at once. The honest engine's completions of the same seeds, in the precision the attack
declares, are the reference. Attacks:

- ``honest`` / ``honest-fp32``: the transformers engine in BF16 / in FP32 (false refusals: none expected);
- ``steer-wrong`` / ``steer-right``: at each position, of the tokens whose perturbed score trails the sampler's
  choice by less than 95% of the declared precision's margin, take one that leaves / continues the right answer
  (true log-probabilities; ``-fp32``: declaring FP32, whose margin is 1e-3 nats);
- ``steer-right-narrow``: the same within 95% of the two narrowest bands of spread only (0.02 nats in BF16: where
  rounding flips choices most);
- ``cherry-pick``: the most rewarded of four samples drawn with seeds of its own;
- ``noisy-weights``: samples with the served weights times (1 + 0.1 N(0, 1));
- ``forged-within``: honest tokens, every log-probability lowered by 90% of the per-token tolerance (the rest
  left for the engine's own error).

Reported per attack: the declared precision, leases answered, the lease at which the worker is refused (and why), the
leases it was on probation and the completions held back then (groups with a near miss, generated again by others),
the share of its completions that passed before (what reaches the trained batch), among those the share that are not the
honest sample and the share whose reward differs from the honest sample's (with the mean reward change), and the largest
change to the importance-sampling ratio's denominators (the log-probabilities handed on, against the honest lease's).
Output: a table on stdout and ``bench_attacks.json`` / ``.md`` in ``--out`` (default: a new folder under
``experiments/attacks/results/``). Bad flags exit 2 with argparse's one line; the engines' errors pass through."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

import torch
from harness.models import warm_model_dir
from harness.report import default_out, md_table, write_report
from steering import steer

from pulseloco.recipes import tasks
from pulseloco.rollouts.client import GroupResult
from pulseloco.rollouts.engines.hf import Completion, TransformersEngine
from pulseloco.rollouts.tolerances import TOLERANCES
from pulseloco.rollouts.verify import RolloutVerifier, stop_ids
from pulseloco.rollouts.verify_config import VerifyConfig
from pulseloco.rollouts.version_states import VersionStates

ATTACKS = (
    "honest",
    "honest-fp32",
    "steer-wrong",
    "steer-right",
    "steer-right-narrow",
    "steer-right-fp32",
    "cherry-pick",
    "noisy-weights",
    "forged-within",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags; exits 2 with one line for unknown attacks or counts below one."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model_name_or_path", default=None, help="a Hugging Face model directory (default: demo)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    ap.add_argument("--leases", type=int, default=6, help="leases each worker answers at most")
    ap.add_argument("--prompts", type=int, default=32, help="problems per lease (the demo's batch: 32)")
    ap.add_argument("--samples", type=int, default=8, help="completions per problem (the demo's: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=4, help="the demo's max_completion_length")
    ap.add_argument("--max-refusals", type=int, default=3, help="failed leases before a worker is refused")
    ap.add_argument(
        "--out", type=Path, default=None,
        help="where bench_attacks.json and .md go (default: a new folder experiments/attacks/results/"
        "ATTACKS-LEASES-STAMP, named after the attacks, leases and start time)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in args.attacks if a not in ATTACKS]
    if unknown or not args.attacks or min(args.leases, args.prompts, args.samples, args.max_new_tokens) < 1:
        ap.error(f"--attacks must name some of {', '.join(ATTACKS)}; counts must be positive (got {unknown or ''})")
    if args.out is None:
        attacks = "all" if args.attacks == list(ATTACKS) else "_".join(args.attacks)
        args.out = default_out("attacks", f"{attacks}-{args.leases}leases")
    return args


class Task:
    """The demo's problems as a worker sees them (prompt ids) and as the trainer scores them (answers)."""

    def __init__(self, model_dir: str, tokenizer: Any) -> None:
        self.spec = tasks.spec_for_model(model_dir, None, None)
        self.tokenizer = tokenizer
        self.eos = int(tokenizer.eos_token_id)

    def lease(self, num: int, seed: int) -> tuple[list[list[int]], list[str]]:
        problems = tasks.make_problems(self.spec, num, seed=seed)
        prompts = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in problems]
        return prompts, [a for _, a in problems]

    def rewards(self, completions: list[Completion], answers: list[str]) -> list[float]:
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        return tasks.exact_match_reward(texts, answers)

    def right(self, answer: str) -> list[int]:
        """The token ids of the right completion: the answer, then the end-of-sequence token."""
        return [*self.tokenizer(answer, add_special_tokens=False)["input_ids"], self.eos]


def toward_answers(targets: list[list[int]], toward: bool) -> Any:
    """A steering worker's pick: of the close tokens, one that continues the right completion ``targets[row]``
    (``toward``), or one that does not where the sampler's choice would (not ``toward``); else the choice."""

    def choose(row: int, ids: list[int], close: list[int]) -> int:
        target = targets[row]
        wanted = target[len(ids)] if ids == target[: len(ids)] and len(ids) < len(target) else None
        if toward and wanted in close:
            return int(wanted)  # type: ignore[arg-type]
        if not toward and close[0] == wanted and len(close) > 1:
            return close[1]
        return close[0]

    return choose


def generate(attack: str, engines: dict[str, Any], task: Task, prompts: list[list[int]], answers: list[str],
             seed: int, args: argparse.Namespace) -> tuple[list[Completion], str]:  # fmt: skip
    """The attack's completions of ``prompts`` (each repeated ``--samples`` times, sequence ``i`` for row ``i``)
    under the lease's ``seed``, and the precision it declares."""
    repeated = [p for p in prompts for _ in range(args.samples)]
    options = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "seed": seed}
    if attack in ("honest", "forged-within"):
        out = engines["bf16"].generate_ids(repeated, **options)
        if attack == "forged-within":
            lower = 0.9 * TOLERANCES["bfloat16"].logprob_error
            out = [Completion(c.token_ids, [lp - lower for lp in c.logprobs]) for c in out]
        return out, "bfloat16"
    if attack == "honest-fp32":
        return engines["fp32"].generate_ids(repeated, **options), "float32"
    if attack == "noisy-weights":
        return engines["noisy"].generate_ids(repeated, **options), "bfloat16"
    targets = [task.right(a) for a in answers for _ in range(args.samples)]
    if attack == "cherry-pick":
        draws = [engines["bf16"].generate_ids(repeated, **{**options, "seed": 10_000 + seed * 4 + k}) for k in range(4)]
        rewards = [task.rewards(d, [a for a in answers for _ in range(args.samples)]) for d in draws]
        picks = [max(range(4), key=lambda k, i=i: rewards[k][i]) for i in range(len(repeated))]
        return [draws[k][i] for i, k in enumerate(picks)], "bfloat16"
    precision = "float32" if attack.endswith("-fp32") else "bfloat16"
    tolerance = TOLERANCES[precision]
    aim = 0.95 * (tolerance.bands[1] if attack.endswith("-narrow") else tolerance.margin)
    model = engines["fp32" if precision == "float32" else "bf16"].model
    toward = attack.startswith("steer-right")
    choose = toward_answers(targets, toward)
    return steer(model, repeated, aim=aim, choose=choose, seed=seed, sequences=None, max_new_tokens=args.max_new_tokens,
                 temperature=1.0, eos=task.eos), precision  # fmt: skip


def run_attack(attack: str, engines: dict[str, Any], trainer: Any, task: Task, args: argparse.Namespace) -> dict:
    """One worker answering leases until refused: the row of the table."""
    states = VersionStates(None, "bench", None, {}, keep=1)
    states.add(0, {n: t.detach().to(torch.bfloat16).clone() for n, t in trainer.state_dict().items()})
    verifier = RolloutVerifier(VerifyConfig(), states=states, states_wait=0.0, seed=0)
    reference = RolloutVerifier(VerifyConfig(), states=states, states_wait=0.0, seed=0)
    stops = stop_ids(task.tokenizer, trainer)
    failed, refused_at, reason = 0, None, None
    answered = passed = differ = changed = held_back = probation_leases = 0
    reward_change = 0.0
    worst_ratio_change = 0.0
    started = time.perf_counter()
    for lease in range(1, args.leases + 1):
        seed = 1000 + lease
        prompts, answers = task.lease(args.prompts, seed)
        mine, precision = generate(attack, engines, task, prompts, answers, seed, args)
        honest = engines["fp32" if precision == "float32" else "bf16"].generate_ids(
            [p for p in prompts for _ in range(args.samples)], max_new_tokens=args.max_new_tokens, temperature=1.0,
            seed=seed,
        )  # fmt: skip
        checks = verifier.check(trainer, prompts, results(mine, prompts, args.samples, seed, precision),
                                temperature=1.0, max_new_tokens=args.max_new_tokens, stop_ids=stops)  # fmt: skip
        check = checks[f"lease-{seed}"]
        answered += len(mine)
        if check.reason is not None:
            failed += 1
            reason = check.reason
            if check.refuse is not None or failed >= args.max_refusals:
                refused_at = lease
                break
            continue
        # on probation, the groups with a near miss are generated again (by others), not trained on
        probation_leases += check.probation
        kept = [i for i in range(len(mine)) if i // args.samples not in check.held_back]
        held_back += len(mine) - len(kept)
        passed += len(kept)
        every = [a for a in answers for _ in range(args.samples)]
        mine_rewards, honest_rewards = task.rewards(mine, every), task.rewards(honest, every)
        differ += sum(mine[i].token_ids != honest[i].token_ids for i in kept)
        changed += sum(mine_rewards[i] != honest_rewards[i] for i in kept)
        reward_change += sum(mine_rewards[i] - honest_rewards[i] for i in kept)
        reference.check(trainer, prompts, results(honest, prompts, args.samples, seed, precision), temperature=1.0,
                        max_new_tokens=args.max_new_tokens, stop_ids=stops)  # fmt: skip
        for i, (a, b) in enumerate(zip(mine, honest)):
            prompt = prompts[i // args.samples]
            handed, truth = verifier.sampling_logps(prompt, a.token_ids), reference.sampling_logps(prompt, b.token_ids)
            if a.token_ids == b.token_ids and handed is not None and truth is not None:
                worst_ratio_change = max(worst_ratio_change, max(abs(x - y) for x, y in zip(handed, truth)))
        verifier.clear_shared()
        reference.clear_shared()
    return {
        "attack": attack,
        "precision": precision,
        "leases": lease,
        "refused_at": refused_at,
        "reason": reason,
        "completions": answered,
        "passed": passed,
        "passed_share": passed / max(answered, 1),
        "held_back": held_back,
        "held_back_share": held_back / max(answered, 1),
        "probation_leases": probation_leases,
        "differ_share": differ / max(passed, 1),
        "reward_changed_share": changed / max(passed, 1),
        "reward_change_mean": reward_change / max(passed, 1),
        "worst_logprob_change": worst_ratio_change,
        "near_misses": verifier.stats.near,
        "positions": verifier.stats.positions,
        "seconds": time.perf_counter() - started,
    }


def results(completions: list[Completion], prompts: list[list[int]], samples: int, seed: int,
            precision: str) -> list[GroupResult]:  # fmt: skip
    """One lease's replies as the trainer's client hands them on."""
    return [
        GroupResult(
            0,
            "d",
            [c.token_ids for c in completions[g * samples : (g + 1) * samples]],
            [c.logprobs for c in completions[g * samples : (g + 1) * samples]],
            "worker",
            f"lease-{seed}",
            seed,
            g * samples,
            compute_dtype=precision,
        )
        for g in range(len(prompts))
    ]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = ["attack", "declares", "refused at lease", "leases on probation", "held back on probation",
              "completions passed before", "of them not the honest sample", "rewards changed (mean change)",
              "largest change to the ratio's log-probabilities", "why"]  # fmt: skip
    cells = [
        [r["attack"], r["precision"], str(r["refused_at"] or f"not in {r['leases']}"), str(r["probation_leases"]),
         f"{r['held_back']} ({r['held_back_share']:.1%})",
         f"{r['passed']} of {r['completions']} ({r['passed_share']:.0%})", f"{r['differ_share']:.2%}",
         f"{r['reward_changed_share']:.2%} ({r['reward_change_mean']:+.3f})", f"{r['worst_logprob_change']:.2g}",
         (r["reason"] or "")[:90]]
        for r in rows
    ]  # fmt: skip
    return md_table(header, cells)


def main(argv: list[str] | None = None) -> int:
    """Run every attack of ``--attacks``, print each row as JSON and then the table, and write both files."""
    args = parse_args(argv)
    torch.manual_seed(0)
    model_dir = args.model_name_or_path or str(warm_model_dir("demo"))
    bf16 = TransformersEngine.from_pretrained(model_dir, dtype=torch.bfloat16)
    fp32 = TransformersEngine(copy.deepcopy(bf16.model).float(), bf16.tokenizer)
    noisy_model = copy.deepcopy(bf16.model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noisy_model.parameters():
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    engines = {"bf16": bf16, "fp32": fp32, "noisy": TransformersEngine(noisy_model, bf16.tokenizer)}
    trainer = copy.deepcopy(fp32.model)  # FP32 holding the published BF16 values
    task = Task(model_dir, bf16.tokenizer)
    rows = []
    for attack in args.attacks:
        rows.append(run_attack(attack, engines, trainer, task, args))
        print(json.dumps(rows[-1]), flush=True)
    table = markdown_table(rows)
    print(table)
    meta = {
        "model": model_dir,
        "leases": args.leases,
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
    }
    write_report(args.out, "bench_attacks", argv, meta, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
