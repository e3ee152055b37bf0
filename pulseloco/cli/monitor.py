"""``pulseloco monitor``: the whole swarm's progress, polled from the DHT and logged to an experiment tracker.

Each poll reads the run's records with :func:`pulseloco.cli.status.collect_status` (the reading, validation and
agreement rule of ``pulseloco status``; providers are not probed) and logs two families of series through
accelerate's tracker API (``Accelerator(log_with=..., project_dir=...)``: tensorboard, wandb, trackio, mlflow, ...).

The step axis is the **swarm round**: the number of outer rounds the swarm has completed, the *reference round* of
``pulseloco status`` (the round most peers' state records report). One axis for every series keeps steps
non-decreasing, which wandb and others require; a step is never logged below one already logged.

- ``swarm/*``, ``sync/*``, ``workers/*`` and ``worker_lag/<peer id>`` (:func:`swarm_values`): the swarm as the last
  poll at swarm round R saw it, logged at step R once the swarm has moved past R (or when the monitor stops). A
  swarm round therefore gets one point, its settled state; a stalled swarm gets its point when the monitor stops.
- ``round/*`` (:func:`round_values`): the totals of outer round ``r`` (``RoundMetrics.round``, 0-based) over the
  peers that report it and the wire bytes sent and received per peer, logged once at step ``r + 1`` (the swarm
  round its completion reached), when every member of its group has reported it, or when the swarm has completed
  :data:`SETTLE_ROUNDS` more rounds (a member died; only for rounds that had not completed at the monitor's first
  poll: :class:`RoundLedger`).
  The numbers come from the ``rounds`` list of the peers' state records
  (:class:`pulseloco.loco.peers.RoundRecord`): each peer's last 16 rounds, so a monitor started late logs
  the rounds still in the records, and a poll interval shorter than 16 rounds loses none. Rounds not final when
  the monitor stops are not logged.

Records are hints written by strangers: :func:`collect_status` skips malformed ones and counts them
(``swarm/malformed_records``, ``workers/malformed``); only records of rounds before the reference round (rounds
the swarm has completed) feed the round totals, a peer ahead's included. A swarm round that goes back (a new run
under the same run id while the old run's records live, or a lone leftover or bogus record far ahead when the
monitor started, before the trainers published) restarts the series (:meth:`SwarmMonitor.observe`; a warning says
so).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO, get_args

from pulseloco.cli.status import PeerReport, PeerStatus, SwarmStatus, collect_status
from pulseloco.errors import ConfigError, SwarmError
from pulseloco.loco.peers import RoundRecord

logger = logging.getLogger(__name__)

__all__ = [
    "SETTLE_ROUNDS",
    "AccelerateTracker",
    "RoundLedger",
    "RoundTotals",
    "SwarmMonitor",
    "Tracker",
    "check_report_to",
    "render_watch",
    "round_values",
    "run_monitor",
    "swarm_values",
]

SETTLE_ROUNDS = 2
"""A round not reported by every member of its group is logged anyway once the swarm completed this many more."""

MAX_WORKER_SERIES = 32
"""Most ``worker_lag/<peer id>`` series logged per poll (the first by peer id): worker records are written by
anyone, and each new id would make a new series."""

_STATUSES: tuple[PeerStatus, ...] = get_args(PeerStatus)


@dataclass(frozen=True)
class RoundTotals:
    """One outer round summed over the peers whose state records carry it."""

    round: int
    """Index of the outer round (``RoundMetrics.round``)."""
    group_size: int
    """The largest group size a peer reported for it (0 when every reporting peer sat it out)."""
    reports: int
    """Peers that averaged in it and reported it (``group_size`` when all did)."""
    contributors: int
    """The largest number of contributions a peer saw aggregated in it."""
    bytes_sent: int
    """Wire bytes sent for its averaging, summed over the reporting peers."""
    bytes_received: int
    """Wire bytes received for it, summed over the reporting peers."""
    sat_out: int
    """Peers that reported sitting it out (in no group)."""


def _totals(round_index: int, entries: Iterable[RoundRecord]) -> RoundTotals:
    entries = list(entries)
    averaged = [e for e in entries if e.num_peers > 0]
    return RoundTotals(
        round=round_index,
        group_size=max((e.num_peers for e in averaged), default=0),
        reports=len(averaged),
        contributors=max((e.num_contributors for e in averaged), default=0),
        bytes_sent=sum(e.bytes_sent for e in entries),
        bytes_received=sum(e.bytes_received for e in entries),
        sat_out=len(entries) - len(averaged),
    )


class RoundLedger:
    """The peers' round records gathered across polls; each round is released once, in increasing order, when
    final: every member of its group reported it, or the swarm completed :data:`SETTLE_ROUNDS` more rounds since
    (a member died) and the round had not completed when the ledger's first poll came (rounds older than the
    monitor are released only complete: a lone record far ahead, a run's leftover, is never)."""

    def __init__(self) -> None:
        self._seen: dict[int, dict[str, RoundRecord]] = {}
        self.last_released = -1
        """The newest round released (-1: none yet); records of it and older rounds are ignored."""
        self.start_round: int | None = None
        """The reference round of the first poll: rounds from it on had not completed when the ledger began."""

    def update(self, peers: list[PeerReport], reference_round: int | None) -> list[RoundTotals]:
        """Take the round records of ``peers`` for rounds before ``reference_round`` (the swarm's completed rounds;
        also from a peer ahead of it) and return the rounds that became final, oldest first (older rounds still
        pending are released with them, with what was seen)."""
        if reference_round is None:
            return []
        if self.start_round is None:
            self.start_round = reference_round
        for peer in peers:
            for record in peer.rounds:
                # only rounds the swarm has completed: a peer ahead (one that finished a round first, or a record
                # alone far ahead) counts for those, never for rounds the majority has not reached
                if self.last_released < record.round < reference_round:
                    self._seen.setdefault(record.round, {})[peer.peer_id] = record
        final = -1
        for round_index, entries in self._seen.items():
            totals = _totals(round_index, entries.values())
            complete = totals.group_size > 0 and totals.reports >= totals.group_size
            settled = round_index >= self.start_round and reference_round - 1 - round_index >= SETTLE_ROUNDS
            if complete or settled:
                final = max(final, round_index)
        released = [_totals(r, self._seen.pop(r).values()) for r in sorted(self._seen) if r <= final]
        if released:
            self.last_released = released[-1].round
        return released


def round_values(totals: RoundTotals) -> dict[str, float]:
    """The ``round/*`` series of one round (logged at step ``totals.round + 1``): its totals, and the wire bytes
    sent and received per peer (``round/bytes_sent_per_peer``, ``round/bytes_received_per_peer``: the totals over
    the peers that averaged in it and reported it, ``reports``; left out when none did)."""
    values: dict[str, float] = {
        "round/index": totals.round,
        "round/group_size": totals.group_size,
        "round/reports": totals.reports,
        "round/contributors": totals.contributors,
        "round/bytes_sent": totals.bytes_sent,
        "round/bytes_received": totals.bytes_received,
        "round/sat_out": totals.sat_out,
    }
    if totals.reports:
        values["round/bytes_sent_per_peer"] = totals.bytes_sent / totals.reports
        values["round/bytes_received_per_peer"] = totals.bytes_received / totals.reports
    return values


def swarm_values(report: SwarmStatus) -> dict[str, float]:
    """The swarm's state in one poll: ``swarm/*`` (peers with a state record, the reference and newest rounds,
    peers per status, partial rounds, client-mode peers, malformed records), ``sync/*`` (head version when
    known, providers), ``workers/*`` (count, lag max and mean over the workers holding a version, workers without
    one, summed throughput and queue, malformed records, refused workers) and ``worker_lag/<peer id>`` for at most
    :data:`MAX_WORKER_SERIES` workers."""
    statuses = collections.Counter(p.status for p in report.peers)
    values: dict[str, float] = {"swarm/peers": len(report.peers)}
    if report.reference_round is not None:
        values["swarm/round"] = report.reference_round
        values["swarm/newest_round"] = max(p.round for p in report.peers)
    values.update({f"swarm/{status}": statuses[status] for status in _STATUSES})
    values["swarm/max_rounds_behind"] = max((p.rounds_behind for p in report.peers if p.status == "behind"), default=0)
    values["swarm/partial"] = sum(not p.complete for p in report.peers)
    values["swarm/client_mode"] = sum(p.client_mode for p in report.peers)
    values["swarm/malformed_records"] = report.malformed_states + report.malformed_rounds
    if report.head is not None and report.head.version is not None:
        values["sync/head_version"] = report.head.version
    values["sync/providers"] = len(report.providers)
    lags = [w.lag for w in report.workers if w.lag is not None]
    values["workers/count"] = len(report.workers)
    if lags:
        values["workers/max_lag"] = max(lags)
        values["workers/mean_lag"] = sum(lags) / len(lags)
    values["workers/without_version"] = sum(w.version < 0 for w in report.workers)
    values["workers/tokens_per_s"] = sum(w.tokens_per_s for w in report.workers)
    values["workers/samples_per_s"] = sum(w.samples_per_s for w in report.workers)
    values["workers/queue"] = sum(w.queue for w in report.workers)
    values["workers/malformed"] = report.malformed_workers
    values["workers/refused"] = len({r.worker for r in report.refused})
    with_lag = sorted((w.peer_id, w.lag) for w in report.workers if w.lag is not None)
    values.update({f"worker_lag/{peer}": lag for peer, lag in with_lag[:MAX_WORKER_SERIES]})
    return values


class Tracker(Protocol):
    """Where the series go: ``log(values, step)`` and ``close()`` (flush and finish)."""

    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_report_to(names: list[str]) -> list[str]:
    """The trackers of ``--report-to`` (``none`` alone: no tracker), checked against accelerate's list and the
    libraries installed. Raises :class:`ConfigError` naming the bad or missing one."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    if names == ["none"]:
        return []
    if "none" in names:
        raise ConfigError("--report-to none means no tracker: give it alone")
    available = {str(t.value) if hasattr(t, "value") else str(t) for t in get_available_trackers()}
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            known = ", ".join(["none", *sorted(LOGGER_TYPE_TO_CLASS)])
            raise ConfigError(f"--report-to {name!r} is not a tracker accelerate knows (choose from: {known})")
        if name not in available:
            raise ConfigError(f"--report-to {name}: its library is not installed (pip install {name})")
    return list(dict.fromkeys(names))


class AccelerateTracker:
    """accelerate's trackers for ``report_to``: ``Accelerator(cpu=True, log_with=report_to,
    project_dir=logging_dir)`` and ``init_trackers(run_name)`` (tensorboard writes ``logging_dir/run_name``).
    Construction raises :class:`ConfigError` when a tracker cannot start; :meth:`log` and :meth:`close` log a
    tracker's failure and never raise (the monitor goes on)."""

    def __init__(self, report_to: list[str], logging_dir: str, run_name: str) -> None:
        from accelerate import Accelerator

        try:
            self.accelerator = Accelerator(cpu=True, log_with=report_to, project_dir=logging_dir)
            self.accelerator.init_trackers(run_name)
        except Exception as exc:  # a tracker's own failure (no login, unwritable directory): say which
            raise ConfigError(f"could not start tracker(s) {', '.join(report_to)}: {exc}") from exc

    def log(self, values: dict[str, float], step: int) -> None:
        try:
            self.accelerator.log(values, step=step)
        except Exception as exc:  # a tracker's network or disk failure must not stop the monitor
            logger.warning("tracker log failed step=%d error=%r", step, exc)

    def close(self) -> None:
        try:
            self.accelerator.end_training()
        except Exception as exc:
            logger.warning("tracker close failed error=%r", exc)


class SwarmMonitor:
    """Turns successive :class:`SwarmStatus` polls into tracker series (see the module docstring for the steps).

    ``tracker`` None logs nothing (``--report-to none``: the terminal view only)."""

    def __init__(self, tracker: Tracker | None) -> None:
        self.tracker = tracker
        self.ledger = RoundLedger()
        self.polls = 0
        self.recent: collections.deque[RoundTotals] = collections.deque(maxlen=8)
        """The last rounds released, for the terminal view."""
        self.last_step = -1
        self._pending: tuple[int, dict[str, float]] | None = None
        """The latest poll's swarm values and its swarm round, logged once the swarm moves past that round."""
        self._high: int | None = None
        """The highest swarm round seen since the series (re)started."""

    def _log(self, values: dict[str, float], step: int) -> None:
        if step < self.last_step:
            logger.debug("not logging step=%d below step=%d already logged", step, self.last_step)
            return
        self.last_step = step
        if self.tracker is not None:
            self.tracker.log(values, step)

    def observe(self, report: SwarmStatus) -> list[RoundTotals]:
        """Log what one poll settles, in step order: the rounds that became final and the previous swarm round's
        state when the swarm moved past it. A swarm round below the highest seen restarts the series
        (:meth:`_restart`). Returns the rounds released."""
        self.polls += 1
        reference = report.reference_round
        if reference is not None and self._high is not None and reference < self._high:
            self._restart(reference)
        released = self.ledger.update(report.peers, reference)
        batch: list[tuple[int, dict[str, float]]] = [(t.round + 1, round_values(t)) for t in released]
        if reference is not None:
            self._high = reference if self._high is None else max(self._high, reference)
            if self._pending is not None and self._pending[0] != reference:
                batch.append(self._pending)
            self._pending = (reference, swarm_values(report))
        for step, values in sorted(batch, key=lambda item: item[0]):
            self._log(values, step)
        self.recent.extend(released)
        return released

    def _restart(self, reference_round: int) -> None:
        """The swarm round went back: a new run under the same run id while the old one's records live, or a
        lone record far ahead (a leftover, or bogus) when the monitor started. Forget what was seen (the pending
        swarm state is dropped) and log from this round again; when points were logged above it, trackers that
        need increasing steps (wandb) ignore the new ones until the step passes the old ones."""
        logger.warning(
            "the swarm round went back from %s to %d (a new run under the same run id, or a leftover or bogus "
            "record): restarting the series",
            self._high,
            reference_round,
        )
        self.ledger = RoundLedger()
        self.recent.clear()
        self._pending = None
        self._high = None
        self.last_step = -1

    def close(self) -> None:
        """Log the last swarm round's state and close the tracker (flushes it)."""
        if self._pending is not None:
            step, values = self._pending
            self._pending = None
            self._log(values, step)
        if self.tracker is not None:
            self.tracker.close()


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def render_watch(report: SwarmStatus, monitor: SwarmMonitor, *, interval: float) -> str:
    """The compact terminal view of one poll: peers by status, the last rounds released, the PULSESync head and
    the rollout workers' lag."""
    head = f"pulseloco monitor  run {report.run_id!r}  poll {monitor.polls}  {time.strftime('%H:%M:%S')}"
    lines = [f"{head}  (every {interval:g} s; Ctrl-C stops)"]
    if report.reference_round is None:
        lines.append(f"PULSELoCo: no state records under {report.state_key!r}")
    else:
        counts = collections.Counter(p.status for p in report.peers)
        states = "  ".join(f"{s} {counts[s]}" for s in _STATUSES)
        lines.append(f"PULSELoCo: {len(report.peers)} peer(s)  round {report.reference_round}  {states}")
    if report.malformed_states or report.malformed_rounds:
        lines.append(f"  malformed: {report.malformed_states} record(s), {report.malformed_rounds} round list(s)")
    if monitor.recent:
        lines.append("  ROUND  GROUP  REPORTS  CONTRIBUTORS        SENT    RECEIVED")
        for t in reversed(monitor.recent):
            lines.append(
                f"  {t.round:>5}  {t.group_size:>5}  {t.reports:>7}  {t.contributors:>12}  {_size(t.bytes_sent):>10}  "
                f"{_size(t.bytes_received):>10}"
            )
    version = None if report.head is None else report.head.version
    sync = "no head" if version is None else f"head v{version}"
    lines.append(f"PULSESync: {sync}  {len(report.providers)} provider(s)  {len(report.workers)} worker(s)")
    for w in report.workers[:MAX_WORKER_SERIES]:
        held = "none" if w.version < 0 else f"v{w.version}"
        lag = "-" if w.lag is None else str(w.lag)
        lines.append(f"  {w.peer_id[-12:]:>12}  {w.engine:<12}  {held:>6}  lag {lag:>3}  queue {w.queue}")
    refused = sorted({r.worker for r in report.refused})
    if refused:
        lines.append(f"  refused: {', '.join(w[-12:] for w in refused)}")
    return "\n".join(lines)


_CLEAR = "\x1b[H\x1b[2J"


def _poll(dht: Any, run_id: str, sync_run_id: str | None, timeout: float) -> SwarmStatus | None:
    """One :func:`collect_status` without probes; None (logged) when it failed, :class:`SwarmError` when the DHT
    process is gone."""
    try:
        return collect_status(dht, run_id, sync_run_id=sync_run_id, timeout=timeout, probe_timeout=None)
    except Exception as exc:  # a P2P replica that did not start in time, a daemon error: the next poll retries
        if not dht.is_alive():
            raise SwarmError(f"the monitor's DHT process died ({exc!r}); restart the monitor") from exc
        logger.warning("poll failed, retrying at the next one: %r", exc)
        return None


def run_monitor(
    dht: Any,
    monitor: SwarmMonitor,
    run_id: str,
    *,
    stop: threading.Event,
    sync_run_id: str | None = None,
    interval: float = 5.0,
    duration: float | None = None,
    timeout: float = 5.0,
    watch: TextIO | None = None,
) -> None:
    """Poll every ``interval`` seconds until ``stop`` is set or ``duration`` seconds passed, then close the
    monitor (its last swarm round is logged and the tracker flushed), also when a poll raises.

    Each DHT lookup waits at most ``timeout`` seconds (a lookup that fails reads as no record); a poll that fails
    otherwise is logged and skipped, and :class:`SwarmError` is raised once the DHT process has died. ``stop`` is
    checked between polls. ``watch``: write the terminal view there after each poll (the screen cleared first when
    it is a terminal). The DHT is the caller's (left running)."""
    deadline = None if duration is None else time.monotonic() + duration
    clear = _CLEAR if watch is not None and watch.isatty() else ""
    try:
        while not stop.is_set():
            started = time.monotonic()
            report = _poll(dht, run_id, sync_run_id, timeout)
            if report is not None:
                _show(report, monitor, monitor.observe(report), watch, clear, interval)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            wait = interval - (now - started)
            stop.wait(max(0.0, wait if deadline is None else min(wait, deadline - now)))
    finally:
        monitor.close()


def _show(
    report: SwarmStatus,
    monitor: SwarmMonitor,
    released: list[RoundTotals],
    watch: TextIO | None,
    clear: str,
    interval: float,
) -> None:
    """Log one poll's summary line (info) and write the terminal view to ``watch``."""
    logger.info(
        "poll=%d round=%s peers=%d rounds_logged=%s head=%s workers=%d",
        monitor.polls,
        report.reference_round,
        len(report.peers),
        [t.round for t in released],
        None if report.head is None else report.head.version,
        len(report.workers),
    )
    if watch is not None:
        watch.write(f"{clear or chr(10)}{render_watch(report, monitor, interval=interval)}\n")
        watch.flush()
