"""The churn of ``experiments/soak/soak.py``: its processes across their incarnations (:class:`Member`) and the events
that kill, restart, start late and stall them, at fractions of the run (:func:`schedule`, :class:`Event`).

Pure data: the supervisor applies the events (``Soak.apply``); nothing here starts or signals a process.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness import procs


@dataclass
class Event:
    """At swarm round ``round`` (the newest round any peer finished), do ``action`` to process ``target``."""

    round: int
    action: str  # start | kill | kill_after_push | stall:S | restart
    target: str  # "peer<i>" or "sub<i>"
    done: bool = False


def schedule(peers: int, rounds: int, averaging_timeout: float) -> list[Event]:
    """The churn of a run, as fractions of ``rounds``: a late join, kills (one right after a push) and restarts,
    a short and a long stall (SIGSTOP while fetching, past the averaging timeout the second time), a client's
    crash, and a subscriber killed and restarted."""

    def at(fraction: float) -> int:
        return max(1, round(rounds * fraction))

    late = peers - 3 if peers >= 5 else None
    long_target = "peer2" if peers >= 5 else "peer0"  # with 4 peers, peer2 is the client and peer3 the poisoner
    # A short run restarts the killed peer at once: a restart a round later, on a loaded machine, can come up after
    # the last round, and then neither it nor an event aimed at it happens (a fresh-clone CI run timed out so, with
    # 10 rounds). Its stalls come early, the long one for 1.5 averaging timeouts: a stalled peer that resumes after
    # the others finished spends the run's last 25 s alone (and a stall aimed at it then never happens).
    short = rounds < 30
    restart, short_at, long_at, long_factor = (0.16, 0.2, 0.4, 1.5) if short else (0.26, 0.32, 0.56, 2.5)
    events = [
        Event(at(0.16), "kill_after_push", "peer1"),
        Event(at(restart), "restart", "peer1"),
        Event(at(short_at), f"stall:{averaging_timeout * 0.6:.1f}", "peer0"),
        Event(at(0.3), "kill", "sub1"),
        Event(at(0.5), "restart", "sub1"),
        Event(at(long_at), f"stall:{averaging_timeout * long_factor:.1f}", long_target),
    ]
    if late is not None:
        events.append(Event(at(0.1), "start", f"peer{late}"))
    if not short:
        events += [
            Event(at(0.4), "kill", "peer0"),
            Event(at(0.46), "restart", "peer0"),
            Event(at(0.66), "kill", f"peer{peers - 2}"),
            Event(at(0.72), "restart", f"peer{peers - 2}"),
            Event(at(0.8), f"stall:{averaging_timeout:.1f}", "peer1"),
        ]
    return sorted(events, key=lambda e: e.round)


@dataclass
class Member:
    """A process of the soak (``peer<i>``, ``pub``, ``sub<i>``) across its incarnations: ``proc`` is the current
    one (None while it is not running)."""

    name: str
    cmd: list[str]
    proc: procs.Proc | None = None
    incarnation: int = 0
