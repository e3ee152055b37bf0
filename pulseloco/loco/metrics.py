"""Per-round metrics of PULSELoCo: one JSON object per outer round, appended to a JSON-lines file.

Bytes are counted on the wire after compression: the serialized size of every protobuf message a peer sends
or receives for the round's averaging (payload frames plus their small headers), not counting libp2p framing.
Traffic a peer exchanges with itself (the contribution to its own shard) is not counted.

Comparing with the paper (docs/design.md): the paper's all-gather through an object store uploads each worker's
compressed pseudo-gradient once, ``payload_bytes`` here (the same codec and value precision as the wire). The
sparse reduce-scatter / all-gather sends instead the parts of that selection owned by other peers plus, for the
shard a peer owns, the sum of the group's entries there (the union of their indices) to every other member;
``bytes_sent`` is split into those parts. :func:`traffic_summary` totals a peer's records and gives bytes per
entry, with :func:`index_entropy_bits`, the bound an index code can reach, to compare the indices with.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["RoundMetrics", "index_entropy_bits", "traffic_summary"]


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
    """Wire bytes sent for averaging (contributions to other owners, summed shards served to others, fetch
    requests, push replies and refusals): exactly ``sent_index_bytes + sent_value_bytes + sent_sum_bytes +
    sent_header_bytes`` in records that have those fields."""
    bytes_received: int
    """Wire bytes received for averaging."""
    seconds_inner: float
    """Wall time of the round's inner steps."""
    seconds_sync: float
    """Wall time of the outer step: selection, matchmaking, averaging, digest check, model reset (with
    ``RoundConfig.overlap``, in the background while the next round's inner steps run)."""
    seconds_blocked: float = 0.0
    """Wall time the inner steps stopped at the round boundary where this round's metrics were delivered: the whole
    ``seconds_sync`` of a blocking round; with ``RoundConfig.overlap``, the wait for this round's exchange (run
    during the next round's inner steps) plus the next round's local reset."""
    seconds_matchmaking: float = 0.0
    """Part of ``seconds_sync``: forming the round's group (registration, the view check)."""
    seconds_exchange: float = 0.0
    """Part of ``seconds_sync``: the all-reduce (pushing parts, waiting for the other members' parts as an owner,
    fetching the shards' sums)."""
    seconds_digest: float = 0.0
    """Part of ``seconds_sync``: after the update, announcing the new state and waiting for the group's states
    (the digest check), with any repair."""
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
    num_averaged: int = 0
    """Entries of the round's average: the union of the group's selections in the shards this peer fetched (its own
    selection when it averaged alone). With ``num_sent`` of every member it gives how much the peers overlap."""
    num_reconciled: int = 0
    """Entries moved into or out of the residual to match a downloaded state's ledger (docs/design.md,
    "Exactly-once contributions"): each one a contribution that would otherwise be counted twice or lost."""
    num_clipped: int = 0
    """Entries this peer sent that were counted at a clip scale below 1 (its part of their shard was above the
    group's median norm, :mod:`pulseloco.loco.robust`): each gave back what the scale clipped off to the residual."""
    largest_norm_ratio: float = 0.0
    """As a shard owner: the largest ratio of an accepted part's norm to the clip bar (the group's median norm) in
    its shard this round; 0 when it owned no shard or had no bar. Honest peers of one run stay near 1; a part above
    ``dispute_norm_ratio`` strikes (:class:`pulseloco.loco.robust.RepeatOutliers`)."""
    payload_bytes: int = 0
    """Size of this peer's whole selection (``num_sent`` entries) encoded as ONE frame of the wire's codec and
    value precision: what it would upload to an object store in the paper's all-gather. Exact: the selection is
    encoded once more, on another thread while the exchange waits on the network (the one part itself when the
    group has one shard owner; a peer without a swarm encodes it in its outer step): 3-10 ms of one core per
    100k entries (0.06-0.16 s for 2M FP32 values, measured on 10M parameters). 0 when the peer sat the round out
    (it selected nothing to send)."""
    payload_index_bytes: int = 0
    """The index section of that frame (compare with :func:`index_entropy_bits`)."""
    payload_value_bytes: int = 0
    """The value section of that frame (4 bytes a value for FP32 before zstd, 2 for BF16)."""
    sent_index_bytes: int = 0
    """Part of ``bytes_sent``: the index sections of the contribution frames pushed to other shard owners."""
    sent_value_bytes: int = 0
    """Part of ``bytes_sent``: the value sections of those frames."""
    sent_sum_bytes: int = 0
    """Part of ``bytes_sent``: the index and value sections of the shard sums this owner served to the other
    members (the union of the group's indices in its shard, with their summed FP32 values), once per member
    served; ``sent_sum_index_bytes + sent_sum_value_bytes``."""
    sent_sum_index_bytes: int = 0
    """The index sections within ``sent_sum_bytes``."""
    sent_sum_value_bytes: int = 0
    """The value sections within ``sent_sum_bytes``."""
    sent_header_bytes: int = 0
    """Part of ``bytes_sent``: everything else (stream JSON headers, frame prefixes, JSON headers and checksums,
    protobuf tags and lengths, fetch requests, push replies, refusals)."""
    num_pushed: int = 0
    """Entries of the contribution frames pushed to other owners (``num_sent`` less the entries of this peer's
    own shard, or less those of streams cut short)."""
    num_sum_entries: int = 0
    """Entries of the shard sums this owner served, once per member served (the denominator of
    ``sent_sum_bytes`` per union entry)."""


def index_entropy_bits(numel: int, k: int) -> float:
    """``log2 C(numel, k)``: the bits any code needs, on average, for a set of ``k`` of ``numel`` positions when
    every such set is equally likely (a uniform random subset); per entry it approaches ``H(p) / p`` at density
    ``p = k / numel``. 0 for ``k`` of 0 or ``numel``. Raises :class:`ValueError` unless ``0 <= k <= numel``."""
    if not 0 <= k <= numel:
        raise ValueError(f"need 0 <= k <= numel, got k={k} numel={numel}")
    return (math.lgamma(numel + 1) - math.lgamma(k + 1) - math.lgamma(numel - k + 1)) / math.log(2)


_TOTALS = (
    "bytes_sent",
    "bytes_received",
    "num_sent",
    "payload_bytes",
    "payload_index_bytes",
    "payload_value_bytes",
    "sent_index_bytes",
    "sent_value_bytes",
    "sent_sum_bytes",
    "sent_sum_index_bytes",
    "sent_sum_value_bytes",
    "sent_header_bytes",
    "num_pushed",
    "num_sum_entries",
)


def _ratio(numerator: float | None, denominator: float | None, scale: float = 1.0) -> float | None:
    if numerator is None or not denominator:
        return None
    return scale * numerator / denominator


def traffic_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals and bytes per entry over one peer's :class:`RoundMetrics` records (dicts, as
    :func:`pulseloco.jsonl.read_json_lines` returns them).

    Totals: ``rounds`` and the sum of each of ``bytes_sent``, ``bytes_received``, ``num_sent``, the
    ``payload_*`` sizes, the ``sent_*`` parts, ``num_pushed`` and ``num_sum_entries``; a total is ``None`` when
    some record lacks its field (files written before it existed), never a partial sum. Per entry (``None``
    when a total is unknown or its denominator is 0):

    * ``wire_bytes_per_entry`` = ``bytes_sent / num_sent``, ``payload_bytes_per_entry`` = ``payload_bytes /
      num_sent`` and ``header_bytes_per_entry`` = ``sent_header_bytes / num_sent`` (per selected entry);
    * ``index_bits_per_entry`` = ``8 sent_index_bytes / num_pushed`` and ``value_bytes_per_entry`` =
      ``sent_value_bytes / num_pushed`` (the pushed parts' sections per entry they carry);
    * ``sum_bytes_per_entry`` = ``sent_sum_bytes / num_sum_entries`` (per union entry served), and its
      ``sum_index_bits_per_entry`` and ``sum_value_bytes_per_entry``;
    * ``payload_index_bits_per_entry`` = ``8 payload_index_bytes / num_sent`` against
      ``index_bound_bits_per_entry`` = the sum over rounds of :func:`index_entropy_bits` ``(numel, num_sent)``
      divided by ``num_sent``: the uniform-subset bound for the same selections. The parts' index sets, coded
      shard by shard, have a bound lower by at most ``(shards - 1) log2(num_sent + 1)`` bits a round
      (Vandermonde's identity), negligible per entry.

    Never raises for records with missing fields (an empty list gives 0 rounds and ``None`` ratios)."""
    out: dict[str, Any] = {"rounds": len(records)}
    for key in _TOTALS:
        out[key] = sum(int(r[key]) for r in records) if all(key in r for r in records) else None
    sent = out["num_sent"]
    bound = None
    if all("numel" in r and "num_sent" in r for r in records):
        bound = sum(index_entropy_bits(int(r["numel"]), int(r["num_sent"])) for r in records)
    out["wire_bytes_per_entry"] = _ratio(out["bytes_sent"], sent)
    out["payload_bytes_per_entry"] = _ratio(out["payload_bytes"], sent)
    out["header_bytes_per_entry"] = _ratio(out["sent_header_bytes"], sent)
    out["index_bits_per_entry"] = _ratio(out["sent_index_bytes"], out["num_pushed"], 8.0)
    out["value_bytes_per_entry"] = _ratio(out["sent_value_bytes"], out["num_pushed"])
    out["sum_bytes_per_entry"] = _ratio(out["sent_sum_bytes"], out["num_sum_entries"])
    out["sum_index_bits_per_entry"] = _ratio(out["sent_sum_index_bytes"], out["num_sum_entries"], 8.0)
    out["sum_value_bytes_per_entry"] = _ratio(out["sent_sum_value_bytes"], out["num_sum_entries"])
    out["payload_index_bits_per_entry"] = _ratio(out["payload_index_bytes"], sent, 8.0)
    out["index_bound_bits_per_entry"] = _ratio(bound, sent)
    return out
