#!/usr/bin/env python
"""The exchange at scale: bytes and messages per peer and round, and the latency they imply, from 4 to 256 peers.

    .venv/bin/python experiments/scale/simulate.py                                   # demo shapes, 4..256 peers
    .venv/bin/python experiments/scale/simulate.py --size wide --peers 4,8,16 --out /tmp/scale-wide
    .venv/bin/python experiments/scale/simulate.py --exchanges diloco,sparseloco-topk --rho 0.9 --rounds 2

A simulation, not a run: no training, no network. Every peer's pseudo-gradient is synthetic (below); the library's
own selectors (:meth:`pulseloco.loco.config.RoundConfig.make_selector`, run by
:func:`pulseloco.loco.selection.select_in_place`), its shard split (:func:`pulseloco.loco.averaging.shard_bounds`),
its codec (:func:`pulseloco.loco.validation.encode_sparse`, every part and every aggregate encoded as the wire
carries it), its owner-side aggregation (``combine_parts``) and its ``topk`` reduction
(:func:`pulseloco.loco.reduce.reduce_parts`) produce every frame; the stream protocol of :mod:`pulseloco.p2p`
(``stream_messages``: one JSON header message, then chunks of at most 1 MiB, in hivemind ``ExpertRequest`` /
``ExpertResponse`` protobufs) is counted message by message at its serialized size, with the real headers (the
accepted members as ``compact_header`` writes them, the owner's clip bar, the gathered parts' sizes).
Exchanges (``--exchanges``):

* ``diloco``: selector ``dense``, FP32, exchange ``sums`` (DiLoCo's all-reduce of every entry);
* ``sparseloco-gather`` / ``-sums`` / ``-topk``: selector ``sparseloco`` (64 of 4096 per tile, 2-bit values), the
  owner relaying every accepted part to every member but its sender, serving the FP32 sums of the union, or serving
  per tile the top 128 of the aggregate (the library's default ``exchange_budget`` of 2 parts) in 2-bit values
  (``reduce_parts``); ``sparseloco-topk-x1``: the top 64, one part's budget (Ok-Topk's rule);
* ``pulse2-gather`` / ``-topk`` (and ``pulse2-sums``, not in the default): selector ``pulse`` with
  ``pulse_values="quantized"`` (the BF16 gate, 2-bit values); topk's budget per tile is twice the parts' mean count
  there.

**Pseudo-gradients.** Peer ``i``'s pseudo-gradient in round ``r`` is ``lr * H * a * tanh(2 z)``, with ``a`` a fixed
heavy-tailed scale per parameter entry (``min(1, exp(N(-1, 1)))``: Adam steps are at most about ``lr`` each, most
much less), ``z = sqrt(rho) g_r + sqrt(1 - rho) e_ri`` (a component shared by all peers, a noise of their own, both
standard normal: correlation ``rho`` between peers), ``lr`` 3e-6 and ``H`` 8 inner steps. ``theta`` is the model's
seeded initialization with its matrices scaled to the warm model's median ``abs(w)`` (demo 0.0228, wide 0.0168,
docs/results.md), so that the pulse gate fires about as it did there (13-15% per round here, 11-19% measured). Each
peer keeps its error feedback (``residual = decay * residual + pseudo-gradient``, then the selection), over
``--rounds`` rounds; bytes are measured in the last. ``theta`` is not stepped (no outer step): a peer's selection
then depends on its own signals only, so the ``gather`` and ``sums`` exchanges (which send what was selected and
return nothing) share one set of selections for every group size, computed once for the largest. With ``topk`` an
owner's choice feeds back (a member's entries it did not keep go back to that member's residual, the owner's
rounding error into the owner's: :mod:`pulseloco.loco.reduce`), so its rounds run per group size. DiLoCo has no
residual: one round.

**Per peer, per round** (means over the peers, every peer owning one shard): bytes sent and received (every
protobuf message), both also in *payloads* (divided by the peer's own whole selection encoded as one frame,
:func:`pulseloco.loco.averaging.payload_frame`), DiLoCo's bytes sent over these (how many times fewer), messages
sent and received, streams opened; per exchange the union of the parts per shard, the entries topk kept, and the
density of the consensus update (entries applied per round / N: what a PULSESync patch must carry).

**Latency** of one round: sequential round trips times ``--rtt-ms``, plus a bandwidth term at ``--bandwidth-mbit``
(per phase, push then fetch, the busiest peer's larger direction). Round trips: the catch-up's DHT get of the state
records; the registration (store) and its read (get); the view check (store, get); the push (one request and its
reply); the fetch (one request, the owner answering once every part arrived); the state record (store) and
``wait_for_states`` (get). A DHT get costs ``h(P)`` round trips (an iterative Kademlia lookup), a store ``h(P) + 1``
(the lookup, then the store): ``7 h(P) + 5`` in all, with ``h(P) = 1 + ceil(log2(P / k))`` for ``P > k`` (``k`` the
bucket size, hivemind's 20; each hop at least halves the distance to the key once the first hop reached the ``k``
nearest peers a node knows), else 1. Fixed waits (``matchmaking_time``, the polls) and the first connection to a
peer are not counted.

Outputs in ``--out`` (default a new folder ``experiments/scale/results/SIZE-rhoRHO-STAMP``): ``sim.json`` (the
settings, every row, the seconds each part took) and ``sim.md`` (tables). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "scripts"))  # the shared scripts/harness

import torch
from harness.machine import git_revision
from harness.report import default_out, md_table

from pulseloco.loco.averaging import payload_frame, shard_bounds
from pulseloco.loco.config import RoundConfig
from pulseloco.loco.matchmaking import Group
from pulseloco.loco.quantize import ParamLayout
from pulseloco.loco.reduce import DEFAULT_EXCHANGE_BUDGET, ReduceSpec, combine_parts, reduce_parts
from pulseloco.loco.robust import clip_bar, part_norm
from pulseloco.loco.selection import Selector, select_in_place
from pulseloco.loco.shard_owner import AGGREGATE_NAME, CONTRIBUTION_NAME, compact_header
from pulseloco.loco.validation import encode_sparse
from pulseloco.p2p import CHUNK_BYTES

PROG = "simulate.py"

# ---- the strategies and exchanges ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """A selection rule and how its shards are averaged: the :class:`RoundConfig` that builds its selector, the
    wire precision of its parts, its mean, its error decay and the budget of its ``topk`` exchange."""

    name: str
    config: RoundConfig
    value_dtype: str
    topk_k: int | None
    budget: float = DEFAULT_EXCHANGE_BUDGET

    @property
    def mean_over(self) -> str:
        """``peers`` or ``senders`` (:data:`pulseloco.loco.config.STRATEGY_DEFAULTS`)."""
        return str(self.config.resolved("mean_over"))

    @property
    def decay(self) -> float:
        """The error feedback's decay (SparseLoCo 0.95, the others 1)."""
        return float(self.config.resolved("error_decay"))


def strategies() -> dict[str, Strategy]:
    """The strategies the exchanges use, by name: the library's defaults (``topk`` owners keep
    :data:`~pulseloco.loco.reduce.DEFAULT_EXCHANGE_BUDGET` parts' budget of the aggregate per tile), and
    ``sparseloco-x1``, SparseLoCo's selection with owners keeping one part's (``--exchange_budget 1``)."""
    return {
        "dense": Strategy("dense", RoundConfig(selector="dense"), "float32", None),
        "sparseloco": Strategy("sparseloco", RoundConfig(selector="sparseloco"), "quantized", 64),
        "sparseloco-x1": Strategy("sparseloco-x1", RoundConfig(selector="sparseloco"), "quantized", 64, 1.0),
        "pulse2": Strategy("pulse2", RoundConfig(selector="pulse", pulse_values="quantized"), "quantized", None),
    }


EXCHANGES: dict[str, tuple[str, str]] = {
    "diloco": ("dense", "sums"),
    "sparseloco-gather": ("sparseloco", "gather"),
    "sparseloco-sums": ("sparseloco", "sums"),
    "sparseloco-topk": ("sparseloco", "topk"),
    "sparseloco-topk-x1": ("sparseloco-x1", "topk"),
    "pulse2-gather": ("pulse2", "gather"),
    "pulse2-sums": ("pulse2", "sums"),
    "pulse2-topk": ("pulse2", "topk"),
}
"""Exchange name -> (strategy, the owner's exchange)."""
DEFAULT_EXCHANGES = (
    "diloco",
    "sparseloco-gather",
    "sparseloco-sums",
    "sparseloco-topk",
    "sparseloco-topk-x1",
    "pulse2-gather",
    "pulse2-topk",
)
DEFAULT_PEERS = (4, 8, 16, 32, 64, 128, 256)

# ---- the parameter space ------------------------------------------------------------------------------------------

WARM_MEDIAN_ABS = {"demo": 0.0228, "wide": 0.0168}
"""Median ``abs(w)`` of the warm models' matrices (docs/results.md, the sparsity study's table)."""
VOCAB_SIZE = 258
"""The byte-level tokenizer's vocabulary (recipes/pretrain.py: 256 bytes and two special tokens)."""


@dataclass
class Space:
    """The flat parameter space: its :class:`ParamLayout`, ``theta_N`` and the per-entry scale ``scale_N`` of the
    synthetic pseudo-gradients."""

    layout: ParamLayout
    theta_N: torch.Tensor
    scale_N: torch.Tensor
    name: str = "custom"

    @property
    def numel(self) -> int:
        """N, the entries of the flat space."""
        return int(self.layout.numel)


def model_shapes(size: str) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """The trainable parameters' shapes of the warm model ``size`` (``demo`` or ``wide``: its Llama config from
    :data:`harness.warm.SIZES`, instantiated with seed 0, tied embeddings counted once) and their flat initial
    values."""
    from harness.warm import SIZES
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = SIZES[size]
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = [p for p in model.parameters() if p.requires_grad]
    shapes = [tuple(p.shape) for p in params]
    theta_N = torch.cat([p.detach().reshape(-1).float() for p in params])
    return shapes, theta_N


def build_space(
    shapes: Sequence[Sequence[int]],
    *,
    theta_N: torch.Tensor | None = None,
    theta_median: float = 0.0228,
    seed: int = 0,
    name: str = "custom",
) -> Space:
    """A :class:`Space` over ``shapes``: ``theta_N`` (default: N(0, 0.02), vectors at 1 like RMSNorm weights) with
    its matrices scaled to a median ``abs`` of ``theta_median``, and the heavy-tailed scale ``min(1, exp(N(-1,
    1)))`` per entry (module docstring)."""
    layout = ParamLayout([tuple(s) for s in shapes])
    generator = torch.Generator().manual_seed(seed * 7919 + 17)
    is_matrix = torch.cat([torch.full((math.prod(s),), len(s) >= 2) for s in shapes])
    if theta_N is None:
        theta_N = torch.randn(layout.numel, generator=generator) * 0.02
        theta_N[~is_matrix] = 1.0
    theta_N = theta_N.clone().float()
    median = float(theta_N[is_matrix].abs().median()) if bool(is_matrix.any()) else 0.0
    if median > 0.0:
        theta_N[is_matrix] *= theta_median / median
    scale_N = torch.exp(torch.randn(layout.numel, generator=generator) - 1.0).clamp_(max=1.0)
    return Space(layout=layout, theta_N=theta_N, scale_N=scale_N, name=name)


class Signals:
    """The synthetic pseudo-gradients (module docstring), the same for every exchange and group size: peer ``i``'s
    in round ``r`` depends on ``(seed, r, i)`` only."""

    def __init__(self, space: Space, *, rho: float, lr: float, inner_steps: int, seed: int) -> None:
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"rho must be in [0, 1], got {rho}")
        self.space = space
        self.rho = rho
        self.step = lr * inner_steps
        self.seed = seed
        self._shared: dict[int, torch.Tensor] = {}

    def _normal(self, *key: int) -> torch.Tensor:
        digest = hashlib.sha256(repr((self.seed, *key)).encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randn(self.space.numel, generator=generator)

    def pseudo_gradient(self, round_index: int, peer: int) -> torch.Tensor:
        """Peer ``peer``'s pseudo-gradient of round ``round_index`` (FP32, N entries)."""
        if round_index not in self._shared:
            self._shared = {round_index: self._normal(round_index, -1)}  # one round's shared component at a time
        z = self._normal(round_index, peer).mul_(math.sqrt(1.0 - self.rho))
        z.add_(self._shared[round_index], alpha=math.sqrt(self.rho))
        return torch.tanh(z.mul_(2.0)).mul_(self.space.scale_N).mul_(self.step)


# ---- selections -------------------------------------------------------------------------------------------------


@dataclass
class Selections:
    """The last round's selection of each peer: sorted global ``indices`` (None: every entry, DiLoCo) and FP32
    ``values``, with the size of each peer's whole selection as one frame (``payload_bytes``)."""

    indices: list[torch.Tensor | None]
    values: list[torch.Tensor]
    payload_bytes: list[int]
    round_index: int

    def count(self, peer: int) -> int:
        """Entries peer ``peer`` sent."""
        return int(self.values[peer].numel())


def _sparse(selections: Selections, peer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer ``peer``'s selected indices and values; raises :class:`ValueError` for a dense selection."""
    indices = selections.indices[peer]
    if indices is None:
        raise ValueError("a dense selection has no index list")
    return indices, selections.values[peer]


def _payload(space: Space, strategy: Strategy, indices: torch.Tensor | None, values: torch.Tensor, r: int) -> int:
    if indices is None:
        indices = torch.arange(space.numel, dtype=torch.int64)
    starts = space.layout.group_starts() if strategy.value_dtype == "quantized" else None
    frame = payload_frame(
        space.numel, indices, values, round_index=r, value_dtype=strategy.value_dtype, group_starts=starts
    )
    return int(frame.total_bytes)


def _select(selector: Selector, space: Space, residual_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Select from ``residual_N`` (the signal, overwritten with the new residual)."""
    indices_K, values_K, _ = select_in_place(selector, space.theta_N, residual_N, chunk_numel=space.numel)
    return indices_K, values_K


@dataclass
class Plain:
    """What the independent peers select (:func:`plain_selections`): per strategy the last round's
    :class:`Selections` (those with ``gather`` or ``sums`` exchanges, and DiLoCo's one round) and the first round's
    (those with a ``topk`` exchange, whose first round is the same: nothing came back yet)."""

    last: dict[str, Selections]
    first: dict[str, Selections]


def plain_selections(
    space: Space,
    signals: Signals,
    last: Sequence[Strategy],
    first: Sequence[Strategy],
    num_peers: int,
    rounds: int,
    log: Any = None,
) -> Plain:
    """Every peer's selections with its own error feedback over ``rounds`` rounds, peer after peer (peers are
    independent: ``theta`` is not stepped and nothing comes back): the last round's for the strategies ``last``, the
    first round's for ``first``; each pseudo-gradient is made once for all of them. DiLoCo: one round, every
    entry, of which only the payloads are kept (:func:`dense_selections` makes the values again)."""
    wanted = {s.name: s for s in [*last, *first]}
    selectors = {name: s.config.make_selector(space.layout) for name, s in wanted.items() if name != "dense"}
    needs = {name: rounds if name in {s.name for s in last} else 1 for name in wanted}
    r_last = {name: (0 if name == "dense" else rounds - 1) for name in wanted}
    out_last = {s.name: Selections([], [], [], r_last[s.name]) for s in last}
    out_first = {s.name: Selections([], [], [], 0) for s in first}
    for i in range(num_peers):
        residuals = {name: torch.zeros(space.numel) for name in selectors}
        for r in range(max(needs.values())):
            pseudo_gradient_N = signals.pseudo_gradient(r, i)
            if r == 0 and "dense" in out_last:  # its values are made again where needed (N entries a peer)
                out_last["dense"].payload_bytes.append(_payload(space, wanted["dense"], None, pseudo_gradient_N, 0))
            for name, selector in selectors.items():
                if r >= needs[name]:
                    continue
                residual_N = residuals[name]
                residual_N.mul_(wanted[name].decay).add_(pseudo_gradient_N)
                idx, val = _select(selector, space, residual_N)
                if r == 0 and name in out_first:
                    out_first[name].indices.append(idx)
                    out_first[name].values.append(val)
                if r == rounds - 1 and name in out_last:
                    out_last[name].indices.append(idx)
                    out_last[name].values.append(val)
        if log is not None and (i + 1) % 64 == 0:
            log(f"{', '.join(wanted)}: {i + 1}/{num_peers} peers selected")
    for name, selections in out_last.items():
        if name == "dense":
            continue
        selections.payload_bytes = [
            _payload(space, wanted[name], idx, val, selections.round_index)
            for idx, val in zip(selections.indices, selections.values, strict=True)
        ]
    return Plain(out_last, out_first)


def dense_selections(signals: Signals, num_peers: int, payload_bytes: list[int]) -> Selections:
    """DiLoCo's selections of the first ``num_peers`` peers: every entry of their first pseudo-gradient."""
    values = [signals.pseudo_gradient(0, i) for i in range(num_peers)]
    return Selections([None] * num_peers, values, payload_bytes[:num_peers], 0)


# ---- parts, aggregates and the stream protocol's bytes ------------------------------------------------------------


def varint_bytes(n: int) -> int:
    """Bytes of ``n`` as a protobuf varint."""
    size = 1
    while n >= 128:
        n >>= 7
        size += 1
    return size


def metadata_message_bytes(n: int) -> int:
    """``ByteSize()`` of an ``ExpertRequest`` / ``ExpertResponse`` whose only field is ``metadata`` of ``n`` bytes
    (field 3: one tag byte, the length, the bytes; proto3 leaves an empty field out)."""
    return 0 if n == 0 else 1 + varint_bytes(n) + n


def chunk_messages(size: int, chunk: int = CHUNK_BYTES) -> tuple[int, int]:
    """(messages, bytes) of one frame of ``size`` bytes streamed in chunks of at most ``chunk``
    (:func:`pulseloco.p2p.stream_messages`; an empty frame sends nothing)."""
    full, rest = divmod(size, chunk)
    return full + (rest > 0), full * metadata_message_bytes(chunk) + metadata_message_bytes(rest)


def header_bytes(header: dict[str, Any]) -> int:
    """``ByteSize()`` of :func:`pulseloco.p2p.header_message` of ``header``."""
    return metadata_message_bytes(len(json.dumps(header, separators=(",", ":")).encode()))


def peer_ids(count: int) -> list[str]:
    """``count`` distinct Ed25519-style libp2p peer ids (52 characters, ``12D3KooW...``), sorted: the group's
    order."""
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    ids = []
    for i in range(count):
        number = int.from_bytes(hashlib.sha256(f"peer{i}".encode()).digest(), "big")
        text = ""
        for _ in range(44):
            number, digit = divmod(number, 58)
            text += alphabet[digit]
        ids.append("12D3KooW" + text)
    return sorted(ids)


@dataclass
class Parts:
    """Every peer's parts of every shard in one group of ``P`` peers: ``sizes[i][j]`` the bytes of peer ``i``'s
    part of shard ``j`` (frames in ``frames`` when kept), the local indices and values (``local``), and their L2
    norms (the owner's clip bar comes from them)."""

    bounds: list[tuple[int, int]]
    sizes: torch.Tensor
    local: list[list[tuple[torch.Tensor, torch.Tensor]]]
    norms: torch.Tensor
    frames: list[list[bytes]] | None = None


def encode_parts(
    space: Space, strategy: Strategy, selections: Selections, num_peers: int, *, keep_frames: bool = False
) -> Parts:
    """Cut the first ``num_peers`` peers' selections at the shard bounds and encode every part as
    :meth:`pulseloco.loco.averaging.SparseAverager.all_reduce` does."""
    bounds = shard_bounds(space.numel, num_peers)
    stops = torch.tensor([stop for _, stop in bounds], dtype=torch.int64)
    starts = space.layout.group_starts()
    sizes = torch.zeros(num_peers, num_peers, dtype=torch.int64)
    norms = torch.zeros(num_peers, num_peers, dtype=torch.float64)
    local: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_peers)]
    frames: list[list[bytes]] | None = [[] for _ in range(num_peers)] if keep_frames else None
    all_local = [torch.arange(stop - start, dtype=torch.int64) for start, stop in bounds]
    for i in range(num_peers):
        indices = selections.indices[i]
        values = selections.values[i]
        if indices is None:
            offsets = [0, *stops.tolist()]
        else:
            offsets = [0, *torch.searchsorted(indices, stops).tolist()]
        for j, (start, stop) in enumerate(bounds):
            vals = values[offsets[j] : offsets[j + 1]]
            idx = all_local[j] if indices is None else indices[offsets[j] : offsets[j + 1]] - start
            frame = encode_sparse(
                CONTRIBUTION_NAME,
                stop - start,
                idx,
                vals,
                round_index=selections.round_index,
                value_dtype=strategy.value_dtype,
                group_starts=starts - start if strategy.value_dtype == "quantized" else None,
            )
            sizes[i, j] = len(frame)
            norms[i, j] = part_norm(vals)
            local[i].append((idx, vals))
            if frames is not None:
                frames[i].append(frame)
    return Parts(bounds, sizes, local, norms, frames)


@dataclass
class Aggregates:
    """What each owner serves with the ``sums`` or ``topk`` exchange: per shard the frame's bytes (``frames`` when
    kept), the union of the parts and the entries sent."""

    sizes: list[int]
    union: list[int]
    kept: list[int]
    frames: list[bytes] | None = None
    kept_indices: list[torch.Tensor] = field(default_factory=list)
    absorbed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def sum_aggregates(parts: Parts, strategy: Strategy, round_index: int, *, keep_frames: bool = False) -> Aggregates:
    """The ``sums`` exchange: each owner's FP32 sums of its shard's union (``combine_parts``, sorted peer order, clip
    scale 1) as :meth:`pulseloco.loco.shard_owner.ShardOwner._sum_contributions` encodes them."""
    sizes, union, frames = [], [], []
    for j, (start, stop) in enumerate(parts.bounds):
        shard = [(peer[j], 1.0) for peer in parts.local]
        indices_K, sum_K = combine_parts(shard, stop - start, strategy.mean_over)
        frame = encode_sparse(AGGREGATE_NAME, stop - start, indices_K, sum_K, round_index=round_index)
        sizes.append(len(frame))
        union.append(int(indices_K.numel()))
        if keep_frames:
            frames.append(frame)
    return Aggregates(sizes, union, list(union), frames if keep_frames else None)


def reduce_shard(
    shard: list[tuple[tuple[torch.Tensor, torch.Tensor], float]],
    *,
    start: int,
    numel: int,
    layout: ParamLayout,
    strategy: Strategy,
) -> Any:
    """:func:`pulseloco.loco.reduce.reduce_parts` of one shard (64 x 64 tiles, the strategy's budget, 2 bits)."""
    spec = ReduceSpec(
        layout=layout, chunk=64, k=strategy.topk_k, value_dtype=strategy.value_dtype, bits=2, factor=strategy.budget
    )
    return reduce_parts(shard, start=start, numel=numel, spec=spec, mean_over=strategy.mean_over)


def topk_aggregates(
    parts: Parts, space: Space, strategy: Strategy, round_index: int, *, keep_frames: bool = False
) -> Aggregates:
    """The ``topk`` exchange: each owner's reduced shard (:func:`reduce_shard`) encoded in the parts' precision."""
    result = Aggregates([], [], [], [] if keep_frames else None)
    for j, (start, stop) in enumerate(parts.bounds):
        shard = [(peer[j], 1.0) for peer in parts.local]
        reduced = reduce_shard(shard, start=start, numel=stop - start, layout=space.layout, strategy=strategy)
        frame = encode_sparse(
            AGGREGATE_NAME,
            stop - start,
            reduced.indices_K,
            reduced.values_K,
            round_index=round_index,
            value_dtype=strategy.value_dtype,
            group_starts=reduced.group_starts,
        )
        result.sizes.append(len(frame))
        result.union.append(int(reduced.num_union))
        result.kept.append(int(reduced.indices_K.numel()))
        result.kept_indices.append(reduced.indices_K)
        result.absorbed.append((reduced.indices_K, reduced.absorbed_K))
        if result.frames is not None:
            result.frames.append(frame)
    return result


@dataclass
class Wire:
    """Per peer of one group, one round: bytes and messages sent and received, split into the push phase (parts and
    their replies) and the fetch phase (requests and what the owners serve), and the frame bytes among them."""

    sent_push: list[int]
    received_push: list[int]
    sent_fetch: list[int]
    received_fetch: list[int]
    sent_frames: list[int]
    messages_sent: list[int]
    messages_received: list[int]

    @property
    def sent(self) -> list[int]:
        """Every byte each peer sent."""
        return [a + b for a, b in zip(self.sent_push, self.sent_fetch, strict=True)]

    @property
    def received(self) -> list[int]:
        """Every byte each peer received."""
        return [a + b for a, b in zip(self.received_push, self.received_fetch, strict=True)]


def owner_bars(parts: Parts, ids: list[str]) -> list[float]:
    """Per shard, the clip bar its owner serves (:func:`pulseloco.loco.robust.clip_bar`, the median of the parts'
    norms; 0: none): the one number of the clip the fetch headers carry."""
    bars = []
    for j in range(len(parts.bounds)):
        norms = {ids[i]: float(parts.norms[i, j]) for i in range(len(ids))}
        bars.append(clip_bar(norms, ids[j])[0])
    return bars


def wire_bytes(
    parts: Parts, exchange: str, strategy: Strategy, aggregates: Aggregates | None, round_index: int
) -> Wire:
    """Count one round's messages (module docstring) for the owner's ``exchange`` (``gather``, ``sums`` or
    ``topk``; ``aggregates`` the frames the latter two serve)."""
    num = len(parts.bounds)
    ids = peer_ids(num)
    group_id = Group(round=round_index, members=tuple(ids), servers=tuple(ids), digest="0" * 32).group_id
    bars = owner_bars(parts, ids)
    sizes = parts.sizes.tolist()
    reply = header_bytes({"ok": True, "reason": None})
    zero = [0] * num
    wire = Wire(list(zero), list(zero), list(zero), list(zero), list(zero), list(zero), list(zero))
    base = {"round": round_index, "group": group_id}
    for j in range(num):  # j the owner
        request = header_bytes({**base, "shard": j})
        header: dict[str, Any] = {
            "ok": True,
            "accepted": ids,
            "rejected": [],
            "exchange": exchange,
            "mean_over": strategy.mean_over,
            **({"clip_bar": bars[j]} if bars[j] > 0.0 else {}),
        }
        column = [sizes[i][j] for i in range(num)]
        if exchange == "gather":
            total = sum(column)
            header = compact_header({**header, "size": total}, ids)
            header["parts"] = column
            text = len(json.dumps(header, separators=(",", ":")).encode())
            chunks = [chunk_messages(size) for size in column]
            chunk_count, chunk_bytes = sum(c[0] for c in chunks), sum(c[1] for c in chunks)
        else:
            if aggregates is None:
                raise ValueError(f"the {exchange} exchange needs the owners' aggregates")
            if exchange == "topk":
                header["union"] = aggregates.union[j]
            header["size"] = aggregates.sizes[j]
            served_header = header_bytes(compact_header(header, ids))
            served_messages, served_bytes = chunk_messages(aggregates.sizes[j])
        for i in range(num):  # i a member that pushes to and fetches from owner j
            if i == j:
                continue
            push_messages, push_bytes = chunk_messages(sizes[i][j])
            push = header_bytes({**base, "shard": j, "size": sizes[i][j]}) + push_bytes
            wire.sent_push[i] += push
            wire.received_push[j] += push
            wire.sent_push[j] += reply
            wire.received_push[i] += reply
            wire.sent_fetch[i] += request
            wire.received_fetch[j] += request
            wire.sent_frames[i] += sizes[i][j]
            wire.messages_sent[i] += 2 + push_messages  # the push stream and the fetch request
            wire.messages_received[j] += 2 + push_messages
            wire.messages_sent[j] += 1  # the push reply
            wire.messages_received[i] += 1
            if exchange == "gather":  # every accepted part but member i's own, listed as 0
                own = sizes[i][j]
                length = text - len(str(own)) + 1 - len(str(total)) + len(str(total - own))
                messages = 1 + chunk_count - chunks[i][0]
                served = metadata_message_bytes(length) + chunk_bytes - chunks[i][1]
                frames = total - own
            else:
                messages = 1 + served_messages
                served = served_header + served_bytes
                frames = aggregates.sizes[j] if aggregates is not None else 0
            wire.sent_fetch[j] += served
            wire.received_fetch[i] += served
            wire.sent_frames[j] += frames
            wire.messages_sent[j] += messages
            wire.messages_received[i] += messages
    return wire


# ---- rounds with the topk exchange --------------------------------------------------------------------------------


@dataclass
class TopkRound:
    """The last round of one strategy with the ``topk`` exchange in a group: selections, parts and aggregates."""

    selections: Selections
    parts: Parts
    aggregates: Aggregates


def topk_rounds(
    space: Space,
    signals: Signals,
    strategies_: Sequence[Strategy],
    num_peers: int,
    rounds: int,
    *,
    first: dict[str, Selections] | None = None,
    keep_frames: bool = False,
) -> dict[str, TopkRound]:
    """``rounds`` rounds of ``num_peers`` peers with the ``topk`` exchange, per strategy of ``strategies_`` (each
    pseudo-gradient made once for all): each peer selects from its residual, each owner reduces its shard
    (:func:`reduce_shard`); a member's entries its owner did not keep go back to its residual (the value it sent),
    the owner's rounding error into the owner's (:mod:`pulseloco.loco.reduce`). ``first``: the first round's
    selections of the first ``num_peers`` peers where known (:func:`plain_selections`; the residual is then rebuilt
    from them as the selector leaves it). Returns the last round's selections, parts and aggregates."""
    selectors = {s.name: s.config.make_selector(space.layout) for s in strategies_}
    residuals = {s.name: torch.zeros(num_peers, space.numel) for s in strategies_}
    bounds = shard_bounds(space.numel, num_peers)
    out: dict[str, TopkRound] = {}
    for r in range(rounds):
        picked: dict[str, Selections] = {s.name: Selections([], [], [], r) for s in strategies_}
        for i in range(num_peers):
            pseudo_gradient_N = signals.pseudo_gradient(r, i)
            for strategy in strategies_:
                residual_N = residuals[strategy.name][i]
                residual_N.mul_(strategy.decay).add_(pseudo_gradient_N)
                known = first.get(strategy.name) if first is not None and r == 0 else None
                if known is not None:  # the same selection: nothing came back before the first round
                    idx, val = _sparse(known, i)
                    residual_N[idx] = residual_N[idx] - val  # as ChunkedSelector.select_into leaves it
                else:
                    idx, val = _select(selectors[strategy.name], space, residual_N)
                picked[strategy.name].indices.append(idx)
                picked[strategy.name].values.append(val)
        last = r == rounds - 1
        for strategy in strategies_:
            selections = picked[strategy.name]
            residual_PN = residuals[strategy.name]
            if last:
                selections.payload_bytes = [
                    _payload(space, strategy, idx, val, r)
                    for idx, val in zip(selections.indices, selections.values, strict=True)
                ]
                parts = encode_parts(space, strategy, selections, num_peers, keep_frames=keep_frames)
            else:
                parts = _cut(space, selections, num_peers)
            aggregates = topk_aggregates(parts, space, strategy, r, keep_frames=keep_frames and last)
            kept_N = torch.zeros(space.numel, dtype=torch.bool)
            for kept, (start, _) in zip(aggregates.kept_indices, bounds, strict=True):
                kept_N[kept + start] = True
            for i in range(num_peers):
                idx, val = _sparse(selections, i)
                dropped = ~kept_N[idx]
                residual_PN[i].index_add_(0, idx[dropped], val[dropped])
            for j, (start, _) in enumerate(bounds):
                where, absorbed = aggregates.absorbed[j]
                residual_PN[j].index_add_(0, where + start, absorbed)
            if last:
                out[strategy.name] = TopkRound(selections, parts, aggregates)
    return out


def _cut(space: Space, selections: Selections, num_peers: int) -> Parts:
    """The parts' local indices and values without encoding them (the rounds before the measured one)."""
    bounds = shard_bounds(space.numel, num_peers)
    stops = torch.tensor([stop for _, stop in bounds], dtype=torch.int64)
    local: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for i in range(num_peers):
        indices, values = _sparse(selections, i)
        offsets = [0, *torch.searchsorted(indices, stops).tolist()]
        local.append(
            [
                (indices[offsets[j] : offsets[j + 1]] - start, values[offsets[j] : offsets[j + 1]])
                for j, (start, _) in enumerate(bounds)
            ]
        )
    empty = torch.zeros(num_peers, num_peers)
    return Parts(bounds, empty.long(), local, empty.double())


# ---- latency ----------------------------------------------------------------------------------------------------


def dht_hops(num_peers: int, bucket: int = 20) -> int:
    """Round trips of one DHT lookup among ``num_peers`` peers (module docstring): 1 up to ``bucket`` peers, then one
    more per doubling."""
    return 1 if num_peers <= bucket else 1 + math.ceil(math.log2(num_peers / bucket))


def round_trips(num_peers: int, bucket: int = 20) -> dict[str, int]:
    """The sequential round trips of one outer round, by step (module docstring)."""
    h = dht_hops(num_peers, bucket)
    return {
        "catch-up: get state records": h,
        "register: store": h + 1,
        "registrations: get": h,
        "view check: store": h + 1,
        "view check: get": h,
        "push: part and reply": 1,
        "fetch: request and aggregate": 1,
        "state record: store": h + 1,
        "wait_for_states: get": h,
    }


# ---- one group size -----------------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def row(
    exchange: str,
    strategy: Strategy,
    space: Space,
    selections: Selections,
    parts: Parts,
    aggregates: Aggregates | None,
    wire: Wire,
    *,
    rtt_ms: float,
    bandwidth_mbit: float,
    bucket: int,
) -> dict[str, Any]:
    """One exchange at one group size: the numbers of the module docstring."""
    num = len(parts.bounds)
    payloads = selections.payload_bytes[:num]
    sent, received = wire.sent, wire.received
    trips = round_trips(num, bucket)
    bits_per_s = bandwidth_mbit * 1e6
    push_s = max(max(a, b) for a, b in zip(wire.sent_push, wire.received_push, strict=True)) * 8 / bits_per_s
    fetch_s = max(max(a, b) for a, b in zip(wire.sent_fetch, wire.received_fetch, strict=True)) * 8 / bits_per_s
    if aggregates is not None:
        union, applied = sum(aggregates.union), sum(aggregates.kept)
    else:  # gather: every member applies the union of the parts
        union = applied = _union_size(parts)
    kept = sum(aggregates.kept) if aggregates is not None and EXCHANGES[exchange][1] == "topk" else None
    return {
        "exchange": exchange,
        "strategy": strategy.name,
        "owner_exchange": EXCHANGES[exchange][1],
        "peers": num,
        "numel": space.numel,
        "selected_fraction": _mean([selections.count(i) / space.numel for i in range(num)]),
        "payload_bytes": _mean(payloads),
        "bytes_sent": _mean(sent),
        "bytes_sent_max": max(sent),
        "bytes_received": _mean(received),
        "bytes_received_max": max(received),
        "frame_bytes_sent": _mean(wire.sent_frames),
        "sent_frame_payloads": _mean([f / p for f, p in zip(wire.sent_frames, payloads, strict=True)]),
        "header_share": 1.0 - sum(wire.sent_frames) / max(1, sum(sent)),
        "sent_payloads": _mean([s / p for s, p in zip(sent, payloads, strict=True)]),
        "received_payloads": _mean([s / p for s, p in zip(received, payloads, strict=True)]),
        "messages_sent": _mean(wire.messages_sent),
        "messages_received": _mean(wire.messages_received),
        "streams_opened": 2 * (num - 1),
        "union_entries": union,
        "union_fraction": union / space.numel,
        "kept_entries": kept,
        "kept_fraction": None if kept is None else kept / max(1, union),
        "update_density": applied / space.numel,
        "round_trips": sum(trips.values()),
        "round_trip_steps": trips,
        "latency_rtt_s": sum(trips.values()) * rtt_ms / 1000,
        "latency_push_s": push_s,
        "latency_fetch_s": fetch_s,
        "latency_s": sum(trips.values()) * rtt_ms / 1000 + push_s + fetch_s,
    }


def _union_size(parts: Parts) -> int:
    total = 0
    for j, (start, stop) in enumerate(parts.bounds):
        seen = torch.zeros(stop - start, dtype=torch.bool)
        for peer in parts.local:
            seen[peer[j][0]] = True
        total += int(seen.sum())
    return total


@dataclass
class Settings:
    """What one simulation runs (the command line's flags)."""

    peers: list[int]
    exchanges: list[str]
    rho: float = 0.5
    rounds: int = 3
    lr: float = 3e-6
    inner_steps: int = 8
    seed: int = 0
    rtt_ms: float = 100.0
    bandwidth_mbit: float = 100.0
    dht_bucket: int = 20


@dataclass(frozen=True)
class Task:
    """One unit of the sweep: the ``gather`` / ``sums`` exchanges of a strategy (``kind`` ``plain``) or its ``topk``
    rounds, at one group size."""

    kind: str
    strategy: str
    peers: int


@dataclass
class Sweep:
    """What every task reads: the space, the signals, the settings and the independent peers' selections."""

    space: Space
    signals: Signals
    settings: Settings
    chosen: Plain
    keep_frames: bool = False
    keep_debug: bool = False


_SWEEP: Sweep | None = None
"""The sweep a worker process inherits (set before the pool forks)."""


def run_task(sweep: Sweep, task: Task) -> tuple[list[dict[str, Any]], dict[tuple[str, int], Any]]:
    """The rows of one task (and, for the tests, per exchange its parts, aggregates, wire and selections)."""
    space, settings = sweep.space, sweep.settings
    strategy = strategies()[task.strategy]
    options = {"rtt_ms": settings.rtt_ms, "bandwidth_mbit": settings.bandwidth_mbit, "bucket": settings.dht_bucket}
    names = [e for e in settings.exchanges if EXCHANGES[e][0] == task.strategy]
    rows: list[dict[str, Any]] = []
    debug: dict[tuple[str, int], Any] = {}

    def measure(exchange: str, selections: Selections, parts: Parts, aggregates: Aggregates | None) -> None:
        wire = wire_bytes(parts, EXCHANGES[exchange][1], strategy, aggregates, selections.round_index)
        rows.append(row(exchange, strategy, space, selections, parts, aggregates, wire, **options))
        if sweep.keep_debug:
            debug[(exchange, task.peers)] = (parts, aggregates, wire, selections)

    if task.kind == "topk":
        known = sweep.chosen.first.get(task.strategy)
        first = {} if known is None else {task.strategy: Selections(known.indices, known.values, [], 0)}
        result = topk_rounds(
            space, sweep.signals, [strategy], task.peers, settings.rounds, first=first, keep_frames=sweep.keep_frames
        )[task.strategy]
        for exchange in (e for e in names if EXCHANGES[e][1] == "topk"):
            measure(exchange, result.selections, result.parts, result.aggregates)
        return rows, debug
    selections = sweep.chosen.last[task.strategy]
    if task.strategy == "dense":
        selections = dense_selections(sweep.signals, task.peers, selections.payload_bytes)
    parts = encode_parts(space, strategy, selections, task.peers, keep_frames=sweep.keep_frames)
    for exchange in (e for e in names if EXCHANGES[e][1] != "topk"):
        aggregates = None
        if EXCHANGES[exchange][1] == "sums":
            aggregates = sum_aggregates(parts, strategy, selections.round_index, keep_frames=sweep.keep_frames)
        measure(exchange, selections, parts, aggregates)
    return rows, debug


def _pool_task(task: Task) -> tuple[Task, list[dict[str, Any]], float]:
    """A worker's task: its rows and seconds (the frames stay in the worker)."""
    if _SWEEP is None:  # the pool forks after the sweep is set
        raise RuntimeError("no sweep in this worker")
    torch.set_num_threads(1)
    started = time.monotonic()
    rows, _ = run_task(_SWEEP, task)
    return task, rows, time.monotonic() - started


def simulate(
    space: Space,
    settings: Settings,
    *,
    log: Any = None,
    keep_debug: bool = False,
    keep_frames: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    """Every exchange of ``settings`` at every group size: ``{"rows": [...], "seconds": {...}, "debug": {...}}``
    (``debug``, with ``keep_debug`` and ``workers`` 1 only, for the tests: per ``(exchange, peers)`` the
    :class:`Parts`, the :class:`Aggregates` or None, the :class:`Wire` and the :class:`Selections`; frames kept when
    ``keep_frames``). The independent peers'
    selections are made here; the tasks (a strategy's exchanges at one group size) then run in ``workers`` forked
    processes, the largest first. Raises :class:`ValueError` for bad settings."""
    global _SWEEP
    say = log or (lambda message: None)
    unknown = [name for name in settings.exchanges if name not in EXCHANGES]
    if unknown or settings.rounds < 1 or not settings.peers or min(settings.peers) < 2 or workers < 1:
        raise ValueError(f"bad settings: unknown exchanges {unknown}, rounds {settings.rounds}, peers {settings.peers}")
    signals = Signals(space, rho=settings.rho, lr=settings.lr, inner_steps=settings.inner_steps, seed=settings.seed)
    by_name = strategies()
    peers = sorted(settings.peers)
    kinds = {(EXCHANGES[e][0], "topk" if EXCHANGES[e][1] == "topk" else "plain") for e in settings.exchanges}
    seconds: dict[str, float] = {}
    started = time.monotonic()
    chosen = plain_selections(
        space,
        signals,
        [by_name[n] for n in by_name if (n, "plain") in kinds],
        [by_name[n] for n in by_name if (n, "topk") in kinds],
        peers[-1],
        settings.rounds,
        say,
    )
    seconds["selections"] = time.monotonic() - started
    say(f"{peers[-1]} peers selected in {seconds['selections']:.0f} s")
    tasks = [Task(kind, name, num) for name, kind in sorted(kinds) for num in peers]
    tasks.sort(key=lambda t: (-t.peers, t.kind != "topk", t.strategy))
    sweep = Sweep(space, signals, settings, chosen, keep_frames, keep_debug)
    rows: list[dict[str, Any]] = []
    debug: dict[tuple[str, int], Any] = {}

    def done(task: Task, task_rows: list[dict[str, Any]], took: float) -> None:
        rows.extend(task_rows)
        seconds[f"{task.strategy} {task.kind}: {task.peers} peers"] = took
        say(f"{', '.join(r['exchange'] for r in task_rows)}: {task.peers} peers in {took:.1f} s")

    if workers == 1:
        for task in tasks:
            begun = time.monotonic()
            task_rows, task_debug = run_task(sweep, task)
            debug.update(task_debug)
            done(task, task_rows, time.monotonic() - begun)
    else:
        import multiprocessing

        _SWEEP = sweep
        try:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for task, task_rows, took in pool.imap_unordered(_pool_task, tasks):
                    done(task, task_rows, took)
        finally:
            _SWEEP = None
    diloco = {r["peers"]: r["bytes_sent"] for r in rows if r["exchange"] == "diloco"}
    for r in rows:
        r["fewer_than_diloco"] = diloco[r["peers"]] / r["bytes_sent"] if r["peers"] in diloco else None
    order = {name: k for k, name in enumerate(EXCHANGES)}
    rows.sort(key=lambda r: (order[r["exchange"]], r["peers"]))
    return {"rows": rows, "seconds": seconds, "debug": debug}


# ---- report -----------------------------------------------------------------------------------------------------


def _grid(rows: list[dict[str, Any]], peers: list[int], value: Any) -> list[list[Any]]:
    names = list(dict.fromkeys(r["exchange"] for r in rows))
    table = []
    for name in names:
        cells: list[Any] = [name]
        for num in peers:
            match = [r for r in rows if r["exchange"] == name and r["peers"] == num]
            cells.append(value(match[0]) if match else "-")
        table.append(cells)
    return table


def markdown(result: dict[str, Any], settings: Settings, space: Space, command: str) -> str:
    """The tables of ``sim.md``."""
    rows, peers = result["rows"], settings.peers
    head = ["exchange", *[f"P={p}" for p in peers]]
    diloco = [r for r in rows if r["exchange"] == "diloco"]
    payload = diloco[0]["payload_bytes"] if diloco else None
    sections = [
        "# The exchange at scale (simulated)",
        "",
        f"Command: `{command}`",
        "",
        f"Model shapes: {space.name}, N = {space.numel:,} entries; rho {settings.rho}, {settings.rounds} rounds "
        f"(bytes of the last), lr {settings.lr:g} x H {settings.inner_steps}, seed {settings.seed}; latency at "
        f"{settings.rtt_ms:g} ms round-trip time and {settings.bandwidth_mbit:g} Mbit/s"
        + (f"; DiLoCo's payload {payload / 1e6:.2f} MB." if payload else "."),
        "",
        "## Bytes sent per peer per round, in payloads (the peer's own selection as one frame)",
        "",
        md_table(head, _grid(rows, peers, lambda r: f"{r['sent_payloads']:.2f}")),
        "",
        "## The frames alone (without the stream's headers and protobuf framing), sent per peer, in payloads",
        "",
        md_table(head, _grid(rows, peers, lambda r: f"{r['sent_frame_payloads']:.2f}")),
        "",
        "## Share of the bytes sent that are not frames (stream headers: accepted ids, clip bar, part sizes)",
        "",
        md_table(head, _grid(rows, peers, lambda r: f"{100 * r['header_share']:.1f}%")),
        "",
        "## Bytes received per peer per round, in payloads",
        "",
        md_table(head, _grid(rows, peers, lambda r: f"{r['received_payloads']:.2f}")),
        "",
        "## Bytes sent per peer per round",
        "",
        md_table(head, _grid(rows, peers, lambda r: _human(r["bytes_sent"]))),
        "",
        "## Times fewer bytes sent than DiLoCo",
        "",
        md_table(head, _grid(rows, peers, lambda r: _times(r["fewer_than_diloco"]))),
        "",
        "## Messages sent + received per peer per round",
        "",
        md_table(head, _grid(rows, peers, lambda r: f"{r['messages_sent'] + r['messages_received']:.0f}")),
        "",
        f"## Latency of a round: round trips x {settings.rtt_ms:g} ms + push and fetch at "
        f"{settings.bandwidth_mbit:g} Mbit/s (seconds)",
        "",
        md_table(
            head,
            _grid(
                rows,
                peers,
                lambda r: f"{r['latency_s']:.2f} ({r['round_trips']} RTT + {_transfer(r):.2f})",
            ),
        ),
        "",
        "## Density of the consensus update (entries applied per round / N)",
        "",
        md_table(head, _grid(rows, peers, lambda r: f"{100 * r['update_density']:.2f}%")),
        "",
        "## topk: union of the parts / N, and the fraction of it kept",
        "",
        md_table(
            head,
            _grid(
                [r for r in rows if r["owner_exchange"] == "topk"],
                peers,
                lambda r: f"{100 * r['union_fraction']:.1f}% / {100 * (r['kept_fraction'] or 0):.1f}%",
            ),
        ),
        "",
        "Selected per peer and round (mean fraction of N): "
        + ", ".join(
            f"{name} {100 * r['selected_fraction']:.2f}%"
            for name, r in {r["exchange"]: r for r in rows if r["peers"] == peers[-1]}.items()
        )
        + f" (at {peers[-1]} peers).",
        "",
    ]
    return "\n".join(sections)


def _human(num_bytes: float) -> str:
    for unit in ("B", "kB", "MB"):
        if abs(num_bytes) < 1000:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.2f} GB"


def _transfer(r: dict[str, Any]) -> float:
    return float(r["latency_push_s"] + r["latency_fetch_s"])


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


# ---- command line -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (argparse exits 2 on a bad flag)."""
    parser = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--peers", default=",".join(map(str, DEFAULT_PEERS)), help="group sizes (default 4..256)")
    parser.add_argument("--rho", type=float, default=0.5, help="correlation of two peers' pseudo-gradients")
    parser.add_argument("--rounds", type=int, default=3, help="rounds with error feedback; bytes of the last")
    parser.add_argument("--size", choices=sorted(WARM_MEDIAN_ABS), default="demo", help="warm model shapes")
    parser.add_argument("--exchanges", default=",".join(DEFAULT_EXCHANGES), help=f"of {', '.join(EXCHANGES)}")
    parser.add_argument("--lr", type=float, default=3e-6, help="inner learning rate of the synthetic steps")
    parser.add_argument("--inner-steps", type=int, default=8, help="H, inner steps per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rtt-ms", type=float, default=100.0, help="round-trip time for the latency")
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0, help="link speed for the latency")
    parser.add_argument("--dht-bucket", type=int, default=20, help="Kademlia bucket size k of the hop model")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="processes for the sweep's tasks (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: a new one under results/)")
    args = parser.parse_args(argv)
    try:
        args.peers = sorted({int(p) for p in args.peers.split(",") if p})
    except ValueError:
        parser.error(f"--peers takes integers separated by commas, got {args.peers!r}")
    args.exchanges = [e for e in args.exchanges.split(",") if e]
    if any(e not in EXCHANGES for e in args.exchanges):
        parser.error(f"--exchanges takes names of {', '.join(EXCHANGES)}, got {args.exchanges}")
    if not args.peers or min(args.peers) < 2 or args.rounds < 1 or not 0.0 <= args.rho <= 1.0 or args.workers < 1:
        parser.error("--peers at least 2 each, --rounds and --workers at least 1, --rho in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the simulation and write ``sim.json`` and ``sim.md``."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"{PROG}: [{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    shapes, theta_N = model_shapes(args.size)
    median = WARM_MEDIAN_ABS[args.size]
    space = build_space(shapes, theta_N=theta_N, theta_median=median, seed=args.seed, name=args.size)
    settings = Settings(
        peers=args.peers,
        exchanges=args.exchanges,
        rho=args.rho,
        rounds=args.rounds,
        lr=args.lr,
        inner_steps=args.inner_steps,
        seed=args.seed,
        rtt_ms=args.rtt_ms,
        bandwidth_mbit=args.bandwidth_mbit,
        dht_bucket=args.dht_bucket,
    )
    out = args.out or default_out("scale", f"{args.size}-rho{args.rho:g}")
    log(f"{args.size}: N = {space.numel:,}; peers {args.peers}; exchanges {', '.join(args.exchanges)} -> {out}")
    result = simulate(space, settings, log=log, workers=args.workers)
    flags = sys.argv[1:] if argv is None else argv
    command = shlex.join([".venv/bin/python", "experiments/scale/simulate.py", *flags])
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": command,
        "commit": git_revision(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "settings": {**settings.__dict__, "workers": args.workers, "threads": args.threads},
        "model": {"size": args.size, "numel": space.numel, "theta_median_abs": WARM_MEDIAN_ABS[args.size]},
        "rows": result["rows"],
        "seconds": {**result["seconds"], "total": time.monotonic() - started},
    }
    (out / "sim.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "sim.md").write_text(markdown(result, settings, space, command))
    log(f"wrote {out / 'sim.md'} and sim.json")
    print(out / "sim.md")


if __name__ == "__main__":
    main()
