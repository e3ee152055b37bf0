"""State transfer between PULSELoCo peers (docs/design.md section 5.1).

A server-mode peer serves its latest :class:`StateSnapshot` (global parameters, outer momentum and the ledger of
the rounds that built them) to peers that are behind or whose digest disagrees with the majority; those
download it with :meth:`StateTransfer.download_state`. The handler and the download run on the
:class:`~pulseloco.loco.averaging.SparseAverager`'s P2P host, which mixes :class:`StateTransfer` in, in the stream
protocol of :mod:`pulseloco.p2p` (header, then theta's and the momentum's FP32 bytes).

Failure behaviour: a download waits at most ``request_timeout`` per message and ``averaging_timeout`` plus
``request_timeout`` per peer, tries a bounded number of peers and raises :class:`StateDownloadError` when none
served a valid state; local state is never modified.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from dataclasses import dataclass, field

# hivemind's ServicerBase recognises streaming handlers by typing.AsyncIterator hints (their ``_name``).
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from pulseloco.errors import PayloadError, StateDownloadError, SwarmError
from pulseloco.loco.ledger import Ledger, LedgerEntry
from pulseloco.loco.peers import PeerState
from pulseloco.loco.validation import theta_digest
from pulseloco.p2p import P2PHost, asker_closes, read_stream, stream_messages

logger = logging.getLogger(__name__)

__all__ = ["StateSnapshot", "StateTransfer"]


@dataclass(frozen=True)
class StateSnapshot:
    """The global state a server-mode peer serves to peers that are behind or disagree."""

    round: int
    digest: str
    theta_N: torch.Tensor
    momentum_N: torch.Tensor | None
    ledger: dict[int, LedgerEntry] = field(default_factory=dict)
    """What the last rounds of this theta's lineage counted (:mod:`pulseloco.loco.ledger`)."""


class StateTransfer(ServicerBase):
    """Serving and downloading :class:`StateSnapshot` s: the base of ``SparseAverager``, which sets the attributes
    below and registers ``rpc_download_state`` with its all-reduce handlers (never used on its own: hivemind
    caches the handler list on the first class that collects it)."""

    numel: int
    namespace: str
    peer_id: str
    averaging_timeout: float
    request_timeout: float
    chunk_bytes: int
    _host: P2PHost
    _snapshot: StateSnapshot | None
    _snapshot_lock: threading.Lock

    def set_snapshot(self, snapshot: StateSnapshot | None) -> None:
        """Serve ``snapshot``, or nothing (``None``: requests are refused until the next snapshot).

        Tensors are not copied: the caller may pass its live tensors, provided it withdraws the snapshot
        (``set_snapshot(None)``) before it modifies them. This waits for a request that is reading the current
        snapshot's tensors, so that no request ever serves a half-modified state."""
        with self._snapshot_lock:
            self._snapshot = snapshot

    @asker_closes
    async def rpc_download_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream the latest snapshot: header, then theta's bytes, then the momentum's bytes (refusal: ``ok``
        False and a ``reason`` when there is no state yet)."""
        with self._snapshot_lock:  # the owner may not modify the tensors while they are copied out
            snapshot = self._snapshot
            if snapshot is not None:
                tensors = [snapshot.theta_N] + ([snapshot.momentum_N] if snapshot.momentum_N is not None else [])
                buffers = [tensor.detach().cpu().contiguous().numpy().tobytes() for tensor in tensors]
        if snapshot is None:
            for message in stream_messages(runtime_pb2.ExpertResponse, {"ok": False, "reason": "no state yet"}):
                yield message
            return
        has_momentum = snapshot.momentum_N is not None
        header = {
            "ok": True,
            "round": snapshot.round,
            "digest": snapshot.digest,
            "numel": self.numel,
            "momentum": has_momentum,
            "ledger": {str(r): e.to_json(self.numel) for r, e in sorted(snapshot.ledger.items())},
        }
        for message in stream_messages(runtime_pb2.ExpertResponse, header, buffers, chunk_bytes=self.chunk_bytes):
            yield message

    async def _download(self, peer: str) -> tuple[dict[str, Any], bytes]:
        """The state ``peer`` serves; raises :class:`SwarmError` when it refuses, the errors of
        :func:`pulseloco.p2p.read_stream` (at most twice the parameter size) otherwise."""
        stub = self.get_stub(self._host.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        stream = await asyncio.wait_for(
            stub.rpc_download_state(runtime_pb2.ExpertRequest(uid="state")), self.request_timeout
        )
        header, data = await read_stream(stream, max_bytes=8 * self.numel, timeout=self.request_timeout)
        if not header.get("ok"):
            raise SwarmError(f"peer refused: {header.get('reason')}")
        return header, data

    def download_state(self, states: list[PeerState], accept: dict[int, str], *, num_retries: int = 3) -> StateSnapshot:
        """Download the global state from a server-mode peer whose record is in ``accept`` (round -> digest).

        The received state must have ``numel`` finite FP32 entries and a digest equal to both its header's and
        the accepted digest of its round. Tries up to ``num_retries`` peers (newest rounds first, random among
        equals); raises :class:`StateDownloadError` if none served a valid state. Never modifies local state.
        """
        candidates = [
            s for s in states if s.peer_id != self.peer_id and not s.client_mode and accept.get(s.round) == s.digest
        ]
        random.shuffle(candidates)
        candidates.sort(key=lambda s: -s.round)
        errors = []
        for state in candidates[:num_retries]:
            try:
                header, data = self._host.run(
                    self._download(state.peer_id), timeout=self.averaging_timeout + self.request_timeout
                )
                round_index, digest = header.get("round"), header.get("digest")
                if not isinstance(round_index, int) or accept.get(round_index) != digest:
                    raise PayloadError(f"served round {round_index} digest {digest} is not an accepted state")
                has_momentum = bool(header.get("momentum"))
                expected = 4 * self.numel * (2 if has_momentum else 1)
                if len(data) != expected:
                    raise PayloadError(f"state is {len(data)} bytes, expected {expected}")
                flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
                theta_N = flat[: self.numel].clone()
                momentum_N = flat[self.numel :].clone() if has_momentum else None
                if not bool(torch.isfinite(flat).all()):
                    raise PayloadError("state carries non-finite values")
                if theta_digest(theta_N) != digest:
                    raise PayloadError("state does not match its digest")
                ledger = Ledger.parse(header.get("ledger", {}))
                logger.info("state downloaded peer=%s round=%d digest=%s", state.peer_id, round_index, digest)
                return StateSnapshot(
                    round=round_index, digest=digest, theta_N=theta_N, momentum_N=momentum_N, ledger=ledger
                )
            except Exception as exc:  # any failure of one peer (timeout, daemon, bad bytes) moves on to the next
                logger.warning("state download failed peer=%s error=%r", state.peer_id, exc)
                errors.append(f"{state.peer_id}: {exc!r}")
        raise StateDownloadError(
            f"no peer served a valid state after {len(errors)} attempt(s) ({'; '.join(errors) or 'no candidates'}); "
            "check that server-mode peers are reachable or raise request_timeout"
        )
