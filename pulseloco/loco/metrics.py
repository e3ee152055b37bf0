"""Per-round metrics of PULSELoCo: one JSON object per outer round, appended to a JSON-lines file.

Bytes are counted on the wire after compression: the serialized size of every protobuf message a peer sends
or receives for the round's averaging (payload frames plus their small headers), not counting libp2p framing.
Traffic a peer exchanges with itself (the contribution to its own shard) is not counted.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MetricsWriter", "RoundMetrics"]


@dataclass(frozen=True, kw_only=True)
class RoundMetrics:
    """What happened in one outer round on one peer."""

    round: int
    """Index of the outer round (0 for the first)."""
    num_peers: int
    """Size of the averaging group, this peer included (1 when it averaged alone or without a swarm, 0 when it
    sat the round out)."""
    num_sent: int
    """Entries this peer selected and sent."""
    numel: int
    """Number of parameters (entries of the flat parameter space)."""
    density: float
    """``num_sent / numel``."""
    num_returned: int
    """Sent entries that could not be delivered or were rejected, returned to the residual."""
    num_rejected: int
    """Contributions this peer rejected as a shard owner (invalid, non-finite or outlier payloads)."""
    bytes_sent: int
    """Wire bytes sent for averaging (contributions to other owners, summed shards served to others)."""
    bytes_received: int
    """Wire bytes received for averaging."""
    seconds_inner: float
    """Wall time of the round's inner steps."""
    seconds_sync: float
    """Wall time of the outer step: selection, matchmaking, averaging, digest check, model reset."""
    loss: float | None
    """Mean of the losses passed to ``step`` during the round, if any."""
    theta_digest: str
    """xxh3-128 digest of the global parameters after the round."""
    repaired: bool
    """True if this peer downloaded the global state from a peer during the round."""
    num_contributors: int = 0
    """Contributions the round actually aggregated: peers counted in at least one shard this peer fetched
    (``num_peers`` counts group members, whether or not their parts arrived)."""
    complete: bool = True
    """False if some shard's sum could not be fetched (that shard was not applied; the digest check repairs)."""
    num_reconciled: int = 0
    """Entries moved into or out of the residual to match a downloaded state's ledger (docs/design.md,
    "Exactly-once contributions"): each one a contribution that would otherwise be counted twice or lost."""

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps(asdict(self), separators=(",", ":"))


class MetricsWriter:
    """Appends :class:`RoundMetrics` as JSON lines to ``path`` (parent directories are created).

    A write that fails (full disk, permissions) is logged and does not interrupt training.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, metrics: RoundMetrics) -> None:
        """Append one line."""
        try:
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(metrics.to_json() + "\n")
        except OSError as exc:
            logger.warning("metrics write failed path=%s error=%s", self.path, exc)

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """All records of a metrics file, in order."""
        with Path(path).open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
