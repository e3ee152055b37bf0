#!/usr/bin/env python
"""A userspace WAN link emulator over TUN devices: one peer's access link, both directions, with a rate, a one-way
delay, jitter, random loss and a drop-tail queue (this kernel has ``tbf`` but no ``netem``; mahimahi's shells
work this way).

One process per peer. It opens a TUN device ``--peer-dev`` in the peer's network namespace (the peer's only route
out) and one, ``--hub-dev``, in the hub namespace that forwards between peers, and moves every IP packet between
them: up (peer -> hub) through the uplink, down (hub -> peer) through the downlink. A packet from peer A to peer B
crosses A's uplink and B's downlink, as on the internet: its one-way delay is ``delay(A) + delay(B)``, so the
round-trip time between them is ``2 (delay(A) + delay(B))``.

Per direction, a packet of ``n`` bytes that arrives at ``t`` is
- dropped with probability ``--loss``, or when the queue already holds ``--queue-bytes`` (drop-tail);
- sent when the link is free, taking ``8 n / rate`` seconds (serialization: the rate limit);
- delivered ``delay + jitter`` after that, where jitter is uniform in ``[-jitter, +jitter]`` and packets never
  overtake each other (a link reorders nothing).
Timers are the event loop's (``select``), so deliveries are late by the loop's wake-up latency (the harness
measures it, experiments/wan/README.md); a rate of 0 is unlimited.

    ip netns exec HUB python experiments/wan/linkem.py --peer-ns PEER --peer-dev tun0 --hub-dev t3 \\
        --up 10mbit --down 50mbit --delay-ms 20 --jitter-ms 2 --loss 0.005

SIGUSR1 switches both directions' delay to ``--alt-delay-ms`` and the next one back (a route change: packets
in flight keep their times, none overtakes another). It prints ``ready`` on stdout once both devices are open,
and counts packets and drops to stderr at exit (SIGTERM or SIGINT). Failure behaviour: exits 2 with one line for
bad arguments, 1 when a device cannot be opened (not root, no /dev/net/tun, no such namespace).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import logging
import os
import random
import selectors
import signal
import struct
import sys
import time
from dataclasses import dataclass, field

logger = logging.getLogger("linkem")

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
MAX_PACKET = 65536


def parse_rate(text: str) -> float:
    """Bits per second of ``100mbit``, ``1gbit``, ``512kbit`` or ``0`` (unlimited). Raises ValueError."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    lowered = text.strip().lower()
    if lowered == "0":
        return 0.0
    for unit, scale in units.items():
        if lowered.endswith(unit):
            value = float(lowered[: -len(unit)])
            if value <= 0:
                break
            return value * scale
    raise ValueError(f"bad rate {text!r}: use e.g. 100mbit, 1gbit, 512kbit, or 0 for unlimited")


def enter_netns(name: str) -> None:
    """Move this thread into network namespace ``name`` (``ip netns`` names). Raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({name}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def open_tun(name: str) -> int:
    """Open (create if needed) TUN device ``name`` in the current namespace, without packet info, non-blocking.
    Raises OSError."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class Direction:
    """One direction of the link: its parameters, the packets in flight (release time, sequence, bytes) and
    counters. ``offer`` takes a packet at time ``now``; ``due`` hands back those whose time has come."""

    rate_bps: float
    delay_s: float
    jitter_s: float
    loss: float
    queue_bytes: int
    rng: random.Random
    alt_delay_s: float = 0.0
    """The delay SIGUSR1 switches to (and back: the two swap)."""
    link_free_at: float = 0.0
    last_release: float = 0.0
    queued: int = 0
    heap: list[tuple[float, int, float, bytes]] = field(default_factory=list)
    seq: int = 0
    packets: int = 0
    bytes: int = 0
    lost: int = 0
    tail_dropped: int = 0

    def offer(self, packet: bytes, now: float) -> None:
        self.packets += 1
        self.bytes += len(packet)
        if self.loss and self.rng.random() < self.loss:
            self.lost += 1
            return
        backlog = max(0.0, self.link_free_at - now)  # seconds of queued serialization ahead of this packet
        if self.rate_bps and backlog * self.rate_bps / 8 + len(packet) > self.queue_bytes:
            self.tail_dropped += 1
            return
        start = max(now, self.link_free_at)
        sent = start + (8 * len(packet) / self.rate_bps if self.rate_bps else 0.0)
        self.link_free_at = sent
        jitter = self.rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        release = max(sent + self.delay_s + jitter, self.last_release)
        self.last_release = release
        heapq.heappush(self.heap, (release, self.seq, sent, packet))
        self.seq += 1

    def due(self, now: float) -> list[bytes]:
        out = []
        while self.heap and self.heap[0][0] <= now:
            out.append(heapq.heappop(self.heap)[3])
        return out

    def next_release(self) -> float | None:
        return self.heap[0][0] if self.heap else None


def run(peer_fd: int, hub_fd: int, up: Direction, down: Direction) -> None:
    """Move packets until SIGTERM/SIGINT: peer -> ``up`` -> hub, hub -> ``down`` -> peer."""
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    def on_switch(*_: object) -> None:  # SIGUSR1: swap the one-way delays with the alternative ones
        for direction in (up, down):
            direction.delay_s, direction.alt_delay_s = direction.alt_delay_s, direction.delay_s
        print(f"linkem: one-way delay now {up.delay_s * 1000:.1f} ms", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGUSR1, on_switch)
    selector = selectors.DefaultSelector()
    selector.register(peer_fd, selectors.EVENT_READ, (up, hub_fd))
    selector.register(hub_fd, selectors.EVENT_READ, (down, peer_fd))
    routes = ((up, hub_fd), (down, peer_fd))
    while not stop:
        now = time.monotonic()
        releases = [t for t in (up.next_release(), down.next_release()) if t is not None]
        timeout = max(0.0, min(releases) - now) if releases else 0.5
        try:
            events = selector.select(timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for key, _ in events:
            direction, _out = key.data
            for _ in range(64):  # drain what is ready, a bounded batch per wake-up
                try:
                    packet = os.read(key.fd, MAX_PACKET)
                except BlockingIOError:
                    break
                direction.offer(packet, now)
        now = time.monotonic()
        for direction, out_fd in routes:
            for packet in direction.due(now):
                try:
                    os.write(out_fd, packet)
                except (BlockingIOError, OSError):
                    direction.tail_dropped += 1  # the device's own queue is full, or it went away
    for name, direction in (("up", up), ("down", down)):
        print(
            f"linkem {name}: {direction.packets} packets, {direction.bytes} bytes, {direction.lost} lost, "
            f"{direction.tail_dropped} dropped at the queue",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-ns", required=True, help="the peer's network namespace (ip netns name)")
    parser.add_argument("--peer-dev", default="tun0", help="TUN device in the peer's namespace")
    parser.add_argument("--hub-ns", help="the hub's namespace (default: the one this process starts in)")
    parser.add_argument("--hub-dev", required=True, help="TUN device in the hub's namespace")
    parser.add_argument("--up", default="0", help="uplink rate (peer -> hub), e.g. 10mbit; 0: unlimited")
    parser.add_argument("--down", default="0", help="downlink rate (hub -> peer); 0: unlimited")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter of each packet's delay, +/-")
    parser.add_argument("--loss", type=float, default=0.0, help="probability a packet is lost, each direction")
    parser.add_argument("--queue-ms", type=float, default=100.0, help="drop-tail queue, in milliseconds at the rate")
    parser.add_argument(
        "--alt-delay-ms",
        type=float,
        help="one-way delay after SIGUSR1 (the next SIGUSR1 switches back; default: --delay-ms)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--nice",
        type=int,
        default=-10,
        help="scheduling priority (the emulator's wake-ups are its delay error; peers compete for the cores)",
    )
    args = parser.parse_args(argv)
    try:
        up_bps, down_bps = parse_rate(args.up), parse_rate(args.down)
    except ValueError as exc:
        parser.error(str(exc))
    if not 0.0 <= args.loss < 1.0:
        parser.error(f"--loss must be in [0, 1), got {args.loss}")
    if args.delay_ms < 0 or args.jitter_ms < 0 or args.jitter_ms > args.delay_ms or args.queue_ms <= 0:
        parser.error("--delay-ms and --jitter-ms must be >= 0 with jitter <= delay, and --queue-ms > 0")
    if args.alt_delay_ms is not None and args.alt_delay_ms < args.jitter_ms:
        parser.error("--alt-delay-ms must be at least --jitter-ms")
    rng = random.Random(args.seed)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    except OSError as exc:  # not root: the default priority, with a larger delay error under load
        logger.warning("linkem: cannot set priority %d: %s", args.nice, exc)

    def direction(bps: float) -> Direction:
        queue = max(MAX_PACKET, int(bps * args.queue_ms / 1000 / 8)) if bps else 1 << 30
        alt = (args.delay_ms if args.alt_delay_ms is None else args.alt_delay_ms) / 1000
        return Direction(bps, args.delay_ms / 1000, args.jitter_ms / 1000, args.loss, queue, rng, alt)

    try:
        hub_fd = open_tun(args.hub_dev) if args.hub_ns is None else None
        enter_netns(args.peer_ns)
        peer_fd = open_tun(args.peer_dev)
        if hub_fd is None:
            enter_netns(args.hub_ns)
            hub_fd = open_tun(args.hub_dev)
    except OSError as exc:
        print(f"linkem: error: cannot open the TUN devices: {exc} (needs root and /dev/net/tun)", file=sys.stderr)
        return 1
    print("ready", flush=True)
    run(peer_fd, hub_fd, direction(up_bps), direction(down_bps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
