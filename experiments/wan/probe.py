#!/usr/bin/env python
"""Probes for the emulated WAN (experiments/wan/wan_net.py), run inside peers' namespaces; each prints one JSON line.

    probe.py serve PORT                    # UDP echo and TCP sink on PORT (until killed)
    probe.py rtt HOST PORT [--count N]     # UDP round trips: {"rtt_ms": [...], "lost": n}
    probe.py send HOST PORT [--seconds S]  # TCP upload: {"bytes": b, "seconds": s, "mbit_s": r}
    probe.py burst HOST PORT [--count N]   # N UDP datagrams one way, then asks how many arrived: {"sent", "received"}

Failure behaviour: a probe whose peer does not answer gives up after its own timeouts (2 s per round trip,
``--seconds`` + 10 s for a transfer) and reports what it measured; bad arguments exit 2 (argparse).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

CHUNK = 64 * 1024


def serve(port: int) -> None:
    """UDP: echo every datagram, except ``count?`` which is answered with the number of ``b:`` datagrams seen;
    TCP: read and discard every connection until it closes."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port))
    tcp.listen(8)

    def drain(conn: socket.socket) -> None:
        with conn:
            while conn.recv(CHUNK):
                pass

    def accept() -> None:
        while True:
            conn, _ = tcp.accept()
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    bursts = 0
    print(json.dumps({"serving": port}), flush=True)
    while True:
        data, addr = udp.recvfrom(CHUNK)
        if data.startswith(b"b:"):
            bursts += 1
        elif data == b"count?":
            udp.sendto(str(bursts).encode(), addr)
        else:
            udp.sendto(data, addr)


def rtt(host: str, port: int, count: int) -> dict[str, object]:
    """``count`` sequential UDP round trips of 64 bytes (2 s timeout each)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    times, lost = [], 0
    for i in range(count):
        payload = f"{i:08d}".encode().ljust(64, b".")
        start = time.monotonic()
        sock.sendto(payload, (host, port))
        try:
            while sock.recv(CHUNK) != payload:
                pass
            times.append(1000 * (time.monotonic() - start))
        except TimeoutError:
            lost += 1
    return {"rtt_ms": times, "lost": lost}


def send(host: str, port: int, seconds: float) -> dict[str, object]:
    """Upload for ``seconds`` over one TCP connection; the rate counts bytes the sender's kernel accepted."""
    sock = socket.create_connection((host, port), timeout=10.0)
    sock.settimeout(seconds + 10.0)
    chunk, sent = b"\0" * CHUNK, 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        sent += sock.send(chunk)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # the sink closes once it has read everything: the bytes have crossed the link
    elapsed = time.monotonic() - start
    sock.close()
    return {"bytes": sent, "seconds": elapsed, "mbit_s": 8 * sent / elapsed / 1e6}


def burst(host: str, port: int, count: int) -> dict[str, object]:
    """``count`` datagrams of 200 bytes, 1 ms apart, then the echo server's count of those that arrived."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    for i in range(count):
        sock.sendto(f"b:{i}".encode().ljust(200, b"."), (host, port))
        time.sleep(0.001)
    time.sleep(1.0)
    received = -1
    for _ in range(5):  # the question itself may be lost
        sock.sendto(b"count?", (host, port))
        try:
            received = int(sock.recv(CHUNK))
            break
        except TimeoutError:
            continue
    return {"sent": count, "received": received}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve").add_argument("port", type=int)
    for name in ("rtt", "send", "burst"):
        p = sub.add_parser(name)
        p.add_argument("host")
        p.add_argument("port", type=int)
        p.add_argument("--count", type=int, default=20)
        p.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.port)
        return 0
    if args.command == "rtt":
        result = rtt(args.host, args.port, args.count)
    elif args.command == "send":
        result = send(args.host, args.port, args.seconds)
    else:
        result = burst(args.host, args.port, args.count)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
