"""``pulseloco status``: what the DHT records say about one run.

Reads, never writes: the PULSELoCo state records (``{run_id}_loco_state``, one per peer: last completed round,
parameter digest, client mode, whether that round was complete) and the PULSESync head and providers records
(``pulseloco:<sync run>:head`` / ``:providers``) of the run the recipes publish, ``<run_id>.policy`` (then
``<run_id>`` itself, for a ``pulseloco sync serve --run-id <run_id>``).

Agreement rule (the exit code):

- The *reference round* is the round the most peers report as their latest; a tie goes to the newer round.
  A single peer alone ahead (a fast peer, or a bogus record) therefore cannot hide the others' comparison, and
  old records of crashed peers cannot mask the live ones.
- A peer at the reference round ``agree``\\ s when its digest is the majority digest of that round
  (:func:`pulseloco.loco.matchmaking.majority_digest`, the rule the trainers repair by: complete rounds outvote
  partial ones, ties go to a digest a server-mode peer holds, then the smallest), else it ``disagree``\\ s.
- A peer at a newer round is ``ahead`` when it matches the majority of *its* round, else it ``disagree``\\ s.
- A peer at an older round is ``behind`` and not compared: it downloads the state when it catches up, and a
  crashed peer's last record stays in the DHT until it expires.
- A peer another peer names as *disputed* (it served a poisoned average) is ``disputed``: shown, left out of
  the votes as the trainers leave it out of their repairs, and not counted against the exit code (its state is
  not the swarm's).

Exit codes: :data:`EXIT_AGREE` (0) when no peer disagrees (no records at all included: the text says so and
names the key it looked up), :data:`EXIT_DISAGREE` (1) when one does, :data:`EXIT_CANNOT_JOIN` (2) for bad
arguments or a swarm that cannot be joined (the CLI's business; :func:`collect_status` needs a running DHT).

A provider is *reachable* when its fetch handler answers a probe (:meth:`SwarmEndpoint.probe
<pulseloco.sync.transport.SwarmEndpoint.probe>`: one libp2p dial and a one-message "missing" answer for an
object kind nobody holds) within the probe timeout.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulseloco.errors import PayloadError, UnauthorizedError
from pulseloco.loco.matchmaking import Matchmaker, PeerState, majority_digest

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
    "classify_peers",
    "collect_status",
    "render_text",
]

EXIT_AGREE = 0
EXIT_DISAGREE = 1
EXIT_CANNOT_JOIN = 2
DEFAULT_RUN_ID = "pulseloco"
"""The trainers' default run id (``SwarmArguments.run_id``, ``PulseLoCo(run_id=...)``)."""


@dataclass(frozen=True)
class PeerReport:
    """One PULSELoCo peer's state record and how it compares (``status``: agree, disagree, ahead, behind,
    disputed)."""

    peer_id: str
    client_mode: bool
    round: int
    digest: str
    complete: bool
    status: str
    rounds_behind: int
    """Reference round minus this peer's round (negative when ahead)."""


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


@dataclass
class SwarmStatus:
    """Everything ``pulseloco status`` found for a run; :attr:`exit_code` applies the module's agreement rule."""

    run_id: str
    state_key: str
    peers: list[PeerReport] = field(default_factory=list)
    reference_round: int | None = None
    majority_digest: str | None = None
    sync_run_id: str | None = None
    """The PULSESync run whose records were found (None when none was)."""
    sync_run_ids: list[str] = field(default_factory=list)
    """Every PULSESync run id looked up, in order."""
    head: HeadReport | None = None
    providers: list[ProviderReport] = field(default_factory=list)
    probe_timeout: float | None = None
    """Seconds each provider had to answer the probe; None when providers were not probed."""

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
    distrusted = {p for s in states for p in s.disputed}
    trusted = [s for s in states if s.peer_id not in distrusted] or states
    if not states:
        return None, None, []
    counts: dict[int, int] = {}
    for s in trusted:
        counts[s.round] = counts.get(s.round, 0) + 1
    reference = max(counts, key=lambda r: (counts[r], r))
    majorities = {r: majority_digest(trusted, r) for r in counts}
    reports = []
    for s in sorted(states, key=lambda s: (-s.round, s.peer_id)):
        if s.peer_id in distrusted:
            status = "disputed"
        elif s.round < reference:
            status = "behind"
        elif s.digest != majorities[s.round]:
            status = "disagree"
        else:
            status = "agree" if s.round == reference else "ahead"
        reports.append(PeerReport(s.peer_id, s.client_mode, s.round, s.digest, s.complete, status, reference - s.round))
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
        sync_run_id: the PULSESync run to look up; default ``<run_id>.policy``, then ``<run_id>``.
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
    reference, majority, peers = classify_peers(matchmaker.read_states())
    report = SwarmStatus(
        run_id=run_id,
        state_key=f"{run_id}_loco_state",
        peers=peers,
        reference_round=reference,
        majority_digest=majority,
        sync_run_ids=[sync_run_id] if sync_run_id is not None else [f"{run_id}.policy", run_id],
    )
    _sync_status(report, dht, public_key, timeout, probe_timeout)
    logger.info(
        "status run=%s peers=%d reference_round=%s disagree=%d sync_run=%s providers=%d",
        run_id,
        len(peers),
        reference,
        len(report.disagreeing),
        report.sync_run_id,
        len(report.providers),
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


def render_text(report: SwarmStatus, *, now: float | None = None) -> str:
    """A human-readable summary: the peer table, the PULSESync head and providers, and a verdict line."""
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
