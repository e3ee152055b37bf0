"""Memory, measured: the extra host memory per parameter that PulseLoCo, a PULSESync publisher and a subscriber
hold and touch at their peak, each in its own fresh process.

    python scripts/bench_memory.py                 # the ~122M-parameter default model (scripts/harness/models.py)
    python scripts/bench_memory.py --small --json out.json

Method: every measurement runs in a new ``spawn`` process that builds the FP32 model first, then reads its
resident set (``VmRSS`` in /proc/self/status) as the baseline and resets the kernel's peak (``VmHWM``, by writing
5 to /proc/self/clear_refs) before the phase it measures. ``held`` is VmRSS after the phase minus the baseline
(read after ``gc.collect()`` and glibc's ``malloc_trim(0)``, so that it counts live memory, not heap pages the
allocator kept after a free); ``peak`` is VmHWM minus the baseline, or minus the RSS just before a round for the
round's temporaries. Pages count once touched, so what is measured is memory really used, not reserved. The
inner steps are simulated by an in-place, strided change of one entry in ``--stride`` (no allocation), so that
the round selects a realistic fraction.

Rows and targets (bytes per parameter ``N``; ``K`` = entries the round sent; ``C`` = ``--chunk-mib``):

- PulseLoCo held: theta, residual, outer momentum (12 B) plus its two staging chunks (``2 C``); with a swarm also,
  per entry sent in the rounds so far (both are kept for longer than 2 rounds), the ledger's copy of the parts as
  they were sent (at most 5 B: the FP32 value and its share of the index code) and the owner's sum of its shard,
  kept for late fetchers (4 B; in a group of one the shard is the whole model): 9 B.
- PulseLoCo round temporaries (the second round: the first also allocates the momentum): bounded by a shard:
  ``8 C + 96 K`` (a few chunks, plus the selected entries and their encodings), not by the model.
- PulseLoCo with a swarm (a real hivemind DHT on 127.0.0.1, a group of one): the same targets; the snapshot it
  serves to peers is counted in ``held``.
- Publisher, peak while publishing a patch version: one BF16 snapshot (2 B) plus one patch.
- Subscriber, peak while applying a patch: one BF16 shadow (2 B) plus one patch.

A row passes when measured <= target * 1.10 + 16 MiB (allocator and library slack; it dominates for --small).
Nothing is hard-coded: every number printed is read from /proc during this run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import memory, procs
from harness.memory import MIB
from harness.models import build_model

SLACK_RELATIVE = 0.10
SLACK_BYTES = 16 * MIB
RUN_ID = "bench-memory"


# ---- measuring -------------------------------------------------------------------------------------------------


def _perturb(model: Any, stride: int, step: int) -> None:
    """A stand-in for inner steps, in place: every ``stride``-th entry moves by a normal draw of scale 1e-2 (seeded
    by ``step``; distinct values, so that the encoded parts do not compress better than a real pseudo-gradient's).
    Its temporaries are freed before a measurement starts."""
    import torch

    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            moved = p.view(-1)[step % stride :: stride]
            moved.add_(torch.randn(moved.numel(), generator=generator) * 1e-2)


def _build(config: str, threads: int) -> tuple[Any, int]:
    import torch

    torch.set_num_threads(threads)
    model = build_model(config, seed=0)
    return model, sum(p.numel() for p in model.parameters())


# ---- workers (each in its own process) ---------------------------------------------------------------------------


def loco_worker(args: dict[str, Any], swarm: bool, results: Any) -> None:
    """PulseLoCo: construction and two rounds (the first allocates the outer momentum)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    model, numel = _build(args["config"], args["threads"])
    from pulseloco import PulseLoCo
    from pulseloco.loco import AveragingConfig, PlacementConfig, RoundConfig

    dht = None
    if swarm:
        import hivemind

        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    baseline = memory.reset_peak()
    opt = PulseLoCo(
        model,
        None,
        dht=dht,
        run_id=RUN_ID,
        round_config=RoundConfig(inner_steps=1, selector="pulse"),
        averaging_config=AveragingConfig(
            matchmaking_time=1.0, target_group_size=1, averaging_timeout=60.0, request_timeout=10.0
        ),
        placement_config=PlacementConfig(outer_chunk_bytes=args["chunk_mib"] * MIB),
    )
    init_peak = memory.status()["VmHWM"] - baseline
    rounds = []
    for step in range(2):
        _perturb(model, args["stride"], step)
        before = memory.reset_peak()
        start = time.monotonic()
        opt.count_inner_step()
        peak = memory.status()["VmHWM"]
        metrics = opt.last_metrics
        rounds.append(
            {
                "temporaries": peak - before,
                "held": memory.held() - baseline,
                "num_sent": metrics.num_sent if metrics is not None else 0,
                "num_peers": metrics.num_peers if metrics is not None else 0,
                "seconds": time.monotonic() - start,
            }
        )
    opt.shutdown()
    if dht is not None:
        dht.shutdown()
    results.put(
        {
            "numel": numel,
            "init_peak": init_peak,
            "rounds": rounds,
            "pinned": opt.placement.pin_memory,
            "state_device": str(opt.placement.device),
        }
    )


def publisher_worker(args: dict[str, Any], workdir: str, results: Any) -> None:
    """Publisher: an anchor version, then a patch version (the steady state)."""
    model, numel = _build(args["config"], args["threads"])
    from cryptography.hazmat.primitives import serialization

    from pulseloco.sync.publisher import Publisher
    from pulseloco.sync.signing import generate_key

    key = generate_key()
    patch_bytes: dict[int, int] = {}
    store = Path(workdir) / "store"
    baseline = memory.reset_peak()
    publisher = Publisher(
        None,
        RUN_ID,
        key,
        store,
        anchor_every=1000,
        on_published=lambda version, digest, size: patch_bytes.__setitem__(version, size),
    )
    publisher.publish(model)
    if publisher.flush(timeout=600) is None:
        raise RuntimeError(f"the anchor version was not published: {publisher.last_error!r}")
    anchor_peak = memory.status()["VmHWM"] - baseline
    shutil.copytree(store, Path(workdir) / "store-anchor")
    _perturb(model, args["stride"], 0)
    memory.reset_peak()
    version = publisher.publish(model)
    if publisher.flush(timeout=600) != version:
        raise RuntimeError(f"the patch version was not published: {publisher.last_error!r}")
    peak, held = memory.status()["VmHWM"], memory.held()
    publisher.close()
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    results.put(
        {
            "numel": numel,
            "anchor_peak": anchor_peak,
            "peak": peak - baseline,
            "held": held - baseline,
            "patch_bytes": patch_bytes.get(version, 0),
            "public_key": public.hex(),
        }
    )


def subscriber_worker(args: dict[str, Any], workdir: str, public_key: str, results: Any) -> None:
    """Subscriber of an FP32 model: the anchor version, then the patch version from the full store."""
    model, numel = _build(args["config"], args["threads"])
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from pulseloco.sync.sources import DirectorySource
    from pulseloco.sync.subscriber import Subscriber

    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key))
    baseline = memory.reset_peak()
    subscriber = Subscriber.from_directory(Path(workdir) / "store-anchor", key, run_id=RUN_ID)
    first = subscriber.update(model)
    anchor_peak = memory.status()["VmHWM"] - baseline
    memory.reset_peak()
    # The same subscriber (its BF16 shadow) now reads the store that also holds the patch version.
    subscriber.source = DirectorySource(Path(workdir) / "store", key, RUN_ID)
    second = subscriber.update(model)
    peak, held = memory.status()["VmHWM"], memory.held()
    subscriber.close()
    if first is None or second is None or second <= first:
        raise RuntimeError(f"subscriber did not reach the patch version (got {first}, then {second})")
    results.put(
        {
            "numel": numel,
            "anchor_peak": anchor_peak,
            "peak": peak - baseline,
            "held": held - baseline,
        }
    )


# ---- report ------------------------------------------------------------------------------------------------------


def _row(name: str, measured: int, target: int, numel: int, formula: str) -> dict[str, Any]:
    limit = target * (1 + SLACK_RELATIVE) + SLACK_BYTES
    return {
        "row": name,
        "measured_bytes": measured,
        "target_bytes": target,
        "measured_per_param": measured / numel,
        "target_per_param": target / numel,
        "formula": formula,
        "result": "PASS" if measured <= limit else "MISS",
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """All rows; raises RuntimeError when a worker fails."""
    settings = {"config": args.model, "threads": args.threads, "chunk_mib": args.chunk_mib, "stride": args.stride}
    chunk = args.chunk_mib * MIB
    rows = []
    meta: dict[str, Any] = {"model": args.model, "chunk_mib": args.chunk_mib, "stride": args.stride}
    for swarm in (False, True) if args.dht else (False,):
        label = "pulseloco+dht" if swarm else "pulseloco"
        print(f"measuring {label} ...", file=sys.stderr, flush=True)
        loco = procs.run_spawned(loco_worker, settings, swarm)
        n = loco["numel"]
        meta["numel"] = n
        meta[label] = loco
        # Round 1 allocates the outer momentum (held from then on): round 2 is the steady state.
        last = loco["rounds"][-1]
        k = last["num_sent"]
        kept = 9 * sum(r["num_sent"] for r in loco["rounds"]) if swarm else 0
        held_formula = "12 B/param + 2 chunks" + (" + 9 B per entry sent" if swarm else "")
        rows.append(_row(f"{label} held after 2 rounds", last["held"], 12 * n + 2 * chunk + kept, n, held_formula))
        rows.append(
            _row(
                f"{label} round 2 temporaries (K={k})",
                last["temporaries"],
                8 * chunk + 96 * k,
                n,
                "8 chunks + 96 B per sent entry",
            )
        )
    print("measuring publisher ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as workdir:
        publisher = procs.run_spawned(publisher_worker, settings, workdir)
        print("measuring subscriber ...", file=sys.stderr, flush=True)
        subscriber = procs.run_spawned(subscriber_worker, settings, workdir, publisher["public_key"])
    n, patch = publisher["numel"], publisher["patch_bytes"]
    meta["patch_bytes"] = patch
    meta["publisher"] = {k: v for k, v in publisher.items() if k != "public_key"}
    meta["subscriber"] = subscriber
    rows.append(_row("publisher peak, patch version", publisher["peak"], 2 * n + patch, n, "BF16 snapshot + patch"))
    rows.append(_row("publisher held after it", publisher["held"], 2 * n + patch, n, "BF16 snapshot + patch"))
    rows.append(_row("subscriber peak, patch version", subscriber["peak"], 2 * n + patch, n, "BF16 shadow + patch"))
    rows.append(_row("subscriber held after it", subscriber["held"], 2 * n + patch, n, "BF16 shadow + patch"))
    return {"meta": meta, "rows": rows}


def table(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"model={meta['model']} params={meta['numel'] / 1e6:.1f}M chunk={meta['chunk_mib']} MiB "
        f"patch={meta['patch_bytes'] / 2**20:.2f} MiB (pass: measured <= target x {1 + SLACK_RELATIVE:.2f} "
        f"+ {SLACK_BYTES // MIB} MiB)",
        f"{'what':<44} {'measured B/param':>16} {'target B/param':>15}  {'target':<30} result",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['row']:<44} {row['measured_per_param']:>16.2f} {row['target_per_param']:>15.2f}  "
            f"{row['formula']:<30} {row['result']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a scripts/harness/models.py config (default ~122M)")
    parser.add_argument("--small", action="store_true", help="the ~7M-parameter model and 1 MiB chunks: a smoke run")
    parser.add_argument("--chunk-mib", type=int, default=16, help="PulseLoCo outer_chunk_bytes, in MiB")
    parser.add_argument("--stride", type=int, default=97, help="the simulated inner steps move 1 entry in this many")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--no-dht", dest="dht", action="store_false", help="skip the PulseLoCo-with-a-DHT rows")
    args = parser.parse_args(argv)
    if args.small:
        args.model, args.chunk_mib = "small", 1
    if args.chunk_mib < 1 or args.stride < 1 or args.threads < 1:
        parser.error("--chunk-mib, --stride and --threads must be at least 1")
    try:
        memory.reset_peak()
    except OSError as exc:
        print(
            f"cannot reset the peak RSS here (/proc/self/clear_refs: {exc}); peaks cannot be measured", file=sys.stderr
        )
        return 2
    report = measure(args)
    print(table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(row["result"] == "PASS" for row in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
