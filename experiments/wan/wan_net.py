"""A private WAN for local test hosts: one network namespace per peer, each behind its own emulated access link
(:mod:`linkem`: rate up and down, delay, jitter, loss), joined by a hub namespace that forwards between them.

    net = WanNet([Link(up="10mbit", down="50mbit", delay_ms=20), Link(delay_ms=50, loss=0.005)])
    net.setup()                                  # namespaces, TUN devices, one linkem process per peer
    ["ip", "netns", "exec", net.peer_ns(i), ...] # a command inside peer i's namespace, reachable at net.host(i)
    net.teardown()                               # stops the emulators, kills what runs inside, deletes it all

Peer ``i`` has address ``SUBNET``.(10+i) (10.77.0 by default) on ``tun0``, its only route; in the hub, TUN ``t<i>``
routes to it. Between peers A and B the round-trip time is ``2 (delay(A) + delay(B))`` and a transfer from A to B
runs at most at ``min(up(A), down(B))``.

A peer in ``nat`` is a volunteer behind a home router: it has the private address 192.168.(i).2 and a default
route through its link, and the hub translates its connections to the address ``SUBNET``.(200+i) on the way out
(iptables SNAT) and forwards to it nothing but their replies (a new connection towards it is dropped), so it can
connect to anyone and nobody can connect to it. With a ``subnet`` that libp2p counts as public (not RFC 1918:
``PUBLIC_SUBNET``) the public peers can serve it as circuit relays, as on the internet.

Nothing is configured outside the namespaces created here, so deleting them removes everything. The namespaces,
addresses and teardown are :class:`harness.netns.NetNS`'s (scripts/harness: a program puts ``scripts/`` on
``sys.path`` before importing this module); the links are these. Failure behaviour:
:meth:`WanNet.setup` raises RuntimeError naming the command or emulator that failed, leaving what exists to
:meth:`WanNet.teardown` (idempotent, never raises).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from harness.netns import SUBNET, NetNS, run_command

LINKEM = Path(__file__).resolve().parent / "linkem.py"
READY_TIMEOUT_S = 20.0
PUBLIC_SUBNET = "11.77.0"
"""A /24 that libp2p counts as public (relay addresses are built only through public relays); it exists only inside
the namespaces made here, as ``tests/nat_lab.py``'s test internet does."""


@dataclass(frozen=True)
class Link:
    """One peer's access link: rates (``tc`` style, ``0`` unlimited), one-way delay and jitter of each
    direction in milliseconds, and the loss probability of each direction."""

    up: str = "0"
    down: str = "0"
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    queue_ms: float = 100.0
    alt_delay_ms: float | None = None
    """The one-way delay :meth:`WanNet.switch_delay` swaps in (a route change); None: no change."""

    def argv(self) -> list[str]:
        """The link as :mod:`linkem` flags."""
        alt = [] if self.alt_delay_ms is None else ["--alt-delay-ms", str(self.alt_delay_ms)]
        return [
            "--up", self.up, "--down", self.down, "--delay-ms", str(self.delay_ms), "--jitter-ms",
            str(self.jitter_ms), "--loss", str(self.loss), "--queue-ms", str(self.queue_ms), *alt,
        ]  # fmt: skip


class WanNet(NetNS):
    """Namespaces and emulated links for ``links`` (one per peer); see the module docstring."""

    def __init__(
        self,
        links: list[Link],
        *,
        mtu: int = 1500,
        prefix: str = "plwan",
        seed: int = 0,
        subnet: str = SUBNET,
        nat: frozenset[int] = frozenset(),
    ) -> None:
        if not links:
            raise ValueError("a WAN needs at least one peer link")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be in [576, 65535], got {mtu}")
        if not all(0 <= i < min(len(links), 190) for i in nat):
            raise ValueError(f"nat must name peers in [0, {min(len(links), 190)}), got {sorted(nat)}")
        super().__init__(len(links), rate="emulated", prefix=prefix, subnet=subnet)
        self.nat = frozenset(nat)
        self.links = list(links)
        self.mtu = mtu
        self.seed = seed
        self.emulators: list[subprocess.Popen[str]] = []

    def host(self, index: int) -> str:
        """Peer ``index``'s own address: on the WAN, or its home network's behind NAT."""
        return f"192.168.{index}.2" if index in self.nat else super().host(index)

    def public_host(self, index: int) -> str:
        """The address the others see peer ``index``'s connections come from (its router's behind NAT)."""
        return f"{self.subnet}.{200 + index}" if index in self.nat else super().host(index)

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this WAN cannot be built here (not root, no ``ip``, no /dev/net/tun); None when it can be tried."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return "needs root with ip netns"
        if not os.path.exists("/dev/net/tun"):
            return "needs /dev/net/tun (TUN devices)"
        return None

    def setup(self) -> None:
        """Create the hub and the peers' namespaces, their TUN devices and routes, and start one emulator per
        peer; returns once every emulator has opened its devices. Raises RuntimeError."""
        self._add_ns(self.hub)
        run_command(["ip", "netns", "exec", self.hub, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        for i in range(len(self.links)):
            ns, hub_dev = self.peer_ns(i), f"t{i}"
            self._add_ns(ns)
            for where, dev in ((ns, "tun0"), (self.hub, hub_dev)):
                run_command(["ip", "-n", where, "tuntap", "add", "dev", dev, "mode", "tun"])
                run_command(["ip", "-n", where, "link", "set", dev, "mtu", str(self.mtu), "up"])
            run_command(["ip", "-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", "tun0"])
            run_command(["ip", "-n", self.hub, "route", "add", f"{self.host(i)}/32", "dev", hub_dev])
            if i in self.nat:
                self._add_nat(i)
        for i, link in enumerate(self.links):
            argv = [sys.executable, str(LINKEM), "--peer-ns", self.peer_ns(i), "--hub-dev", f"t{i}"]
            argv += [*link.argv(), "--seed", str(self.seed + i)]
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hub, *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            with self._lock:
                self.emulators.append(proc)
            self._wait_ready(i, proc)

    def _add_nat(self, index: int) -> None:
        """Peer ``index`` behind a home router (module docstring): a default route through its link; in the hub,
        its connections leave as :meth:`public_host` and nothing new is forwarded to it. Raises RuntimeError."""
        ns, chain = self.peer_ns(index), ["ip", "netns", "exec", self.hub, "iptables", "-w"]
        run_command(["ip", "-n", ns, "route", "add", "default", "dev", "tun0"])
        private, public = self.host(index), self.public_host(index)
        run_command([*chain, "-t", "nat", "-A", "POSTROUTING", "-s", private, "-j", "SNAT", "--to-source", public])
        new = ["-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"]
        run_command([*chain, "-A", "FORWARD", "-d", private, *new])

    def _wait_ready(self, index: int, proc: subprocess.Popen[str]) -> None:
        """Wait for the emulator's ``ready`` line (:data:`READY_TIMEOUT_S`); raises RuntimeError."""
        if proc.stdout is None:
            raise RuntimeError(f"link emulator of peer {index} has no stdout pipe")
        timer = threading.Timer(READY_TIMEOUT_S, proc.kill)
        timer.start()
        try:
            line = proc.stdout.readline().strip()
        finally:
            timer.cancel()
        if line != "ready":
            err = proc.stderr.read() if proc.stderr is not None and proc.poll() is not None else ""
            raise RuntimeError(f"link emulator of peer {index} did not start: {err.strip() or 'no ready line'}")

    def switch_delay(self, index: int) -> None:
        """Swap peer ``index``'s one-way delay with its link's ``alt_delay_ms`` (and back on the next call).
        Raises RuntimeError if its emulator is not running."""
        with self._lock:
            proc = self.emulators[index] if index < len(self.emulators) else None
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"the link emulator of peer {index} is not running")
        proc.send_signal(signal.SIGUSR1)

    def partition(self, side: list[int]) -> None:
        """Cut every path between the peers in ``side`` and the others, in the hub (packets dropped both ways,
        as by a failed route; nothing is rejected), until :meth:`heal`. Raises RuntimeError."""
        chain = ["ip", "netns", "exec", self.hub, "iptables", "-w"]
        others = [i for i in range(len(self.links)) if i not in side]
        run_command([*chain, "-N", "PARTITION"])
        for a in side:
            for b in others:
                for src, dst in ((a, b), (b, a)):
                    run_command([*chain, "-A", "PARTITION", "-s", self.host(src), "-d", self.host(dst), "-j", "DROP"])
        run_command([*chain, "-I", "FORWARD", "-j", "PARTITION"])  # all at once

    def heal(self) -> None:
        """Undo :meth:`partition` (all paths at once). Raises RuntimeError."""
        chain = ["ip", "netns", "exec", self.hub, "iptables", "-w"]
        run_command([*chain, "-D", "FORWARD", "-j", "PARTITION"])
        run_command([*chain, "-F", "PARTITION"])
        run_command([*chain, "-X", "PARTITION"])

    def teardown(self) -> None:
        """Stop the emulators, then :meth:`NetNS.teardown`: kill what still runs inside, delete the namespaces."""
        with self._lock:
            emulators, self.emulators = self.emulators, []
        for proc in emulators:
            with contextlib.suppress(Exception):
                proc.terminate()
                proc.communicate(timeout=5)
            with contextlib.suppress(Exception):
                proc.kill()
        super().teardown()


def process_cpu(roots: list[int]) -> dict[str, dict[str, float]]:
    """CPU seconds (user + system) so far of the living processes ``roots`` and their descendants, by kind:
    ``trainer`` and ``bootstrap`` (wan_peer.py), ``p2pd`` (their hivemind daemons), ``emulator`` (linkem.py) and
    ``other``; each kind's ``seconds`` and ``processes``. Reads /proc; a process that exits while it is read is
    skipped."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, parent in parents.items():
        children[parent].append(pid)
    found: dict[str, dict[str, float]] = {}
    stack = [pid for pid in roots if pid in times]
    while stack:
        pid = stack.pop()
        stack.extend(children[pid])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "linkem.py" in cmdline:
            kind = "emulator"
        elif "wan_peer.py train" in cmdline:
            kind = "trainer"
        elif "wan_peer.py bootstrap" in cmdline:
            kind = "bootstrap"
        elif "p2pd" in cmdline.split(" ")[0]:
            kind = "p2pd"
        else:
            kind = "other"
        slot = found.setdefault(kind, {"seconds": 0.0, "processes": 0})
        slot["seconds"] += times.get(pid, 0.0)
        slot["processes"] += 1
    return found


def machine_busy_seconds() -> tuple[float, int]:
    """The machine's busy CPU seconds so far (every core, /proc/stat: all but idle and iowait) and its cores."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
