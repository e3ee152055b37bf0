"""Private, rate-limited networks for benchmarks: one Linux network namespace per peer behind a ``tc tbf`` veth.

    net, reason = open_netns(num_peers=3, rate="100mbit")   # (None, why) without root, ip netns and tc
    ["ip", "netns", "exec", net.peer_ns(i), *cmd]           # runs cmd in peer i's namespace, reachable at net.host(i)
    net.teardown()                                          # kills what still runs inside, deletes the namespaces

or step by step: ``NetNS.unavailable_reason()``, ``NetNS(...)``, ``setup()`` (raises RuntimeError; the namespaces
made so far stay for ``teardown``). :class:`harness.procs.Runner` starts processes inside a peer's namespace.
Nothing is configured outside the namespaces created here. Also: ``tc`` rate strings (:func:`rate_label`,
:func:`parse_rate`).
"""

from __future__ import annotations

import atexit
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


def run_command(cmd: list[str]) -> None:
    """Run one ``ip``/``tc`` command; raises RuntimeError with its stderr when it fails (30 s bound)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")


class NetNS:
    """A private network: a hub namespace with a bridge, and one namespace per peer with a rate-limited veth.

    Peer ``i`` gets address ``subnet``.(10+i) (10.77.0 by default) in namespace ``<prefix><pid>p<i>``; its veth is
    limited by ``tc tbf`` at ``rate`` on both ends (the peer's egress is its uplink, the hub end's egress its
    downlink). All links are created inside these namespaces, so deleting them removes everything.
    """

    def __init__(self, num_peers: int, rate: str, *, prefix: str = "plbs", subnet: str = SUBNET) -> None:
        self.subnet = subnet
        self.prefix = f"{prefix}{os.getpid() % 100000}"
        self.hub = f"{self.prefix}h"
        self.rate = rate
        self.names: list[str] = []
        self.num_peers = num_peers
        self._lock = threading.Lock()

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why namespaces cannot be made here (not root, no ``ip`` or ``tc``); None when they can be tried."""
        if os.geteuid() != 0:
            return "needs root with ip netns and tc"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "needs root with ip netns and tc"
        return None

    def peer_ns(self, index: int) -> str:
        """The name of peer ``index``'s namespace."""
        return f"{self.prefix}p{index}"

    def host(self, index: int) -> str:
        """Peer ``index``'s address on the private network."""
        return f"{self.subnet}.{FIRST_HOST_INDEX + index}"

    def exec_argv(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` run inside peer ``index``'s namespace."""
        return ["ip", "netns", "exec", self.peer_ns(index), *argv]

    def _add_ns(self, name: str) -> None:
        run_command(["ip", "netns", "add", name])
        self.names.append(name)
        run_command(["ip", "-n", name, "link", "set", "lo", "up"])

    def setup(self) -> None:
        """Create the hub, the peers' namespaces and their limited links; raises RuntimeError (or
        subprocess.TimeoutExpired) on the first command that fails, leaving what exists to :meth:`teardown`."""
        tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        self._add_ns(self.hub)
        run_command(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        run_command(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        for i in range(self.num_peers):
            ns = self.peer_ns(i)
            self._add_ns(ns)
            hub_end = f"v{i}"
            veth = ["ip", "-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0", "netns", ns]
            run_command(veth)
            run_command(["ip", "-n", self.hub, "link", "set", hub_end, "master", "br0"])
            run_command(["ip", "-n", self.hub, "link", "set", hub_end, "up"])
            run_command(["ip", "-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", "eth0"])
            run_command(["ip", "-n", ns, "link", "set", "eth0", "up"])
            run_command(["ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", hub_end, "root", *tbf])
            run_command(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf])
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
        """Kill whatever still runs inside the namespaces, then delete them (idempotent; never raises)."""
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


def open_netns(num_peers: int, rate: str, *, prefix: str = "plbs") -> tuple[NetNS | None, str | None]:
    """A private network set up and torn down at exit (also on errors): ``(net, None)``, or ``(None, reason)`` when
    namespaces are unavailable or their setup failed (no CAP_NET_ADMIN in a container, no tbf, ...); never raises
    for those."""
    reason = NetNS.unavailable_reason()
    if reason is not None:
        return None, reason
    net = NetNS(num_peers, rate, prefix=prefix)
    atexit.register(net.teardown)
    try:
        net.setup()
    except Exception as exc:
        net.teardown()
        return None, f"namespace setup failed: {exc}"
    return net, None


def rate_label(rate: str) -> str:
    """A ``tc`` rate for people: ``100mbit`` -> ``100 Mbit/s``; anything else unchanged."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        return rate
    return f"{m.group(1)} {m.group(2).upper()}bit/s" if m.group(2) else f"{m.group(1)} bit/s"


def parse_rate(rate: str) -> float | None:
    """A ``tc`` rate in bits per second (``100mbit``, ``1gbit``, ``12500kbps`` = bytes); None if unparsable."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        return None
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)
