#!/usr/bin/env python
"""One Byzantine trainer in a PULSELoCo group of four: the honest peers' consensus loss with and without it, under the
outlier screen alone (rule ``screen``, no clipping) and under clipping to the median norm with repeat-outlier exclusion
(``clip``; ``clip-only`` without exclusion).

Starts a bootstrap hivemind DHT on 127.0.0.1 and, for every (rule, attack) configuration, four peer processes (each its
own DHT node) that train the same small Llama (:func:`harness.models.llama`, seed 0) on the project's arithmetic task
(:mod:`pulseloco.recipes.tasks`: ``a+b=`` with operands 0..99, the byte-level tokenizer of
:mod:`pulseloco.recipes.pretrain`; every peer draws its own problems) through :class:`pulseloco.PulseLoCo` (the pulse
selector, H = ``--inner-steps``, every round formed by all four), for ``--rounds`` outer rounds. Peer 0 measures the
consensus theta after every round: the cross-entropy of the answer and end-of-sequence tokens of 256 held-out problems
(:func:`pulseloco.recipes.tasks.eval_problems`).

With an attack, peer 3 trains honestly but sends, instead of its selection (``experiments/byzantine/byzantine.py``):
``flip`` its selection sign-flipped, ``fixed`` one fixed random direction, ``noise`` fresh Gaussian noise, each at
``--factor`` (9) times the norm of the selection it replaces (``flip@3``: at 3x, under the strike ratio: never
excluded). Rules:

- ``screen``: ``clip_to_median=False, dispute_rounds=0``: a part is refused only above ``max_norm_ratio`` (10) times
  the others' median norm;
- ``clip``: the defaults (each part clipped to its shard's median norm; a peer striking in most of its last 8 rounds
  excluded);
- ``clip-only``: clipping without exclusion (``dispute_rounds=0``), the per-round bound alone.

The table gives, per run, the held-out loss before and after, the reduction, and the reduction relative to the run
without an attacker under the same rule (the target: at least 0.5 with the ``clip`` rule), the round from which the
honest owners stopped counting the attacker, and whether any honest peer was ever excluded (disputed).

    .venv/bin/python experiments/byzantine/bench_byzantine.py             # every rule and attack: ~15 minutes
    .venv/bin/python experiments/byzantine/bench_byzantine.py --out DIR   # and DIR/README.md + bench_byzantine.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

import byzantine
import torch
from harness import machine, models, procs
from harness.report import md_table

NUM_PEERS = 4
ATTACKER = 3
RULES = ("screen", "clip", "clip-only")
EVAL_PROBLEMS = 256
_log = logging.getLogger("bench_byzantine")


def parse_attack(text: str, default_factor: float) -> tuple[str, float]:
    """``"flip"`` or ``"flip@3"`` -> (attack, factor); raises ValueError for an unknown attack or a bad factor."""
    name, _, factor = text.partition("@")
    if name not in byzantine.ATTACKS:
        raise ValueError(f"attack must be one of {', '.join(byzantine.ATTACKS)} (optionally @FACTOR), got {text!r}")
    value = float(factor) if factor else default_factor
    if not value > 0:
        raise ValueError(f"attack factor must be positive, got {text!r}")
    return name, value


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    """The Llama every peer trains (seed 0: the same initial weights everywhere)."""
    return models.llama(
        vocab_size=258,  # the byte-level tokenizer: 256 bytes, end-of-sequence, pad
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        max_position_embeddings=args.seq_len,
    )


def encode(tokenizer: Any, problems: list[tuple[str, str]], seq_len: int) -> dict[str, torch.Tensor]:
    """``prompt + answer + <eos>`` padded to ``seq_len`` (one token a byte); labels on the answer and the
    end-of-sequence token only."""
    texts = [prompt + answer + tokenizer.eos_token for prompt, answer in problems]
    batch = tokenizer(texts, padding="max_length", max_length=seq_len, truncation=True, return_tensors="pt")
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    for row, (prompt, _) in enumerate(problems):
        labels[row, : len(prompt.encode())] = -100
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}


def averaging_config(rule: str, args: argparse.Namespace) -> Any:
    """The :class:`AveragingConfig` of ``rule`` (module docstring)."""
    from pulseloco.loco import AveragingConfig

    return AveragingConfig(
        target_group_size=NUM_PEERS,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        request_timeout=10.0,
        clip_to_median=rule != "screen",
        **({"dispute_rounds": 0} if rule != "clip" else {}),
    )


def run_peer(
    index: int, args: argparse.Namespace, rule: str, attack: str | None, initial_peers: list[str], workdir: str
) -> None:
    """One peer: join, train ``args.rounds`` outer rounds (peer 0 also evaluates every round), write its files."""
    procs.own_hivemind_locks()  # a fork of the benchmark's process, which imported hivemind
    logging.basicConfig(level=logging.ERROR, format=f"peer{index} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    import hivemind

    from pulseloco import PulseLoCo
    from pulseloco.loco import RoundConfig
    from pulseloco.recipes import tasks
    from pulseloco.recipes.pretrain import byte_level_tokenizer

    out = Path(workdir)
    spec = tasks.TaskSpec(task="add", max_operand=99)
    tokenizer = byte_level_tokenizer()
    held_out = encode(tokenizer, tasks.eval_problems(spec, EVAL_PROBLEMS), args.seq_len)
    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    model = make_model(args)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, weight_decay=0.0)
    opt = PulseLoCo(
        model,
        inner,
        dht=dht,
        run_id=f"byzantine-{rule}-{attack or 'none'}".replace("@", "x").replace(".", "p"),
        round_config=RoundConfig(inner_steps=args.inner_steps),
        averaging_config=averaging_config(rule, args),
        metrics_path=out / f"peer{index}.jsonl",
    )
    if attack is not None and index == ATTACKER:
        name, factor = parse_attack(attack, args.factor)
        byzantine.install(opt, name, factor=factor, seed=args.seed)
    curve: list[float] = []

    def evaluate(*_: Any) -> None:
        with torch.no_grad():
            curve.append(float(model(**held_out).loss))

    if index == 0:
        evaluate()
        opt.add_round_listener(evaluate)
    step = 0
    while opt.round < args.rounds:
        problems = tasks.make_problems(spec, args.batch, seed=args.seed * 1_000_003 + 7919 * index + step)
        loss = model(**encode(tokenizer, problems, args.seq_len)).loss
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        step += 1
    final = {"peer_id": opt.peer_id, "distrusted": list(opt.averager.distrusted_peers()) if opt.averager else []}
    if index == 0:
        final["eval_loss"] = curve
    (out / f"peer{index}.json").write_text(json.dumps(final))
    time.sleep(3.0)  # let slower peers finish fetching from this one
    opt.shutdown()
    dht.shutdown()


def run_config(
    args: argparse.Namespace, rule: str, attack: str | None, initial_peers: list[str], workdir: Path
) -> dict:
    """Run the four peers of one configuration to the end and summarize them. Exits (SystemExit) when a peer fails
    or runs past ``--timeout`` (the others are killed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("fork")
    peers = [
        ctx.Process(target=run_peer, args=(i, args, rule, attack, initial_peers, str(workdir)))
        for i in range(NUM_PEERS)
    ]
    start = time.monotonic()
    for peer in peers:
        peer.start()
    try:
        procs.join_all(peers, args.timeout, f"peer of rule={rule} attack={attack}")
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    return summarize(workdir, rule, attack, time.monotonic() - start)


def summarize(workdir: Path, rule: str, attack: str | None, seconds: float) -> dict[str, Any]:
    """One run's row: held-out loss curve of the consensus, when the attacker stopped being counted, exclusions."""
    from pulseloco.jsonl import read_json_lines

    finals = [json.loads((workdir / f"peer{i}.json").read_text()) for i in range(NUM_PEERS)]
    records = [read_json_lines(workdir / f"peer{i}.jsonl") for i in range(NUM_PEERS)]
    honest = range(NUM_PEERS) if attack is None else [i for i in range(NUM_PEERS) if i != ATTACKER]
    honest_ids = {finals[i]["peer_id"] for i in honest}
    curve = finals[0]["eval_loss"]
    digests: dict[int, set[str]] = {}
    for i in honest:
        for r in records[i]:
            digests.setdefault(r["round"], set()).add(r["theta_digest"])
    # peer 0's view: the first round from which every shard counted only the honest peers (3 contributors)
    excluded_from = None
    if attack is not None:
        counted = [r["num_contributors"] for r in records[0]]
        for k in range(len(counted)):
            if all(c == NUM_PEERS - 1 for c in counted[k:]):
                excluded_from = records[0][k]["round"]
                break
    return {
        "rule": rule,
        "attack": attack,
        "rounds": len(records[0]),
        "loss_initial": curve[0],
        "loss_final": curve[-1],
        "reduction": curve[0] - curve[-1],
        "eval_loss": curve,
        "honest_equal_digests": all(len(d) == 1 for d in digests.values()),
        "attacker_not_counted_from_round": excluded_from,
        "honest_disputed": sorted({p for i in honest for p in finals[i]["distrusted"]} & honest_ids),
        "disputed_by_honest": sorted({p for i in honest for p in finals[i]["distrusted"]}),
        "largest_owner_norm_ratio": max(
            (r.get("largest_norm_ratio", 0.0) for i in honest for r in records[i]), default=0.0
        ),
        # per honest owner and round: the largest ratio of an accepted part's norm to its shard's median
        "owner_norm_ratios": [r.get("largest_norm_ratio", 0.0) for i in honest for r in records[i]],
        "num_rejected": sum(r["num_rejected"] for i in honest for r in records[i]),
        "seconds": seconds,
    }


CHECKPOINTS = (5, 10)
"""Rounds after which the table also compares the loss reduction (the attacker is excluded after five at most)."""


def add_relative(results: list[dict[str, Any]]) -> None:
    """``relative``: each run's loss reduction over its rule's run without an attacker (``clip-only``: ``clip``'s
    when it has none of its own; None without one); ``relative_at``: the same after each of :data:`CHECKPOINTS`
    rounds."""
    baseline = {r["rule"]: r for r in results if r["attack"] is None}
    for r in results:
        base = baseline.get(r["rule"], baseline.get("clip") if r["rule"] == "clip-only" else None)
        r["relative"] = r["reduction"] / base["reduction"] if base and base["reduction"] else None
        r["relative_at"] = {}
        for k in CHECKPOINTS:
            if base is not None and k < len(r["eval_loss"]) and k < len(base["eval_loss"]):
                base_k = base["eval_loss"][0] - base["eval_loss"][k]
                r["relative_at"][k] = (r["eval_loss"][0] - r["eval_loss"][k]) / base_k if base_k else None


def format_table(results: list[dict[str, Any]], factor: float) -> str:
    """The markdown table of the README."""
    rows = []
    for r in results:
        attack = "none (4 honest)"
        if r["attack"] is not None:
            name, at = parse_attack(r["attack"], factor)
            attack = f"{name} @{at:g}x"
        relative = "1 (reference)" if r["attack"] is None else "-" if r["relative"] is None else f"{r['relative']:.2f}"
        early = ["-" if r["attack"] is None or r["relative_at"].get(k) is None else f"{r['relative_at'][k]:.2f}"
                 for k in CHECKPOINTS]  # fmt: skip
        excluded = r["attacker_not_counted_from_round"]
        rows.append(
            [
                attack,
                r["rule"],
                f"{r['loss_initial']:.3f}",
                f"{r['loss_final']:.3f}",
                f"{r['reduction']:+.3f}",
                *early,
                relative,
                "-" if r["attack"] is None else ("never" if excluded is None else str(excluded)),
                ", ".join(p[-6:] for p in r["honest_disputed"]) or "none",
                "yes" if r["honest_equal_digests"] else "NO",
            ]
        )
    header = [
        "attacker (peer 3)",
        "rule",
        "loss before",
        "loss after",
        "reduction",
        *(f"vs no attacker after {k}" for k in CHECKPOINTS),
        "vs no attacker at the end",
        "attacker not counted from round",
        "honest peers disputed",
        "honest digests equal",
    ]
    return md_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="outer rounds per run")
    parser.add_argument("--inner-steps", type=int, default=8, help="H")
    parser.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW learning rate of the inner steps")
    parser.add_argument("--batch", type=int, default=32, help="problems per inner step and peer")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=12, help="tokens per problem (99+99=198 and eos: 10)")
    parser.add_argument("--rules", default=",".join(RULES), help=f"comma list of {', '.join(RULES)}")
    parser.add_argument(
        "--attacks", default="flip,fixed,noise", help="comma list of flip, fixed, noise, each optionally @FACTOR"
    )
    parser.add_argument("--factor", type=float, default=9.0, help="attack norm over the honest selection's")
    parser.add_argument("--seed", type=int, default=0, help="data seed (and the attacker's directions)")
    parser.add_argument("--matchmaking-time", type=float, default=15.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", metavar="DIR", help="write README.md (the table) and bench_byzantine.json there")
    args = parser.parse_args(argv)
    rules = [r for r in args.rules.split(",") if r]
    attacks = [a for a in args.attacks.split(",") if a]
    for rule in rules:
        if rule not in RULES:
            parser.error(f"--rules: {rule!r} is not one of {', '.join(RULES)}")
    for attack in attacks:
        try:
            parse_attack(attack, args.factor)
        except ValueError as exc:
            parser.error(f"--attacks: {exc}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    import hivemind

    make_model(args)  # import the model code before forking
    with torch.device("meta"):
        numel = sum(p.numel() for p in make_model(args).parameters())
    print(f"model: Llama {numel / 1e3:.0f}k parameters; {NUM_PEERS} peers on loopback", file=sys.stderr)
    boot = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    results: list[dict[str, Any]] = []
    started = datetime.datetime.now(datetime.UTC)
    try:
        initial_peers = [str(a) for a in boot.get_visible_maddrs()]
        with tempfile.TemporaryDirectory() as tmp:
            for rule in rules:
                # without an attacker clip-only is clip (nothing is excluded): its reference is clip's run
                baseline: list[str | None] = [] if rule == "clip-only" and "clip" in rules else [None]
                for attack in [*baseline, *attacks]:
                    name = f"{rule}-{attack or 'none'}"
                    result = run_config(args, rule, attack, initial_peers, Path(tmp) / name)
                    results.append(result)
                    print(
                        f"  {name}: loss {result['loss_initial']:.3f} -> {result['loss_final']:.3f} "
                        f"({result['seconds']:.0f}s)",
                        file=sys.stderr,
                    )
    finally:
        boot.shutdown()
    add_relative(results)
    table = format_table(results, args.factor)
    print(table)
    if args.out:
        write_report(Path(args.out), args, argv, results, table, numel, started)
    return 0


def write_report(
    out: Path,
    args: argparse.Namespace,
    argv: list[str] | None,
    results: list[dict[str, Any]],
    table: str,
    numel: int,
    started: datetime.datetime,
) -> None:
    """``README.md`` (command, commit, date, machine, table) and ``bench_byzantine.json`` (everything) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join([".venv/bin/python experiments/byzantine/bench_byzantine.py", *argv])
    meta = {
        "command": command,
        "commit": machine.git_revision(),
        "library": machine.library_revision(),
        "date": started.strftime("%Y-%m-%d"),
        "machine": machine.machine_note(),
        "numel": numel,
        "args": vars(args),
    }
    (out / "bench_byzantine.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    lines = [
        "# One Byzantine trainer in a PULSELoCo group of four",
        "",
        f"`{command}` at commit {meta['commit']}, {meta['date']}; {meta['machine']}.",
        "",
        f"A {numel / 1e3:.0f}k-parameter Llama, four peers, {args.rounds} outer rounds of H = {args.inner_steps}, "
        f"AdamW {args.inner_lr:g}, on `a+b=` (operands 0..99); loss: held-out cross-entropy of the answer tokens "
        "of the honest consensus (peer 0). `vs no attacker`: the reduction over the same rule's run without an "
        "attacker (`clip-only` uses `clip`'s: without an attacker they are the same rule).",
        "",
        table,
        "",
    ]
    honest_ratios = sorted(x for r in results if r["attack"] is None for x in r["owner_norm_ratios"])
    if honest_ratios:
        median, high = honest_ratios[len(honest_ratios) // 2], honest_ratios[int(0.95 * (len(honest_ratios) - 1))]
        above = sum(x > 2.0 for x in honest_ratios)
        lines += [
            "Honest parts against the strike ratio (4): in the runs without an attacker, the largest ratio of a part's "
            f"norm to its shard's median, per owner and round ({len(honest_ratios)} values), has median "
            f"{median:.2f}, 95th percentile {high:.2f}, maximum {honest_ratios[-1]:.2f}; {above} above 2.",
            "",
        ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
