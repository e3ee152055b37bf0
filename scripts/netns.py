"""Private, rate-limited networks for benchmarks: one Linux network namespace per peer behind a ``tc tbf`` veth.

Used by scripts/bench_sync.py and scripts/compare.py (both run as scripts, so ``scripts/`` is on ``sys.path``):

    reason = NetNS.unavailable_reason()      # None when running as root with ip netns and tc
    net = NetNS(num_peers=3, rate="100mbit")
    net.setup()                              # raises RuntimeError (namespaces made so far stay for teardown)
    ["ip", "netns", "exec", net.peer_ns(i), *cmd]   # runs cmd in peer i's namespace, reachable at net.host(i)
    net.teardown()                           # kills what still runs inside, deletes the namespaces; idempotent

Nothing is configured outside the namespaces created here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time

SUBNET = "10.77.0"
FIRST_HOST_INDEX = 10


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")


class NetNS:
    """A private network: a hub namespace with a bridge, and one namespace per peer with a rate-limited veth.

    Peer ``i`` gets address 10.77.0.(10+i) in namespace ``<prefix>p<i>``; its veth is limited by ``tc tbf`` at
    ``rate`` on both ends (the peer's egress is its uplink, the hub end's egress its downlink). All links are
    created inside these namespaces, so deleting them removes everything.
    """

    def __init__(self, num_peers: int, rate: str, *, prefix: str = "plbs") -> None:
        self.prefix = f"{prefix}{os.getpid() % 100000}"
        self.hub = f"{self.prefix}h"
        self.rate = rate
        self.names: list[str] = []
        self.num_peers = num_peers
        self._lock = threading.Lock()

    @staticmethod
    def unavailable_reason() -> str | None:
        if os.geteuid() != 0:
            return "needs root with ip netns and tc"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "needs root with ip netns and tc"
        return None

    def peer_ns(self, index: int) -> str:
        return f"{self.prefix}p{index}"

    def host(self, index: int) -> str:
        return f"{SUBNET}.{FIRST_HOST_INDEX + index}"

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.names.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def setup(self) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        self._add_ns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        for i in range(self.num_peers):
            ns = self.peer_ns(i)
            self._add_ns(ns)
            hub_end = f"v{i}"
            _run(["ip", "-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", self.hub, "link", "set", hub_end, "master", "br0"])
            _run(["ip", "-n", self.hub, "link", "set", hub_end, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", hub_end, "root", *tbf])
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf])
        # the bridge needs a moment to forward; check the path from the first peer to the last
        for _ in range(50):
            probe = subprocess.run(
                ["ip", "netns", "exec", self.peer_ns(0), "ping", "-c", "1", "-W", "1", self.host(self.num_peers - 1)],
                capture_output=True,
                timeout=10,
                check=False,
            )
            if probe.returncode == 0 or shutil.which("ping") is None:
                break
            time.sleep(0.2)

    def teardown(self) -> None:
        """Kill whatever still runs inside the namespaces, then delete them (idempotent)."""
        with self._lock:
            names, self.names = self.names, []
        for name in reversed(names):
            with contextlib.suppress(Exception):
                pids = subprocess.run(
                    ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10, check=False
                ).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(Exception):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)


def rate_label(rate: str) -> str:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        return rate
    return f"{m.group(1)} {m.group(2).upper()}bit/s" if m.group(2) else f"{m.group(1)} bit/s"
