#!/usr/bin/env python
"""One process of the WAN swarm (experiments/wan/swarm.py), run inside its peer's namespace.

    wan_peer.py bootstrap --host IP                      # a DHT node; prints its multiaddr, runs until killed
    wan_peer.py train --host IP --initial-peers MADDR --metrics PATH [options]

``train`` is a PULSELoCo trainer of a small MLP on synthetic regression batches (the model's size sets the
exchange's bytes; each inner step is padded with a sleep to ``--step-seconds``, the compute time of a larger
model's step): it runs ``--rounds`` outer rounds of ``--inner-steps`` steps, writes one RoundMetrics line per round
to ``--metrics`` and at the end a line ``{"summary": ...}`` with its wall time and final digest. It joins with
:func:`pulseloco.swarm.make_dht` (``--client-mode``: a volunteer behind NAT, reachable through a relay slot on a
public initial peer when there is one). ``--audit DIR`` keeps the outside ledger of ``scripts/harness/audit.py``
in files written as it goes (a SIGKILL loses nothing written), as ``--name``. SIGTERM is a volunteer leaving: the
peer stops training at once (the round in flight lands first), writes its summary with ``"left": true`` and
exits without waiting for the others. ``--publish KEY`` makes it the run's PULSESync publisher: after every round
it publishes its model as ``<run id>.policy`` (in the background, as the Trainer callback does), logs each
published version to ``--publish-log`` (``{"version", "digest", "patch_bytes", "t"}``) and, once trained, serves
until the file ``followers-done`` appears in ``--end-dir`` (at most ``--serve-timeout`` s).

Failure behaviour: exits 1 with one line when it cannot join the DHT (hivemind's own timeout) and 2 for bad flags;
every wait on the swarm is PulseLoCo's, each with its timeout.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hivemind

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness
from harness import ledger
from harness.audit import Audit

logger = logging.getLogger("wan_peer")


def bootstrap(host: str, port: int, identity: str | None) -> int:
    """A DHT node at ``host``: prints its multiaddrs as JSON, then serves until SIGTERM or SIGINT. With a fixed
    ``port`` and ``identity`` (a key file, created if missing) a restarted node has the same address."""
    dht = hivemind.DHT(
        host_maddrs=[f"/ip4/{host}/tcp/{port}"], identity_path=identity, check_if_identity_free=False, start=True
    )
    print(json.dumps({"maddrs": [str(a) for a in dht.get_visible_maddrs()]}), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    dht.shutdown()
    return 0


def make_model(width: int, depth: int, seed: int) -> Any:
    """The MLP: ``depth`` square layers of ``width`` with GELU, and a linear head; the same weights for a seed."""
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


LEAVING: list[int] = []
"""The signal that asked this peer to leave (SIGTERM), once it came."""


def _wait_for_the_others(end_dir: Path, host: str, num_peers: int, timeout: float) -> None:
    """Mark this peer done in ``end_dir`` and wait until ``num_peers`` have (a peer that died never does: the
    wait then ends at ``timeout``, with a warning; a SIGTERM ends it at once)."""
    (end_dir / f"done-{host}").touch()
    deadline = time.monotonic() + timeout
    while len(list(end_dir.glob("done-*"))) < num_peers and not LEAVING:
        if time.monotonic() > deadline:
            logger.warning(
                "only %d of %d peers finished within %.0f s", len(list(end_dir.glob("done-*"))), num_peers, timeout
            )
            return
        time.sleep(0.5)


def _publisher(dht: Any, args: argparse.Namespace) -> Any:
    """The run's PULSESync publisher (``--publish``), logging each published version with its wall time."""
    from pulseloco.sync.publisher import Publisher
    from pulseloco.sync.signing import load_private_key

    log = Path(args.publish_log)

    def published(version: int, digest: str, patch_bytes: int) -> None:
        with log.open("a") as out:
            out.write(json.dumps({"version": version, "digest": digest, "patch_bytes": patch_bytes, "t": time.time()}))
            out.write("\n")

    return Publisher(dht, f"{args.run_id}.policy", load_private_key(args.publish), args.store, on_published=published)


def _serve_followers(publisher: Any, model: Any, args: argparse.Namespace) -> None:
    """Publish the final model (the caught-up state), wait for it to be out, then serve until the harness says the
    followers hold it (``followers-done`` in ``--end-dir``) or ``--serve-timeout`` s pass; then close."""
    publisher.publish(model)
    try:
        publisher.flush(timeout=args.serve_timeout)
    except TimeoutError:
        logger.warning("the last version was not published within %.0f s", args.serve_timeout)
    done = Path(args.end_dir) / "followers-done" if args.end_dir else None
    (Path(args.publish_log).parent / "published-last").write_text(str(publisher.version))
    deadline = time.monotonic() + args.serve_timeout
    while done is not None and not done.exists() and time.monotonic() < deadline and not LEAVING:
        time.sleep(0.2)
    publisher.close()


def train(args: argparse.Namespace) -> int:
    """The trainer (module docstring); imports torch and pulseloco here, so that a bootstrap starts quickly."""
    import torch

    from pulseloco import PulseLoCo
    from pulseloco.errors import SwarmUnreachableError
    from pulseloco.loco import AveragingConfig, RoundConfig, RoundMetrics
    from pulseloco.swarm import SwarmConfig, make_dht

    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s peer {args.host} %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("pulseloco").setLevel(logging.INFO)  # rounds, repairs, incomplete rounds
    logging.getLogger("pulseloco.loco.matchmaking").setLevel(logging.DEBUG)  # when each round closed, and why
    logger.setLevel(logging.INFO)
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda signum, frame: LEAVING.append(signum))
    config = SwarmConfig(
        initial_peers=args.initial_peers,
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        client_mode=args.client_mode,
        startup_timeout=args.startup_timeout,
        rejoin_interval=args.rejoin_interval,
    )
    try:
        dht = make_dht(config)
    except SwarmUnreachableError as exc:
        print(f"wan_peer.py: error: {exc}", file=sys.stderr)
        return 1
    model = make_model(args.width, args.depth, seed=0)  # every peer starts from the same weights
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    opt = PulseLoCo(
        model,
        inner,
        dht=dht,
        run_id=args.run_id,
        round_config=RoundConfig(inner_steps=args.inner_steps, selector=args.selector, overlap=args.overlap),
        averaging_config=AveragingConfig(
            matchmaking_time=args.matchmaking_time,
            target_group_size=args.target_group_size or None,
            close_when_expected=args.close_when_expected,
            averaging_timeout=args.averaging_timeout,
            ledger_rounds=args.ledger_rounds,
            request_timeout=args.request_timeout,
            exchange=args.exchange,
        ),
        metrics_path=args.metrics,
    )
    report: dict[str, Any] = {"host": args.host, "error_decay": opt.error_decay}
    if args.ledger is not None:
        ledger.record(opt, report)
    audit = Audit(opt, Path(args.audit), args.name) if args.audit is not None else None
    publisher = _publisher(dht, args) if args.publish is not None else None
    landed = [-1]  # the last round landed

    def on_round(_: PulseLoCo, metrics: RoundMetrics | None) -> None:
        """After each round (with overlap: as it lands, a round late, the model holding the next phase's start)."""
        if metrics is not None:
            landed[0] = metrics.round
        if audit is not None and metrics is not None:
            audit.end_round(metrics=metrics)
        if publisher is not None:
            publisher.publish(model)  # queued: encoded and uploaded in the background

    opt.add_round_listener(on_round)
    gen = torch.Generator().manual_seed(args.seed)
    target = torch.randn(args.width, 1, generator=torch.Generator().manual_seed(1))
    if args.end_dir is not None:  # the harness times its faults from when every trainer has started training
        (Path(args.end_dir) / f"started-{args.host}").touch()
    started, cpu_started, cpu_inner = time.monotonic(), time.process_time(), 0.0
    # overlapped rounds move the round counter in the background: stop once the round in flight is the last one (it
    # is at least one past the last one landed: a joiner's first rounds jump to the swarm's), then land it
    while ((landed[0] + 2 < args.rounds) if args.overlap else (opt.round < args.rounds)) and not LEAVING:
        step_start, step_cpu = time.monotonic(), time.process_time()
        x = torch.randn(args.batch, args.width, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        cpu_inner += time.process_time() - step_cpu  # this process's CPU (every thread) in the forward and backward
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - step_start)))
        opt.step(loss=loss)
        opt.zero_grad()
    opt.finish()
    wall, cpu = time.monotonic() - started, time.process_time() - cpu_started
    if LEAVING and args.end_dir is not None:  # a volunteer leaving: counted as done, waits for no one
        (Path(args.end_dir) / f"done-{args.host}").touch()
    elif args.end_dir is not None:  # end on the swarm's state: a peer a round behind averaged its last round alone
        _wait_for_the_others(Path(args.end_dir), args.host, args.num_peers, args.end_timeout)
        opt.catch_up()
    if audit is not None:
        audit.finish()
    if publisher is not None:
        _serve_followers(publisher, model, args)
    if args.ledger is not None:
        report.update(theta=opt.theta_N.numpy().tobytes(), residual=opt.residual_N.numpy().tobytes())
        torch.save(report, args.ledger)
    summary = {"wall_s": wall, "round": opt.round, "numel": opt.numel, "host": args.host, "left": bool(LEAVING)}
    summary.update(cpu_s=cpu, cpu_inner_s=cpu_inner)  # the process's CPU while training, and in the inner steps
    with open(args.metrics, "a") as out:
        out.write(json.dumps({"summary": summary}) + "\n")
    deadline = time.monotonic() + (0.0 if LEAVING else args.linger)
    while time.monotonic() < deadline and not LEAVING:  # serve the last round's sums and state to slower peers
        time.sleep(0.2)
    opt.shutdown()
    dht.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    boot = sub.add_parser("bootstrap")
    boot.add_argument("--host", required=True)
    boot.add_argument("--port", type=int, default=0, help="TCP port (0: any)")
    boot.add_argument("--identity", help="private key file: the same peer id after a restart (created if missing)")
    peer = sub.add_parser("train")
    peer.add_argument("--host", required=True, help="this peer's address (its namespace's)")
    peer.add_argument("--initial-peers", nargs="+", required=True)
    peer.add_argument("--metrics", required=True, help="RoundMetrics JSON lines, then a summary line")
    peer.add_argument("--run-id", default="wan")
    peer.add_argument("--rounds", type=int, default=4)
    peer.add_argument("--inner-steps", type=int, default=8)
    peer.add_argument("--step-seconds", type=float, default=0.5, help="each inner step padded to this")
    peer.add_argument("--width", type=int, default=1024, help="MLP width (depth x width^2 parameters)")
    peer.add_argument("--depth", type=int, default=2)
    peer.add_argument("--batch", type=int, default=16)
    peer.add_argument("--lr", type=float, default=1e-3)
    peer.add_argument("--seed", type=int, default=0)
    peer.add_argument("--selector", default="pulse")
    peer.add_argument("--exchange", default="auto")
    peer.add_argument("--matchmaking-time", type=float, default=15.0)
    peer.add_argument("--target-group-size", type=int, default=0, help="0: none (the default matchmaking)")
    peer.add_argument(
        "--close-when-expected",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="AveragingConfig.close_when_expected",
    )
    peer.add_argument("--overlap", action="store_true", help="RoundConfig.overlap")
    peer.add_argument("--averaging-timeout", type=float, default=60.0)
    peer.add_argument("--request-timeout", type=float, default=10.0)
    peer.add_argument("--ledger-rounds", type=int, default=8, help="AveragingConfig.ledger_rounds")
    peer.add_argument("--linger", type=float, default=10.0)
    peer.add_argument("--ledger", help="write the outside ledger (scripts/harness/ledger.py) here, torch.save")
    peer.add_argument("--audit", help="keep the outside ledger (scripts/harness/audit.py) in this folder")
    peer.add_argument("--name", default="peer", help="this process's name in the audit, peer<i>.<incarnation>")
    peer.add_argument("--client-mode", action="store_true", help="SwarmConfig.client_mode: behind NAT")
    peer.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="SwarmConfig.startup_timeout (16 trainers starting at once on 2 cores miss the bootstrap's pings a while)",
    )
    peer.add_argument("--rejoin-interval", type=float, default=30.0, help="SwarmConfig.rejoin_interval")
    peer.add_argument("--publish", metavar="KEY", help="publish PULSESync versions signed with this private key")
    peer.add_argument("--store", help="the publisher's version store (a folder)")
    peer.add_argument("--publish-log", help="JSON lines: every version published, with its digest and time")
    peer.add_argument("--serve-timeout", type=float, default=180.0, help="the publisher's wait for the followers")
    peer.add_argument("--end-dir", help="a folder shared by the peers: wait there for --num-peers, then catch up")
    peer.add_argument("--num-peers", type=int, default=1)
    peer.add_argument("--end-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.command == "train" and args.publish is not None and not (args.store and args.publish_log):
        parser.error("--publish needs --store and --publish-log")
    if args.command == "bootstrap":
        return bootstrap(args.host, args.port, args.identity)
    return train(args)


if __name__ == "__main__":
    raise SystemExit(main())
