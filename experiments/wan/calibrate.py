#!/usr/bin/env python
"""Per-operation CPU costs for the round simulation (experiments/wan/simulate_rounds.py), measured on this machine.

    .venv/bin/python experiments/wan/calibrate.py --out costs.json [--harness-report swarm.json]

Each cost is the CPU seconds (user + system) of every process involved, this one and its descendants (hivemind's
DHT processes and their libp2p daemons), over many repetitions on 127.0.0.1, so that no link is in the way:

* ``dht``: 2 and then 6 hivemind DHT nodes; this process stores one subkey under a key, and reads a key holding S
  subkeys (S = 1, 64, 512), through one of them. Fitted as ``op + (nodes - 1) * (rpc_s + S * record_s)`` per
  operation: ``get_op_s`` and ``store_op_s`` the caller's own work (the call into its node's process, the search),
  ``rpc_s`` one request and reply between two nodes, ``record_s`` a record in a reply.
* ``stream``: a server process (scripts/bench_streams.py's) answers a request with a JSON header and SIZE bytes in
  256 KiB chunks, as the exchange's streams do; this process reads it (SIZE = 16 KiB and 4 MiB). Fitted as
  ``message_s + SIZE * byte_s`` per request, both ends together.
* ``round``: one PulseLoCo peer without a swarm, on the WAN harness's MLP (``--width``, ``--depth``, the pulse
  selector): the CPU of one outer step at a boundary (the selection, the part's encoding, the outer step, the
  digest), ``round_s``. A swarm round also decodes and sums the parts and aggregates; that work is not in it.
* with ``--harness-report`` (a swarm.py run's report, with its CPU accounting): ``emulator_byte_s``, the link
  emulators' CPU seconds over the bytes they forwarded (each byte between two trainers passes two emulators),
  and ``exchange_s_per_entry``, the trainers' CPU in the exchange (the parts' encoding, the owners' decoding and
  sums, the aggregates' decoding) per parameter entry: their CPU outside the inner steps less the local outer
  step's (:func:`trainer_cost`). Without a report both are left out (0: the simulation then undercounts).

Output: one JSON object (the costs, the raw measurements, the machine) on stdout and in ``--out``. Failure
behaviour: a DHT node or the server that does not start raises (hivemind's or harness.procs' error, with its log);
bad flags exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hivemind
import torch

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness
import bench_streams
from harness import procs
from harness.machine import git_revision, machine_note
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.timed_storage import get_dht_time
from wan_net import process_cpu
from wan_peer import make_model

from pulseloco.p2p import P2PHost, read_stream


def cpu_now() -> float:
    """CPU seconds so far of this process (every thread) and its living descendants."""
    me = str(os.getpid())
    children = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                children.append(int(entry.name))
        except OSError:
            continue
    return time.process_time() + sum(kind["seconds"] for kind in process_cpu(children).values())


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` through ``(x, y)`` points; the intercept is kept at least 0."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - slope * mx), slope


def measure_dht(repeats: int) -> dict[str, Any]:
    """CPU and wall seconds per store and per read of S subkeys, with 2 and with 6 DHT nodes (the caller asks 1 or
    5 others), fitted as ``op + (nodes - 1) * (rpc + S * record)`` (module docstring)."""
    record = {"client": False, "t": time.time(), "digest": "0" * 32}
    rows: list[dict[str, Any]] = []
    for count in (2, 6):
        nodes = [hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)]
        try:
            first = [str(a) for a in nodes[0].get_visible_maddrs()]
            for _ in range(count - 1):
                nodes.append(hivemind.DHT(initial_peers=first, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True))
            caller, expiration = nodes[-1], get_dht_time() + 3600
            caller.store("calibrate-warm", record, expiration_time=expiration, subkey="warm")  # connections first
            cpu, wall = cpu_now(), time.monotonic()
            for i in range(repeats):
                caller.store("calibrate-store", record, expiration_time=expiration, subkey=f"peer{i}")
            rows.append({"op": "store", "nodes": count, "records": 1, "cpu_s": (cpu_now() - cpu) / repeats})
            rows[-1]["wall_s"] = (time.monotonic() - wall) / repeats
            for size in (1, 64, 512):
                key = f"calibrate-get-{size}"
                for i in range(size):
                    nodes[0].store(key, record, expiration_time=expiration, subkey=f"12D3KooWpeer{i:040d}")
                caller.get(key, latest=True)
                cpu, wall = cpu_now(), time.monotonic()
                for _ in range(repeats):
                    found = caller.get(key, latest=True)
                    if found is None or len(found.value) != size:
                        got = 0 if found is None else len(found.value)
                        raise RuntimeError(f"the DHT read {got} of {size} subkeys")
                rows.append({"op": "get", "nodes": count, "records": size, "cpu_s": (cpu_now() - cpu) / repeats})
                rows[-1]["wall_s"] = (time.monotonic() - wall) / repeats
        finally:
            for node in reversed(nodes):
                node.shutdown()
    # unknowns: get_op_s, store_op_s, rpc_s, record_s
    design = [
        [float(r["op"] == "get"), float(r["op"] == "store"), r["nodes"] - 1.0, (r["nodes"] - 1.0) * r["records"]]
        for r in rows
    ]
    target = [[r["cpu_s"]] for r in rows]
    solution = torch.linalg.lstsq(torch.tensor(design, dtype=torch.float64), torch.tensor(target, dtype=torch.float64))
    get_op_s, store_op_s, rpc_s, record_s = (max(0.0, float(v)) for v in solution.solution.flatten())
    return {"rows": rows, "get_op_s": get_op_s, "store_op_s": store_op_s, "rpc_s": rpc_s, "record_s": record_s}


def measure_stream(repeats: int) -> dict[str, Any]:
    """CPU seconds per request and per byte of a streamed reply, both ends (module docstring)."""
    points, rows = [], []
    with tempfile.TemporaryDirectory(prefix="calibrate-") as logs, procs.Runner(Path(logs)) as runner:
        for size in (16 << 10, 4 << 20):
            argv = [sys.executable, bench_streams.__file__, "--serve", "--size", str(size)]
            server = runner.start(f"server{size}", argv)
            maddrs = json.loads(server.wait_for(r"(?m)^(\[.*\])$", timeout=60).group(1))
            peer = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
            dht = hivemind.DHT(start=True, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            host = P2PHost(dht, name="calibrate")
            try:
                stub = bench_streams.ReplyServicer.get_stub(host.p2p, peer, namespace=bench_streams.NAMESPACE)

                async def ask(count: int, size: int = size, stub: Any = stub) -> None:
                    for _ in range(count):
                        stream = await asyncio.wait_for(stub.rpc_server_closes(runtime_pb2.ExpertRequest()), 30)
                        _, payload = await read_stream(stream, max_bytes=size, timeout=30)
                        if len(payload) != size:
                            raise RuntimeError(f"a reply of {len(payload)} bytes, not {size}")

                count = max(4, repeats if size < 1 << 20 else repeats // 8)
                host.run(ask(2), timeout=120)  # connect first
                cpu, wall = cpu_now(), time.monotonic()
                host.run(ask(count), timeout=600)
                row = {"bytes": size, "cpu_s": (cpu_now() - cpu) / count, "wall_s": (time.monotonic() - wall) / count}
                rows.append(row)
                points.append((size, row["cpu_s"]))
            finally:
                host.close()
                dht.shutdown()
                runner.stop_all(grace=0)
    message_s, byte_s = fit_line(points)
    return {"rows": rows, "message_s": message_s, "byte_s": byte_s}


def measure_round(width: int, depth: int, rounds: int) -> dict[str, Any]:
    """CPU seconds of one outer step of a PulseLoCo peer without a swarm (module docstring)."""
    from pulseloco import PulseLoCo
    from pulseloco.loco import RoundConfig

    torch.set_num_threads(1)
    model = make_model(width, depth, seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=1, selector="pulse"))
    target = torch.randn(width, 1, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(rounds + 1):
        x = torch.randn(64, width, generator=gen)
        torch.nn.functional.mse_loss(model(x), x @ target).backward()
        started = time.process_time()
        opt.step()
        opt.zero_grad()
        seconds.append(time.process_time() - started)
    return {"round_s": statistics.median(seconds[1:]), "numel": opt.numel, "rounds": rounds}


def trainer_cost(report: dict[str, Any], local_round_s: float) -> dict[str, Any]:
    """A trainer's CPU seconds per parameter entry and round in the exchange, from a swarm.py report: the trainer
    processes' CPU outside their inner steps per round, less the local outer step's (``local_round_s``: the
    selection, the outer step, the digest), over ``numel`` (the parts' encoding, the owner's decoding and sum, the
    aggregates' decoding: about one pass over the model each)."""
    peers = [p for p in report["per_peer"] if p.get("cpu_s") is not None]
    if not peers:
        raise ValueError("the harness report has no trainer CPU: rerun experiments/wan/swarm.py at this commit")
    rounds, numel = report["config"]["rounds"], report["numel"]
    per_round = statistics.fmean((p["cpu_s"] - p["cpu_inner_s"]) / rounds for p in peers)
    return {"exchange_s_per_entry": max(0.0, per_round - local_round_s) / numel, "trainer_cpu_s_per_round": per_round}


def emulator_cost(report: dict[str, Any]) -> dict[str, Any]:
    """The emulators' CPU seconds per forwarded byte in a swarm.py report with a ``cpu`` section: the bytes the
    trainers sent and received over the run (each byte passes the sender's and the receiver's emulator)."""
    if "cpu" not in report or "emulator" not in report["cpu"]["by_kind"]:
        raise ValueError("the harness report has no cpu section: rerun experiments/wan/swarm.py at this commit")
    peers = report["per_peer"]
    rounds = report["config"]["rounds"]
    forwarded = rounds * sum(p["bytes_sent_per_round"] + p["bytes_received_per_round"] for p in peers)
    seconds = report["cpu"]["by_kind"]["emulator"]["seconds"]
    return {"emulator_byte_s": seconds / forwarded, "emulator_cpu_s": seconds, "forwarded_bytes": forwarded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the costs as JSON")
    parser.add_argument("--harness-report", type=Path, help="a swarm.py --json report, for the emulators' cost")
    parser.add_argument("--repeats", type=int, default=200, help="operations per DHT and stream measurement")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=2)
    args = parser.parse_args(argv)
    if args.repeats < 8:
        parser.error("--repeats must be at least 8")
    report = json.loads(args.harness_report.read_text()) if args.harness_report else None
    result: dict[str, Any] = {"machine": machine_note(), "commit": git_revision(), "argv": sys.argv[1:]}
    result["dht"] = measure_dht(args.repeats)
    print(f"dht: {result['dht']['rows']}", file=sys.stderr)
    result["stream"] = measure_stream(args.repeats)
    print(f"stream: {result['stream']['rows']}", file=sys.stderr)
    result["round"] = measure_round(args.width, args.depth, rounds=10)
    costs = {
        "get_op_s": result["dht"]["get_op_s"],
        "store_op_s": result["dht"]["store_op_s"],
        "rpc_s": result["dht"]["rpc_s"],
        "record_s": result["dht"]["record_s"],
        "message_s": result["stream"]["message_s"],
        "byte_s": result["stream"]["byte_s"],
        "round_s_per_entry": result["round"]["round_s"] / result["round"]["numel"],
    }
    if report is not None:
        result["emulator"] = emulator_cost(report)
        costs["emulator_byte_s"] = result["emulator"]["emulator_byte_s"]
        result["trainer"] = trainer_cost(report, result["round"]["round_s"])
        costs["exchange_s_per_entry"] = result["trainer"]["exchange_s_per_entry"]
    result["costs"] = costs
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(costs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
