#!/usr/bin/env python
"""Benchmark PULSELoCo's traffic: wire and payload bytes per outer round per peer for every selector (pulse with FP32,
BF16 or 2-bit values, with or without a per-tile budget, SparseLoCo and dense DiLoCo) on a loopback swarm.

Starts a bootstrap hivemind DHT on 127.0.0.1 and, for each inner learning rate and selector, ``--num-peers``
peer processes that train a Llama built from a config (about 11.6M parameters by default) on synthetic token
batches with AdamW for ``--rounds`` outer rounds of ``--inner-steps`` steps, through :class:`pulseloco.PulseLoCo`
and its metrics lines. It prints, per configuration, the mean over rounds and peers of the wire bytes each peer
sends per round, the density, the ratio to dense DiLoCo measured in the same run and to DDP (FP32 gradients
all-reduced every step, computed as ring all-reduce bytes ``2 (R-1)/R * 4 * numel`` per step, times H), and
the seconds spent in the outer step. Timings on a shared machine are noisy; byte counts are not.

    .venv/bin/python scripts/bench_loco.py                  # table
    .venv/bin/python scripts/bench_loco.py --json out.json  # and the raw numbers
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import models, procs
from harness.run_outputs import allreduce_bytes

SELECTORS: dict[str, dict[str, Any]] = {
    "dense": {"selector": "dense"},
    "pulse": {"selector": "pulse"},
    "pulse-bf16": {"selector": "pulse", "pulse_values": "bfloat16"},
    "pulse-2bit": {"selector": "pulse", "pulse_values": "quantized"},
    "pulse-2bit-k64": {"selector": "pulse", "pulse_values": "quantized", "pulse_budget": 64},
    "sparseloco": {"selector": "sparseloco"},
    "sparseloco-k128": {"selector": "sparseloco", "topk_k": 128},
}
"""Name on the command line -> the :class:`pulseloco.loco.RoundConfig` options it sets."""


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    """The Llama every peer trains (seed 0: the same initial weights everywhere)."""
    return models.llama(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.seq_len,
    )


def run_peer(
    index: int, args: argparse.Namespace, selector: str, lr: float, initial_peers: list[str], out: str
) -> None:
    """One peer: join, train ``args.rounds`` outer rounds, write metrics lines to ``out``."""
    procs.own_hivemind_locks()  # a fork of the benchmark's process, which imported hivemind
    logging.basicConfig(level=logging.WARNING, format=f"peer{index} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    import hivemind

    from pulseloco import PulseLoCo
    from pulseloco.loco import AveragingConfig, RoundConfig

    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    model = make_model(args).to(args.device)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    opt = PulseLoCo(
        model,
        inner,
        dht=dht,
        run_id=f"bench-{selector}-{lr:g}",
        round_config=RoundConfig(inner_steps=args.inner_steps, **SELECTORS[selector]),
        averaging_config=AveragingConfig(
            target_group_size=args.target_group_size or None,
            close_when_expected=args.close_when_expected,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            request_timeout=30.0,
            exchange=args.exchange,
        ),
        metrics_path=out,
    )
    gen = torch.Generator().manual_seed(index)
    while opt.round < args.rounds:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(args.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    time.sleep(3.0)  # let slower peers finish fetching from this one
    opt.shutdown()
    dht.shutdown()


def run_config(
    args: argparse.Namespace, selector: str, lr: float, initial_peers: list[str], workdir: Path
) -> list[dict]:
    """Run ``--num-peers`` peers of one configuration to the end; their metrics records. Exits (SystemExit) when a
    peer fails or runs past ``--timeout`` (the others are killed)."""
    ctx = mp.get_context("spawn" if args.device != "cpu" else "fork")  # CUDA does not survive a fork
    outs = [str(workdir / f"{selector}-{lr:g}-peer{i}.jsonl") for i in range(args.num_peers)]
    peers = [
        ctx.Process(target=run_peer, args=(i, args, selector, lr, initial_peers, outs[i]))
        for i in range(args.num_peers)
    ]
    for peer in peers:
        peer.start()
    try:
        procs.join_all(peers, args.timeout, f"peer of {selector} lr={lr:g}")
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    from pulseloco.jsonl import read_json_lines

    return [record for out in outs for record in read_json_lines(out)]


def summarize(records: list[dict], numel: int, args: argparse.Namespace) -> dict[str, Any]:
    digests_per_round: dict[int, set[str]] = {}
    for r in records:
        digests_per_round.setdefault(r["round"], set()).add(r["theta_digest"])
    return {
        "bytes_sent_per_round": statistics.mean(r["bytes_sent"] for r in records),
        "payload_bytes_per_round": statistics.mean(r["payload_bytes"] for r in records),
        "bytes_received_per_round": statistics.mean(r["bytes_received"] for r in records),
        "density": statistics.mean(r["density"] for r in records),
        "seconds_sync": statistics.median(r["seconds_sync"] for r in records),
        "seconds_inner": statistics.median(r["seconds_inner"] for r in records),
        "num_peers": min(r["num_peers"] for r in records),
        "equal_digests": all(len(d) == 1 for d in digests_per_round.values()),
        "loss_last_round": statistics.mean(r["loss"] for r in records if r["round"] == args.rounds - 1),
        "numel": numel,
        "density_by_round": [
            statistics.mean(r["density"] for r in records if r["round"] == k) for k in sorted(digests_per_round)
        ],
    }


def measure(args: argparse.Namespace, numel: int, ddp_bytes: float) -> list[dict[str, Any]]:
    """Every (inner learning rate, selector) configuration on one bootstrap node, with its ratios to dense DiLoCo
    (the same learning rate) and to DDP."""
    import hivemind

    boot = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    results: list[dict[str, Any]] = []
    try:
        initial_peers = [str(a) for a in boot.get_visible_maddrs()]
        with tempfile.TemporaryDirectory() as tmp:
            for lr in args.lrs:
                per_selector = {}
                for selector in args.selectors:
                    start = time.monotonic()
                    records = run_config(args, selector, lr, initial_peers, Path(tmp))
                    per_selector[selector] = summarize(records, numel, args)
                    print(f"  {selector} lr={lr:g}: {time.monotonic() - start:.0f}s", file=sys.stderr)
                dense = per_selector["dense"]["bytes_sent_per_round"]
                dense_payload = per_selector["dense"]["payload_bytes_per_round"]
                for selector, summary in per_selector.items():
                    summary.update(
                        selector=selector,
                        inner_lr=lr,
                        ratio_vs_dense=dense / summary["bytes_sent_per_round"],
                        payload_ratio_vs_dense=dense_payload / summary["payload_bytes_per_round"],
                        ratio_vs_ddp=ddp_bytes / summary["bytes_sent_per_round"],
                        ddp_bytes_per_round=ddp_bytes,
                    )
                    results.append(summary)
    finally:
        boot.shutdown()
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    """One line per configuration: density, MB sent per round, ratios, outer-step seconds, digests, loss."""
    header = (
        f"{'inner lr':>8} {'selector':>15} {'density':>8} {'MB sent/round':>13} {'vs DiLoCo':>9} "
        f"{'payload vs DiLoCo':>17} {'vs DDP':>8} {'sync s':>7} {'equal':>5} {'loss':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['inner_lr']:>8g} {r['selector']:>15} {r['density']:>8.4f} {r['bytes_sent_per_round'] / 1e6:>13.3f} "
            f"{r['ratio_vs_dense']:>8.1f}x {r['payload_ratio_vs_dense']:>16.1f}x {r['ratio_vs_ddp']:>7.1f}x "
            f"{r['seconds_sync']:>7.2f} "
            f"{'yes' if r['equal_digests'] else 'NO':>5} {r['loss_last_round']:>6.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="outer rounds per configuration")
    parser.add_argument("--inner-steps", type=int, default=8, help="H")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-6, 1e-3], help="inner AdamW learning rates")
    parser.add_argument(
        "--selectors",
        nargs="+",
        default=["pulse", "sparseloco", "dense"],
        choices=list(SELECTORS),
        help="pulse-bf16 / pulse-2bit: the pulse rule sending BF16 / 2-bit values (the rounding or quantization "
        "error stays in the residual); -k64: at most 64 visible entries per 64x64 tile; sparseloco: SparseLoCo",
    )
    parser.add_argument(
        "--exchange",
        default="auto",
        choices=["auto", "sums", "gather", "topk"],
        help="how shard owners serve their shard: FP32 sums, the parts relayed, the aggregate's largest entries, or "
        "auto (for 2-bit values topk where it sends less than gather)",
    )
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="attention heads (and key/value heads)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where each peer's model trains (cuda: the GPU path, outer state on pinned host memory by default)",
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--matchmaking-time", type=float, default=30.0)
    parser.add_argument(
        "--target-group-size",
        type=int,
        default=None,
        help="a round starts once this many peers registered (default --num-peers; 0: none, each round waits for "
        "--matchmaking-time, or, by default, for the peers the state records expect: --no-close-when-expected)",
    )
    parser.add_argument(
        "--close-when-expected",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="AveragingConfig.close_when_expected: a round goes once every expected peer has registered",
    )
    parser.add_argument("--averaging-timeout", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.target_group_size is None:
        args.target_group_size = args.num_peers
    if args.target_group_size < 0:
        parser.error(f"--target-group-size must be 0 or more, got {args.target_group_size}")
    if "dense" not in args.selectors:
        parser.error("--selectors must include dense: it is the baseline of the ratios")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        parser.error(f"--device {args.device}: only cpu, or cuda where torch sees a CUDA GPU")

    with torch.device("meta"):  # count parameters without allocating them
        numel = sum(p.numel() for p in make_model(args).parameters())
    ddp_bytes = allreduce_bytes(numel, args.num_peers) * args.inner_steps
    print(
        f"model: Llama {numel / 1e6:.1f}M parameters; {args.num_peers} peers on loopback; H={args.inner_steps}; "
        f"{args.rounds} rounds; DDP ring all-reduce per peer per round = {ddp_bytes / 1e6:.1f} MB",
        file=sys.stderr,
    )
    results = measure(args, numel, ddp_bytes)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
