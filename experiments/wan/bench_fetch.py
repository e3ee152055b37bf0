#!/usr/bin/env python
"""How long a PULSESync object takes to fetch over one emulated WAN link: the project's fetch on one stream at a
time, the same fetch over its ranges on several streams (pulseloco.sync.transport.plan_ranges), and a plain TCP
connection moving the same bytes. Needs root and /dev/net/tun.

    python experiments/wan/bench_fetch.py [--sizes 1250000,20000000] [--rate 100mbit] [--rtt-ms 100] [--json out.json]

Peer 0 of a two-peer WAN (experiments/wan/wan_net.py) runs a hivemind DHT whose :class:`SwarmEndpoint` serves random
payloads of the asked sizes, and a TCP server; peer 1 fetches each size ``--repeats`` times per way, after one fetch
that warms up the connection and the size hint, with ``--idle`` seconds between fetches (a rollout worker fetches
one patch per trainer step). Prints one row per way and size: median, min and max seconds, and the rate. Failure
behaviour: exits 1 with the reason when the WAN cannot be built or a peer's process fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness
from wan_net import Link, WanNet

DHT_PORT, TCP_PORT = 31337, 31400
RUN = "bench-fetch"


def serve(host: str) -> None:
    """Peer 0: the DHT with a fetch handler answering a request for version ``n`` with ``n`` random bytes, and a
    TCP server answering a line ``n`` with ``n`` bytes."""
    import hivemind

    from pulseloco.sync.transport import Provided, SwarmEndpoint

    dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/{DHT_PORT}"], start=True)
    endpoint = SwarmEndpoint(dht, RUN, name="bench-provider")
    blobs: dict[int, bytes] = {}
    lock = threading.Lock()

    def blob(size: int) -> bytes:
        with lock:
            return blobs.setdefault(size, os.urandom(size))

    endpoint.serve(lambda request: Provided("ok", b"", blob(request.version)))

    def answer(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                conn.sendall(blob(int(line)))

    def accept() -> None:
        with socket.create_server((host, TCP_PORT)) as server:
            while True:
                threading.Thread(target=answer, args=(server.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(json.dumps({"maddr": str(dht.get_visible_maddrs()[0])}), flush=True)
    threading.Event().wait()


def fetch(maddr: str, host: str, sizes: list[int], repeats: int, idle: float) -> None:
    """Peer 1: time every way of every size; prints the seconds as one JSON object."""
    import hivemind
    from hivemind.p2p import PeerID

    from pulseloco.sync import transport
    from pulseloco.sync.transport import FetchRequest, SwarmEndpoint

    dht = hivemind.DHT(initial_peers=[maddr], start=True)
    endpoint = SwarmEndpoint(dht, RUN, name="bench-asker")
    peer = PeerID.from_base58(maddr.split("/p2p/")[1])
    streams = transport.FETCH_STREAMS
    conn = socket.create_connection((host, TCP_PORT))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def project(size: int) -> float:
        started = time.perf_counter()
        provided = endpoint._host.run(endpoint._fetch(peer, FetchRequest("patch", size), size, 30.0), timeout=120)
        if len(provided.payload) != size:
            raise RuntimeError(f"fetched {len(provided.payload)} of {size} bytes")
        return time.perf_counter() - started

    def tcp(size: int) -> float:
        started = time.perf_counter()
        conn.sendall(f"{size}\n".encode())
        received = 0
        while received < size:
            received += len(conn.recv(1 << 20))
        return time.perf_counter() - started

    out: dict[str, dict[str, list[float]]] = {}
    for size in sizes:
        for way, run in (("one stream", project), (f"{streams} streams", project), ("plain TCP", tcp)):
            transport.FETCH_STREAMS = 1 if way == "one stream" else streams
            endpoint._size_hints.clear()
            run(size)  # warm: the connection, and the size hint of the ranges
            seconds = []
            for _ in range(repeats):
                time.sleep(idle)
                seconds.append(run(size))
            out.setdefault(way, {})[str(size)] = seconds
    print(json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1250000,20000000", help="payload bytes, comma-separated")
    parser.add_argument("--rate", default="100mbit", help="each direction of each peer's link (tc style)")
    parser.add_argument("--rtt-ms", type=float, default=100.0, help="round-trip time between the peers")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="jitter of each link direction, +/-")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--idle", type=float, default=1.0, help="seconds between fetches")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--role", choices=["serve", "fetch"], help=argparse.SUPPRESS)
    parser.add_argument("--peer", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.role == "serve":
        serve(args.peer[0])
        return 0
    if args.role == "fetch":
        fetch(args.peer[0], args.peer[1], sizes, args.repeats, args.idle)
        return 0
    reason = WanNet.unavailable_reason()
    if reason is not None:
        print(f"bench_fetch.py: error: {reason}", file=sys.stderr)
        return 1
    delay = args.rtt_ms / 4  # a round trip crosses both peers' links both ways
    link = Link(up=args.rate, down=args.rate, delay_ms=delay, jitter_ms=args.jitter_ms, queue_ms=200)
    net = WanNet([link, link], mtu=9000)
    me = [sys.executable, __file__, "--sizes", args.sizes, "--repeats", str(args.repeats), "--idle", str(args.idle)]
    try:
        net.setup()
        server = subprocess.Popen(
            net.exec_argv(0, [*me, "--role", "serve", "--peer", net.host(0), "-"]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None  # noqa: S101 (a pipe was asked for)
            maddr = json.loads(server.stdout.readline())["maddr"]
            argv = net.exec_argv(1, [*me, "--role", "fetch", "--peer", maddr, net.host(0)])
            done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                print(f"bench_fetch.py: error: the asker failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            results: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            server.kill()
            server.wait()
    finally:
        net.teardown()
    print(f"link {args.rate} each way, RTT {args.rtt_ms:g} ms +-{args.jitter_ms:g}, {args.idle:g} s between fetches")
    print("| way | bytes | median s | min s | max s | Mbit/s at the median |\n|---|---|---|---|---|---|")
    for way, by_size in results.items():
        for size, seconds in by_size.items():
            median = statistics.median(seconds)
            print(f"| {way} | {int(size):,} | {median:.3f} | {min(seconds):.3f} | {max(seconds):.3f} "
                  f"| {int(size) * 8 / median / 1e6:.1f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "seconds": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
