"""``pulseloco status``: what the DHT records say about one run.

Reads, never writes: the PULSELoCo state records (:func:`pulseloco.keys.loco_state_key`, one per peer: last completed
round, parameter digest, client mode, whether that round was complete) and the PULSESync head and providers records
(``pulseloco:<sync run>:head`` / ``:providers``) of the run the recipes publish, ``<run_id>.policy`` (then ``<run_id>``
itself, for a ``pulseloco sync serve --run-id <run_id>``), and the rollout workers' records of that run
(``pulseloco:<sync run>:rollout_workers``, one per worker: engine, version held, throughput, queue, leases served;
:func:`pulseloco.keys.workers_key`).

Agreement rule (the exit code):

- The *reference round* is the round the most peers report as their latest; a tie goes to the newer round.
  A single peer alone ahead (a fast peer, or a bogus record) therefore cannot hide the others' comparison, and
  old records of crashed peers cannot mask the live ones.
- A peer at the reference round ``agree``\\ s when its digest is the majority digest of that round
  (:func:`pulseloco.loco.consensus.majority_digest`, the rule the trainers repair by: complete rounds outvote
  partial ones, ties go to a digest a server-mode peer holds, then the smallest), else it ``disagree``\\ s.
- A peer at a newer round is ``ahead`` when it matches the majority of *its* round, else it ``disagree``\\ s.
- A peer at an older round is ``behind`` and not compared: it downloads the state when it catches up, and a
  crashed peer's last record stays in the DHT until it expires.
- A peer another peer names as *disputed* (it served a poisoned average, or a shard owner excluded it for
  repeated outlier contributions) is ``disputed``: shown, left out of the votes as the trainers leave it out of
  their repairs, and not counted against the exit code (its state is not the swarm's).

Exit codes: :data:`EXIT_AGREE` (0) when no peer disagrees (no records at all included: the text says so and
names the key it looked up), :data:`EXIT_DISAGREE` (1) when one does, :data:`EXIT_CANNOT_JOIN` (2) for bad
arguments or a swarm that cannot be joined (the CLI's business; :func:`collect_status` needs a running DHT).

A provider is *reachable* when its fetch handler answers a probe (:meth:`SwarmEndpoint.probe
<pulseloco.sync.transport.SwarmEndpoint.probe>`: one libp2p dial and a one-message "missing" answer for an
object kind nobody holds) within the probe timeout.

A rollout worker's *lag* is the head version minus the version it serves (None while the head is unknown or the
worker holds no version yet). Workers are shown, never counted in the exit code; their records are unsigned hints
(a malformed one is skipped and counted in :attr:`SwarmStatus.malformed_workers`). Workers a trainer refused for the
run (its completions failed the trainer's checks, or its replies the protocol's) are listed with the trainer and the
reason, from the trainers' records (``pulseloco:<sync run>:refused_workers``,
:func:`pulseloco.keys.refused_key`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulseloco.errors import PayloadError, UnauthorizedError
from pulseloco.keys import loco_state_key, policy_run_id, refused_key, workers_key
from pulseloco.loco.consensus import distrusted, majority_digest
from pulseloco.loco.matchmaking import Matchmaker
from pulseloco.loco.peers import PeerState, RoundRecord
from pulseloco.rollouts.protocol import parse_refusals, parse_worker_record

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RUN_ID",
    "EXIT_AGREE",
    "EXIT_CANNOT_JOIN",
    "EXIT_DISAGREE",
    "HeadReport",
    "PeerReport",
    "ProviderReport",
    "SwarmStatus",
    "WorkerReport",
    "classify_peers",
    "collect_status",
    "render_text",
    "to_json",
]

EXIT_AGREE = 0
EXIT_DISAGREE = 1
EXIT_CANNOT_JOIN = 2
DEFAULT_RUN_ID = "pulseloco"
"""The trainers' default run id (``SwarmArguments.run_id``, ``PulseLoCo(run_id=...)``)."""


PeerStatus = Literal["agree", "ahead", "behind", "disagree", "disputed"]
"""Where a peer stands against the majority of its round (see :func:`classify_peers`)."""


@dataclass(frozen=True)
class PeerReport:
    """One PULSELoCo peer's state record and how it compares (``status``: agree, disagree, ahead, behind,
    disputed)."""

    peer_id: str
    client_mode: bool
    round: int
    digest: str
    complete: bool
    status: PeerStatus
    rounds_behind: int
    """Reference round minus this peer's round (negative when ahead)."""
    rounds: tuple[RoundRecord, ...] = ()
    """The peer's latest rounds from its record (group size, contributors, bytes), oldest first."""


@dataclass(frozen=True)
class HeadReport:
    """The PULSESync head record. ``verified``: True (signature checked with the given key), False (it failed:
    ``error`` says why; the fields shown are then the unverified claims), None (no key given: unverified)."""

    version: int | None
    digest: str | None
    anchor_version: int | None
    time: float | None
    verified: bool | None
    error: str | None = None


@dataclass(frozen=True)
class ProviderReport:
    """One peer announcing PULSESync objects; ``reachable`` is None when not probed (no probe asked for, or the
    reader's own peer), ``error`` says why it is unreachable."""

    peer_id: str
    publisher: bool
    num_versions: int
    min_version: int | None
    max_version: int | None
    reachable: bool | None
    error: str | None = None


@dataclass(frozen=True)
class WorkerReport:
    """One rollout worker's DHT record (:class:`pulseloco.rollouts.protocol.WorkerInfo`): the ``version`` it
    serves (-1: none yet), ``lag`` behind the head (None when the head or the worker's version is unknown),
    measured throughput, leases waiting in its ``queue`` and ``served`` so far, its ``max_new_tokens`` limit."""

    peer_id: str
    engine: str
    version: int
    lag: int | None
    tokens_per_s: float
    samples_per_s: float
    queue: int
    served: int
    max_new_tokens: int


@dataclass(frozen=True)
class RefusalReport:
    """A rollout worker that a trainer refused for the rest of the run, and why (the trainer's record under
    :func:`pulseloco.keys.refused_key`)."""

    worker: str
    trainer: str
    reason: str


@dataclass
class SwarmStatus:
    """Everything ``pulseloco status`` found for a run; :attr:`exit_code` applies the module's agreement rule."""

    run_id: str
    state_key: str
    peers: list[PeerReport] = field(default_factory=list)
    reference_round: int | None = None
    majority_digest: str | None = None
    malformed_states: int = 0
    """State records skipped because they were malformed."""
    malformed_rounds: int = 0
    """State records kept whose ``rounds`` list was malformed (dropped)."""
    sync_run_id: str | None = None
    """The PULSESync run whose records were found (None when none was)."""
    sync_run_ids: list[str] = field(default_factory=list)
    """Every PULSESync run id looked up, in order."""
    head: HeadReport | None = None
    providers: list[ProviderReport] = field(default_factory=list)
    probe_timeout: float | None = None
    """Seconds each provider had to answer the probe; None when providers were not probed."""
    workers: list[WorkerReport] = field(default_factory=list)
    """The rollout workers' valid records, newest version first, then by peer id."""
    workers_key: str | None = None
    """The DHT key the worker records were read from (None when no run id had any)."""
    malformed_workers: int = 0
    """Worker records skipped there because they were malformed."""
    refused: list[RefusalReport] = field(default_factory=list)
    """Workers the trainers refused (failed checks or bad replies), by worker then trainer."""

    @property
    def disagreeing(self) -> list[PeerReport]:
        return [p for p in self.peers if p.status == "disagree"]

    @property
    def exit_code(self) -> int:
        return EXIT_DISAGREE if self.disagreeing else EXIT_AGREE

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``pulseloco status --json``): the fields, plus ``exit_code`` and ``agree``."""
        out = asdict(self)
        out["agree"] = not self.disagreeing
        out["exit_code"] = self.exit_code
        return out


def classify_peers(states: list[PeerState]) -> tuple[int | None, str | None, list[PeerReport]]:
    """Apply the module's agreement rule: ``(reference round, its majority digest, one report per peer)``,
    peers sorted newest round first, then by peer id. ``(None, None, [])`` for no states."""
    distrust = distrusted(states)
    trusted = [s for s in states if s.peer_id not in distrust] or states
    if not states:
        return None, None, []
    counts: dict[int, int] = {}
    for s in trusted:
        counts[s.round] = counts.get(s.round, 0) + 1
    reference = max(counts, key=lambda r: (counts[r], r))
    majorities = {r: majority_digest(trusted, r) for r in counts}
    reports = []
    for s in sorted(states, key=lambda s: (-s.round, s.peer_id)):
        status: PeerStatus
        if s.peer_id in distrust:
            status = "disputed"
        elif s.round < reference:
            status = "behind"
        elif s.digest != majorities[s.round]:
            status = "disagree"
        else:
            status = "agree" if s.round == reference else "ahead"
        reports.append(
            PeerReport(s.peer_id, s.client_mode, s.round, s.digest, s.complete, status, reference - s.round, s.rounds)
        )
    return reference, majorities[reference], reports


def _head_report(blob: bytes, sync_run_id: str, public_key: Ed25519PublicKey | None) -> HeadReport:
    from pulseloco.sync.signing import parse_envelope_unverified, verify_envelope

    error = None
    verified: bool | None = None
    if public_key is not None:
        try:
            env = verify_envelope(public_key, blob, run_id=sync_run_id)
            verified = env.kind == "head"
            error = None if verified else f"signed record is a {env.kind} envelope, not a head"
        except (UnauthorizedError, PayloadError) as exc:
            verified, error = False, str(exc)
    try:
        env = parse_envelope_unverified(blob)
    except (UnauthorizedError, PayloadError) as exc:
        return HeadReport(None, None, None, None, verified, error or f"malformed head record: {exc}")
    return HeadReport(env.version, env.digest, env.anchor_version, env.time, verified, error)


def _sync_status(
    report: SwarmStatus,
    dht: Any,
    public_key: Ed25519PublicKey | None,
    timeout: float,
    probe_timeout: float | None,
) -> None:
    """Fill the PULSESync part of ``report`` from the first of ``report.sync_run_ids`` with any record."""
    from pulseloco.sync.transport import SwarmEndpoint

    for sync_run_id in report.sync_run_ids:
        endpoint = SwarmEndpoint(dht, sync_run_id, name="pulseloco-status")
        try:
            blob = endpoint.get_head_record(timeout=timeout)
            providers = endpoint.get_providers(timeout=timeout)
            if blob is None and not providers:
                continue
            report.sync_run_id = sync_run_id
            if blob is not None:
                report.head = _head_report(blob, sync_run_id, public_key)
            errors: dict[str, str | None] = {}
            own = endpoint.peer_id.to_base58()  # the caller's own DHT (a soak's publisher): a dial to self fails
            if probe_timeout is not None and providers:
                errors = endpoint.probe(sorted(set(providers) - {own}), timeout=probe_timeout)
                report.probe_timeout = probe_timeout
            for peer, info in sorted(providers.items(), key=lambda kv: (not kv[1]["publisher"], kv[0])):
                versions = info["versions"]
                reachable = None if probe_timeout is None or peer == own else errors.get(peer) is None
                report.providers.append(
                    ProviderReport(
                        peer,
                        info["publisher"],
                        len(versions),
                        min(versions) if versions else None,
                        max(versions) if versions else None,
                        reachable,
                        errors.get(peer),
                    )
                )
            return
        finally:
            endpoint.close()


_MAX_PEER_ID = 128
"""Longest worker subkey accepted (a base58 libp2p peer id is about 52 characters)."""


def _read_workers(dht: Any, run_id: str, timeout: float) -> tuple[dict[str, Any], int]:
    """The valid worker records under :func:`workers_key` ``(run_id)`` (``{peer id: WorkerInfo}``) and how many
    were malformed. A lookup that times out or fails is logged and counts as no record."""
    key = workers_key(run_id)
    try:
        found = dht.get(key, latest=True, return_future=True).result(timeout)
    except concurrent.futures.TimeoutError:
        logger.warning("DHT lookup timed out key=%s timeout=%.1f", key, timeout)
        return {}, 0
    except Exception as exc:  # a DHT shutting down or a daemon error: report what we have, never raise
        logger.warning("DHT lookup failed key=%s error=%r", key, exc)
        return {}, 0
    if found is None:
        return {}, 0
    if not isinstance(found.value, dict):  # a plain value stored under the key, not one per worker
        return {}, 1
    workers, malformed = {}, 0
    for subkey, item in found.value.items():
        info = parse_worker_record(getattr(item, "value", None))
        # strangers write these, and the text prints them: a peer id or engine name that could hold terminal
        # escapes, or a peer id no libp2p id is that long, is malformed
        if (
            isinstance(subkey, str)
            and 0 < len(subkey) <= _MAX_PEER_ID
            and subkey.isprintable()
            and info is not None
            and info.engine.isprintable()
        ):
            workers[subkey] = info
        else:
            malformed += 1
    return workers, malformed


def _workers_status(report: SwarmStatus, dht: Any, timeout: float) -> None:
    """Fill the rollout workers of ``report`` from the first PULSESync run id with any worker record: the run whose
    head or providers were found first, then the other run ids looked up."""
    candidates = [report.sync_run_id] if report.sync_run_id is not None else []
    candidates += [r for r in report.sync_run_ids if r != report.sync_run_id]
    head = report.head.version if report.head is not None else None
    for run_id in candidates:
        workers, malformed = _read_workers(dht, run_id, timeout)
        if not workers and not malformed:
            continue
        report.workers_key = workers_key(run_id)
        report.malformed_workers = malformed
        if malformed:
            logger.warning("skipped %d malformed rollout worker record(s) key=%s", malformed, report.workers_key)
        for peer, info in sorted(workers.items(), key=lambda kv: (-kv[1].version, kv[0])):
            lag = head - info.version if head is not None and info.version >= 0 else None
            report.workers.append(
                WorkerReport(
                    peer,
                    info.engine,
                    info.version,
                    lag,
                    info.tokens_per_s,
                    info.samples_per_s,
                    info.queue,
                    info.served,
                    info.max_new_tokens,
                )
            )
        return


def _refusals_status(report: SwarmStatus, dht: Any, timeout: float) -> None:
    """Fill the refused workers of ``report`` from the trainers' records of each PULSESync run id looked up."""
    for run_id in report.sync_run_ids:
        key = refused_key(run_id)
        try:
            found = dht.get(key, latest=True, return_future=True).result(timeout)
        except Exception as exc:  # a timeout, a DHT shutting down: report what we have, never raise
            logger.warning("DHT lookup failed key=%s error=%r", key, exc)
            continue
        if found is None or not isinstance(found.value, dict):
            continue
        for trainer, item in found.value.items():
            refusals = parse_refusals(getattr(item, "value", None))
            if not (isinstance(trainer, str) and 0 < len(trainer) <= _MAX_PEER_ID and trainer.isprintable()):
                continue
            for worker, reason in (refusals or {}).items():
                printable = "".join(c if c.isprintable() else "?" for c in reason)
                report.refused.append(RefusalReport(worker, trainer, printable))
        if report.refused:
            report.refused.sort(key=lambda r: (r.worker, r.trainer))
            return


def collect_status(
    dht: Any,
    run_id: str = DEFAULT_RUN_ID,
    *,
    sync_run_id: str | None = None,
    public_key: Ed25519PublicKey | None = None,
    timeout: float = 5.0,
    probe_timeout: float | None = 3.0,
) -> SwarmStatus:
    """Read a run's records through a running ``hivemind.DHT`` (a client-mode one is enough) and compare them.

    Args:
        dht: the DHT to read through; left running (the caller shuts it down).
        run_id: the PULSELoCo run id.
        sync_run_id: the PULSESync run to look up (head, providers, rollout workers); default ``<run_id>.policy``,
            then ``<run_id>``.
        public_key: the publisher's key, to verify the head; without it the head is shown unverified.
        timeout: seconds for each DHT lookup.
        probe_timeout: seconds each provider has to answer the reachability probe; None skips the probe.

    Never raises for what it reads: a lookup that times out or fails is logged (a warning) and counts as no
    record, malformed records are skipped, a head that fails verification is reported as such.
    """
    matchmaker = Matchmaker(
        dht,
        run_id=run_id,
        peer_id=str(dht.peer_id),
        client_mode=True,
        matchmaking_time=0.0,
        target_group_size=None,
        request_timeout=timeout,
    )
    records = matchmaker.read_state_records()
    reference, majority, peers = classify_peers(records.states)
    if records.malformed or records.malformed_rounds:
        logger.warning(
            "skipped %d malformed state record(s) and %d malformed round list(s) key=%s",
            records.malformed,
            records.malformed_rounds,
            loco_state_key(run_id),
        )
    report = SwarmStatus(
        run_id=run_id,
        state_key=loco_state_key(run_id),
        peers=peers,
        reference_round=reference,
        majority_digest=majority,
        malformed_states=records.malformed,
        malformed_rounds=records.malformed_rounds,
        sync_run_ids=[sync_run_id] if sync_run_id is not None else [policy_run_id(run_id), run_id],
    )
    _sync_status(report, dht, public_key, timeout, probe_timeout)
    _workers_status(report, dht, timeout)
    _refusals_status(report, dht, timeout)
    logger.info(
        "status run=%s peers=%d reference_round=%s disagree=%d sync_run=%s providers=%d workers=%d",
        run_id,
        len(peers),
        reference,
        len(report.disagreeing),
        report.sync_run_id,
        len(report.providers),
        len(report.workers),
    )
    return report


def to_json(report: SwarmStatus) -> str:
    """``report`` as indented JSON (see :meth:`SwarmStatus.to_dict`)."""
    return json.dumps(report.to_dict(), indent=2, sort_keys=True)


def _versions(p: ProviderReport) -> str:
    if p.min_version is None:
        return "no versions"
    if p.min_version == p.max_version:
        return f"v{p.min_version}"
    return f"v{p.min_version}-v{p.max_version} ({p.num_versions} versions)"


def _worker_lines(report: SwarmStatus) -> list[str]:
    """The rollout workers' part of :func:`render_text`: a count line, then one line per worker."""
    if report.workers_key is None:
        keys = ", ".join(repr(workers_key(r)) for r in report.sync_run_ids)
        return [f"rollout workers: none announced under DHT key(s) {keys}"]
    skipped = f", {report.malformed_workers} malformed record(s) skipped" if report.malformed_workers else ""
    lines = [f"rollout workers: {len(report.workers)} under DHT key {report.workers_key!r}{skipped}"]
    if not report.workers:
        return lines
    width = max(len("PEER"), *(len(w.peer_id) for w in report.workers))
    engine_width = max(len("ENGINE"), *(len(w.engine) for w in report.workers))
    lines.append(
        f"  {'PEER':<{width}}  {'ENGINE':<{engine_width}}  VERSION     LAG  TOKENS/S  SAMPLES/S  QUEUE  SERVED"
    )
    for w in report.workers:
        version = "none" if w.version < 0 else f"v{w.version}"
        lag = "-" if w.lag is None else str(w.lag)
        lines.append(
            f"  {w.peer_id:<{width}}  {w.engine:<{engine_width}}  {version:>7}  {lag:>6}  {w.tokens_per_s:>8.1f}  "
            f"{w.samples_per_s:>9.2f}  {w.queue:>5}  {w.served:>6}"
        )
    return lines


def _refusal_lines(report: SwarmStatus) -> list[str]:
    """The refused workers' part of :func:`render_text` (nothing when no trainer refused any)."""
    if not report.refused:
        return []
    workers = sorted({r.worker for r in report.refused})
    lines = [f"refused rollout workers: {len(workers)} (their completions failed a trainer's checks)"]
    for r in report.refused:
        lines.append(f"  {r.worker} by trainer {r.trainer}: {r.reason}")
    return lines


def _peer_lines(report: SwarmStatus) -> list[str]:
    """The PULSELoCo part of :func:`render_text`: the peers' table (or why there is none)."""
    lines: list[str] = []
    if not report.peers:
        lines.append(
            f"PULSELoCo run {report.run_id!r}: no state records under DHT key {report.state_key!r} "
            "(no trainer of this run has finished a round, or the run id is wrong; see --run-id)"
        )
    else:
        agreeing = sum(p.status == "agree" for p in report.peers)
        at_reference = sum(p.round == report.reference_round for p in report.peers)
        lines.append(
            f"PULSELoCo run {report.run_id!r}: {len(report.peers)} peer(s); reference round {report.reference_round} "
            f"({at_reference} peer(s) there, {agreeing} agree on majority digest {report.majority_digest})"
        )
        width = max(len(p.peer_id) for p in report.peers)
        lines.append(f"  {'PEER':<{width}}  MODE    ROUND  {'DIGEST':<16}  STATUS")
        for p in report.peers:
            status = p.status.upper() if p.status == "disagree" else p.status
            if p.status == "behind":
                status += f" ({p.rounds_behind} round{'s' if p.rounds_behind != 1 else ''})"
            elif p.status == "ahead":
                status += f" ({-p.rounds_behind} round{'s' if p.rounds_behind != -1 else ''})"
            if not p.complete:
                status += ", partial round"
            mode = "client" if p.client_mode else "server"
            lines.append(f"  {p.peer_id:<{width}}  {mode:<6}  {p.round:>5}  {p.digest:<16}  {status}")
    if report.malformed_states:
        lines.append(f"  {report.malformed_states} malformed state record(s) skipped")
    return lines


def _sync_lines(report: SwarmStatus, now: float | None) -> list[str]:
    """The PULSESync part of :func:`render_text`: the head, and the providers (probed or not)."""
    lines: list[str] = []
    looked_up = ", ".join(repr(r) for r in report.sync_run_ids)
    if report.sync_run_id is None:
        lines.append(f"PULSESync: no head or provider records for run id(s) {looked_up} (see --sync-run-id)")
    else:
        head = report.head
        if head is None:
            lines.append(f"PULSESync run {report.sync_run_id!r}: no head record (providers only)")
        else:
            if head.verified is True:
                trust = "signature verified"
            elif head.verified is False:
                trust = f"FAILS VERIFICATION: {head.error}"
            elif head.error:
                trust = head.error
            else:
                trust = "unverified: pass --public-key to check the signature"
            age = ""
            if head.time:
                age = f", published {max(0.0, (now if now is not None else time.time()) - head.time):.0f} s ago"
            anchor = "none" if head.anchor_version is None else f"v{head.anchor_version}"
            lines.append(
                f"PULSESync run {report.sync_run_id!r}: head v{head.version} digest {head.digest} anchor {anchor}"
                f"{age} ({trust})"
            )
        if not report.providers:
            lines.append("  no providers announced")
        else:
            if report.probe_timeout is None:
                lines.append(f"  providers: {len(report.providers)} (not probed)")
            else:
                reachable = sum(bool(prov.reachable) for prov in report.providers)
                lines.append(
                    f"  providers: {len(report.providers)}, {reachable} reachable (answered a probe within "
                    f"{report.probe_timeout:g} s)"
                )
            width = max(len(prov.peer_id) for prov in report.providers)
            for prov in report.providers:
                role = "publisher" if prov.publisher else "relay"
                if prov.reachable is None:
                    reach = "" if report.probe_timeout is None else "  (the reader's own peer: not probed)"
                elif prov.reachable:
                    reach = "  reachable"
                else:
                    reach = f"  UNREACHABLE: {prov.error}"
                lines.append(f"  {prov.peer_id:<{width}}  {role:<9}  {_versions(prov)}{reach}")
    return lines


def render_text(report: SwarmStatus, *, now: float | None = None) -> str:
    """A human-readable summary: the peer table, the PULSESync head and providers, the rollout workers, and a
    verdict line."""
    lines = _peer_lines(report) + _sync_lines(report, now)
    lines.extend(_worker_lines(report))
    lines.extend(_refusal_lines(report))
    if not report.peers:
        lines.append("verdict: nothing to compare (no PULSELoCo state records)")
    elif report.disagreeing:
        rounds = sorted({p.round for p in report.disagreeing})
        lines.append(
            f"verdict: DIGESTS DISAGREE: {len(report.disagreeing)} of {len(report.peers)} peer(s) differ from the "
            f"majority of their round (round(s) {', '.join(map(str, rounds))})"
        )
    else:
        lines.append(f"verdict: digests agree at round {report.reference_round}")
    return "\n".join(lines)
