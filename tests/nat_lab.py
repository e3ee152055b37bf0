"""Real NAT for tests: Linux network namespaces with home routers that masquerade (iptables).

Topology (every name carries a per-instance prefix, so parallel runs do not clash; nothing is added to the
namespace the tests run in, and no traffic leaves the namespaces made here)::

    PREFIX-pub   the public internet: bridge br0, PUBLIC_NET.1/24 (bootstrap, public peers)
        |  br0 -- veth -- wan0
    PREFIX-r1    home router 1: wan0 PUBLIC_NET.11/24, lan0 192.168.1.1/24, MASQUERADE out of wan0,
        |                       FORWARD: lan -> wan, and replies only (nothing new comes in)
    PREFIX-h1    a volunteer's host: lan0 192.168.1.2/24, default route via the router
    (PREFIX-r2 / PREFIX-h2 likewise with 192.168.2.0/24, and so on)

A volunteer in ``hN`` connects out to anything in ``pub`` (its packets leave with the router's address) but
cannot be reached: ``pub`` has no route to 192.168.N.0/24, and the router forwards no new inbound connection.

The public addresses are in ``PUBLIC_NET`` (default ``11.0.0.0/24``): libp2p treats the RFC 1918 and
documentation ranges as private or unroutable and builds relay addresses only for public ones, so the test
internet uses a range libp2p calls public. It exists only inside these namespaces.

Usage: :func:`unavailable_reason` says why namespaces cannot be used here (tests skip with it), and
:class:`NatLab` is a context manager that builds the topology and always tears it down (processes in its
namespaces are killed, the namespaces deleted, which removes their veths and iptables rules with them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PUBLIC_NET = "11.0.0"
"""First three octets of the test internet (a /24 inside the ``pub`` namespace)."""

_APT_TIMEOUT_S = 300


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _install_iptables() -> str | None:
    """Install Debian's iptables package (as root, non-interactive, bounded); the reason it could not, or None."""
    if shutil.which("apt-get") is None:
        return "iptables is not installed and there is no apt-get to install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "iptables"]
    try:
        result = subprocess.run(install, capture_output=True, text=True, timeout=_APT_TIMEOUT_S, env=env)
        if result.returncode != 0:  # stale package lists: refresh once and retry
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=_APT_TIMEOUT_S, env=env)
            result = subprocess.run(install, capture_output=True, text=True, timeout=_APT_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"iptables is not installed and apt-get could not install it: {exc}"
    if result.returncode != 0:
        return f"iptables is not installed and `apt-get install iptables` failed: {result.stderr.strip()[-300:]}"
    return None


_REASON: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why NAT namespaces cannot be built here (not root, no ``ip``, no namespaces, no iptables/NAT in the
    kernel), or None when they can. Installs iptables with apt-get when it is missing and we are root. Cached."""
    if _REASON:
        return _REASON[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    elif shutil.which("ip") is None:
        reason = "iproute2's `ip` is not installed"
    elif shutil.which("iptables") is None:
        reason = _install_iptables()
        if reason is None and shutil.which("iptables") is None:
            reason = "apt-get installed iptables but it is not on PATH"
    if reason is None:
        probe = f"plprobe-{secrets.token_hex(3)}"
        try:
            made = _run(["ip", "netns", "add", probe], check=False)
            if made.returncode != 0:
                reason = f"cannot create a network namespace: {made.stderr.strip()}"
            else:
                nat = _run(
                    ["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE"],
                    check=False,
                )
                if nat.returncode != 0:
                    reason = f"iptables NAT does not work in a namespace: {nat.stderr.strip()}"
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    _REASON.append(reason)
    return reason


@dataclass(frozen=True)
class Home:
    """A volunteer's host behind its own router."""

    ns: str
    """Namespace of the volunteer's processes."""
    router: str
    """Namespace of its router (MASQUERADE)."""
    lan_ip: str
    """The host's private address."""
    wan_ip: str
    """The router's public address: what others see as the volunteer's source address."""


class NatLab:
    """A public namespace and ``num_homes`` home networks behind masquerading routers (see the module docstring).

    Use as a context manager; :meth:`close` (also on errors) kills every process left in the namespaces and
    deletes them. Raises :class:`RuntimeError` naming the failed ``ip``/``iptables`` command when the topology
    cannot be built (after tearing down what was built).
    """

    def __init__(self, num_homes: int = 1, *, prefix: str | None = None) -> None:
        if not 1 <= num_homes <= 8:
            raise ValueError(f"num_homes must be 1..8, got {num_homes}")
        self.prefix = prefix or f"pl{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.public = f"{self.prefix}-pub"
        self.public_ip = f"{PUBLIC_NET}.1"
        self.homes = [
            Home(f"{self.prefix}-h{i}", f"{self.prefix}-r{i}", f"192.168.{i}.2", f"{PUBLIC_NET}.{10 + i}")
            for i in range(1, num_homes + 1)
        ]
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- building ------------------------------------------------------------------------------------------

    def _ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _in(self, ns: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", ns, *argv])

    def _build(self) -> None:
        pub = self.public
        self._ns(pub)
        _run(["ip", "-n", pub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", pub, "addr", "add", f"{self.public_ip}/24", "dev", "br0"])
        _run(["ip", "-n", pub, "link", "set", "br0", "up"])
        for i, home in enumerate(self.homes, start=1):
            r, h = home.router, home.ns
            self._ns(r)
            self._ns(h)
            # WAN: router <-> bridge port in pub
            _run(["ip", "-n", r, "link", "add", "wan0", "type", "veth", "peer", "name", f"port{i}", "netns", pub])
            _run(["ip", "-n", pub, "link", "set", f"port{i}", "master", "br0", "up"])
            _run(["ip", "-n", r, "addr", "add", f"{home.wan_ip}/24", "dev", "wan0"])
            _run(["ip", "-n", r, "link", "set", "wan0", "up"])
            # LAN: host <-> router
            _run(["ip", "-n", h, "link", "add", "lan0", "type", "veth", "peer", "name", "lan0", "netns", r])
            _run(["ip", "-n", r, "addr", "add", f"192.168.{i}.1/24", "dev", "lan0"])
            _run(["ip", "-n", r, "link", "set", "lan0", "up"])
            _run(["ip", "-n", h, "addr", "add", f"{home.lan_ip}/24", "dev", "lan0"])
            _run(["ip", "-n", h, "link", "set", "lan0", "up"])
            _run(["ip", "-n", h, "route", "add", "default", "via", f"192.168.{i}.1"])
            # the router: forward out, masquerade, let only replies back in
            self._in(r, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            self._in(r, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
            self._in(r, "iptables", "-P", "FORWARD", "DROP")
            self._in(r, "iptables", "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
            self._in(
                r, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"
            )
        logger.info("NAT lab %s: public %s, homes %s", self.prefix, self.public_ip, [h.wan_ip for h in self.homes])

    # ---- processes -----------------------------------------------------------------------------------------

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (``ip netns exec`` execs it: the process is our child)."""
        if ns not in self._namespaces:
            raise ValueError(f"{ns!r} is not a namespace of this lab ({self._namespaces})")
        return ["ip", "netns", "exec", ns, *argv]

    def popen(self, ns: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``ns`` (a new process group); it is killed and reaped by :meth:`close`."""
        proc = subprocess.Popen(self.command(ns, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def reachable(self, ns: str, ip: str, port: int, timeout: float = 2.0) -> bool:
        """Whether a TCP connection from namespace ``ns`` to ``ip:port`` succeeds (bash's /dev/tcp)."""
        script = f"exec 3<>/dev/tcp/{ip}/{port}"
        result = subprocess.run(
            ["ip", "netns", "exec", ns, "timeout", str(timeout), "bash", "-c", script], capture_output=True
        )
        return result.returncode == 0

    def leftover_pids(self, timeout: float = 10.0) -> list[int]:
        """Processes still running in the lab's namespaces after up to ``timeout`` s (a peer that exited
        cleanly leaves none: no DHT process, no p2pd daemon)."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self._kill_namespace_pids(0)
            if not pids or time.monotonic() >= deadline:
                return pids
            time.sleep(0.2)

    # ---- teardown ------------------------------------------------------------------------------------------

    def _kill_namespace_pids(self, sig: int) -> list[int]:
        pids = []
        for ns in self._namespaces:
            out = _run(["ip", "netns", "pids", ns], check=False).stdout
            for word in out.split():
                with contextlib.suppress(ValueError, ProcessLookupError):
                    os.kill(int(word), sig)
                    pids.append(int(word))
        return pids

    def close(self) -> None:
        """Kill every process in the lab's namespaces (SIGTERM, then SIGKILL after 5 s), reap those we started,
        and delete the namespaces (their veths and iptables rules go with them). Safe to call twice."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        self._kill_namespace_pids(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (
            any(p.poll() is None for p in self._procs) or self._kill_namespace_pids(0)
        ):
            time.sleep(0.1)
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self._kill_namespace_pids(signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._procs.clear()
        for ns in reversed(self._namespaces):
            result = _run(["ip", "netns", "del", ns], check=False)
            if result.returncode != 0:
                logger.warning("could not delete namespace %s: %s", ns, result.stderr.strip())
        self._namespaces.clear()

    def __enter__(self) -> NatLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
