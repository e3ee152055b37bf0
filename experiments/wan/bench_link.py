#!/usr/bin/env python
"""The link emulator's own accuracy and capacity: round-trip times against the configured delays, TCP throughput
against the configured rates, and the most an unlimited link carries (at MTU 1500 and 9000), between two peers of
an emulated WAN (experiments/wan/wan_net.py). Needs root and /dev/net/tun.

    python experiments/wan/bench_link.py [--json out.json]

Each case builds its own two-peer WAN, measures from inside peer 0 towards peer 1 (experiments/wan/probe.py) and
tears it down. Failure behaviour: exits 1 with the reason when the WAN cannot be built; a probe that fails is
reported as such in its row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness
from wan_net import Link, WanNet

PROBE = Path(__file__).resolve().parent / "probe.py"
PORT = 9000
CASES: list[tuple[str, Link, int]] = [
    ("no delay, unlimited, MTU 1500", Link(), 1500),
    ("no delay, unlimited, MTU 9000", Link(), 9000),
    ("25 ms each, unlimited (RTT 100 ms)", Link(delay_ms=25), 1500),
    ("100 Mbit/s, no delay", Link(up="100mbit", down="100mbit"), 1500),
    ("100 Mbit/s, 25 ms each (RTT 100 ms)", Link(up="100mbit", down="100mbit", delay_ms=25, queue_ms=200), 1500),
    ("10 Mbit/s, 10 ms each (RTT 40 ms)", Link(up="10mbit", down="10mbit", delay_ms=10), 1500),
]


def measure(link: Link, mtu: int, seconds: float) -> dict[str, Any]:
    """One case: the same link on both peers; RTT of 50 UDP round trips, a TCP upload of ``seconds``."""
    net = WanNet([link, link], mtu=mtu)
    try:
        net.setup()
        server = subprocess.Popen(
            net.exec_argv(1, [sys.executable, str(PROBE), "serve", str(PORT)]), stdout=subprocess.PIPE, text=True
        )
        if server.stdout is None or "serving" not in server.stdout.readline():
            raise RuntimeError("the probe server in peer 1 did not start")

        def probe(*args: str) -> dict[str, Any]:
            argv = net.exec_argv(0, [sys.executable, str(PROBE), *args])
            out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=True)
            return json.loads(out.stdout)

        rtts = probe("rtt", net.host(1), str(PORT), "--count", "50")["rtt_ms"]
        upload = probe("send", net.host(1), str(PORT), "--seconds", str(seconds))
        server.kill()
        return {
            "rtt_expected_ms": 4 * link.delay_ms,
            "rtt_median_ms": statistics.median(rtts),
            "rtt_p90_ms": sorted(rtts)[int(0.9 * (len(rtts) - 1))],
            "rtt_min_ms": min(rtts),
            "mbit_s": upload["mbit_s"],
        }
    finally:
        net.teardown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each TCP upload")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    reason = WanNet.unavailable_reason()
    if reason is not None:
        print(f"bench_link.py: error: {reason}", file=sys.stderr)
        return 1
    rows = []
    print("| case | RTT expected | median | p90 | min | TCP upload |\n|---|---|---|---|---|---|")
    for name, link, mtu in CASES:
        row = {"case": name, "link": vars(link), "mtu": mtu, **measure(link, mtu, args.seconds)}
        rows.append(row)
        print(
            f"| {name} | {row['rtt_expected_ms']:.0f} ms | {row['rtt_median_ms']:.2f} ms | {row['rtt_p90_ms']:.2f} ms "
            f"| {row['rtt_min_ms']:.2f} ms | {row['mbit_s']:.1f} Mbit/s |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
