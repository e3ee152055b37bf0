"""The ``topk`` exchange without a network: an owner keeps a budget of its shard's aggregate per tile
(``pulseloco.loco.reduce``), members read which of their entries were kept (``averaging.delivery``), what the owner
dropped goes back to its senders, its rounding of the kept values to the owner, and nothing is counted twice or lost.
The swarm form (real DHTs, real processes) is in tests/test_loco_swarm.py."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from loco_helpers import pending

from pulseloco.errors import PayloadError
from pulseloco.loco.averaging import SparseAverager, delivery
from pulseloco.loco.ledger import Ledger, LedgerEntry
from pulseloco.loco.matchmaking import Group
from pulseloco.loco.quantize import ParamLayout
from pulseloco.loco.reduce import DEFAULT_EXCHANGE_BUDGET, ReduceSpec, TileMap, check_budget, reduce_parts
from pulseloco.loco.robust import RepeatOutliers, part_norm
from pulseloco.loco.selection import ChunkedSelector
from pulseloco.loco.shard_owner import AGGREGATE_NAME, CONTRIBUTION_NAME, ShardOwner, ShardSum
from pulseloco.loco.validation import decode_sparse, encode_sparse

# A 4 x 8 matrix (two 4 x 4 tiles at chunk 4: flat 0-3, 8-11, 16-19, 24-27 and 4-7, 12-15, ...) and a vector of 10
# (rows of 4: 32-35, 36-39, 40-41).
LAYOUT = ParamLayout([(4, 8), (10,)])
NUMEL = 42
FP32 = ReduceSpec(LAYOUT, chunk=4, k=2, value_dtype="float32")

# Three peers' parts (global = local indices: one shard). Sums: 0 -> 3, 1 -> -2, 4 -> 5, 5 -> 0, 6 -> 0.1, 33 -> 0.5,
# 34 -> 0.25. Budget at k=2: 2 in each full 4 x 4 tile, ceil(2 * 4 / 16) = 1 in each row of 4 of the vector.
PARTS = {
    "a": ([0, 1, 5, 33], [1.0, -3.0, 2.0, 0.5]),
    "b": ([1, 4, 5, 34], [1.0, 4.0, -2.0, 0.25]),
    "c": ([0, 4, 6], [2.0, 1.0, 0.1]),
}


def _parts(parts: dict[str, tuple[list[int], list[float]]]) -> list[tuple[tuple[torch.Tensor, torch.Tensor], float]]:
    return [((torch.tensor(i), torch.tensor(v)), 1.0) for _, (i, v) in sorted(parts.items())]


def test_tiles_follow_the_selectors_matrix_view() -> None:
    tile_K, numel_K = TileMap(LAYOUT, 4).tiles(torch.tensor([0, 3, 4, 8, 27, 28, 32, 36, 40, 41]))
    assert tile_K.tolist() == [0, 0, 1, 0, 0, 1, 2, 3, 4, 4]
    assert numel_K.tolist() == [16, 16, 16, 16, 16, 16, 4, 4, 2, 2]


def test_a_tile_cut_by_a_shard_boundary_counts_only_the_shards_entries() -> None:
    tiles = TileMap(LAYOUT, 4)
    # shard [14, 30) of the matrix: rows 2-3 of tile 0 (16-19, 24-27: 8), and of tile 1 14-15, 20-23, 28-29 (8)
    tile_K, numel_K = tiles.tiles(torch.tensor([14, 16, 29]))
    assert tiles.numel_in(tile_K, numel_K, 14, 30).tolist() == [8, 8, 8]
    # shard [10, 30): rows 1 (from col 2) to 3 of each, 10 entries each; the vector's [33, 39): 3 of each row of 4
    tile_K, numel_K = tiles.tiles(torch.tensor([10, 29, 33, 38]))
    assert tiles.numel_in(tile_K, numel_K, 10, 30).tolist()[:2] == [10, 10]
    assert tiles.numel_in(tile_K[2:], numel_K[2:], 33, 39).tolist() == [3, 3]
    assert tiles.numel_in(tile_K, numel_K, 0, NUMEL).tolist() == [16, 16, 4, 4]  # one shard: nothing cut


def test_each_owner_of_a_cut_tile_budgets_only_its_share_of_it() -> None:
    """k=2 per 4 x 4 tile: a whole tile keeps 2; the shard [14, 30) holds half of each matrix tile, so its owner
    keeps ceil(2 * 8 / 16) = 1 in each, and a member refuses 2 there."""
    parts = {"a": ([16 - 14, 17 - 14, 15 - 14, 20 - 14], [3.0, -1.0, 2.0, -4.0]), "b": ([24 - 14], [-5.0])}
    reduced = reduce_parts(_parts(parts), start=14, numel=16, spec=FP32, mean_over="peers")
    assert (reduced.indices_K + 14).tolist() == [20, 24]  # tile 0: 24 (-5) over 16 (3); tile 1: 20 (-4) over 15 (2)
    check_budget(FP32, torch.tensor([2, 6]), 14, 16)
    with pytest.raises(PayloadError, match="budget"):
        check_budget(FP32, torch.tensor([2, 3]), 14, 16)  # 16 and 17: two in the half of tile 0
    check_budget(FP32, torch.tensor([2, 3]), 0, NUMEL)  # the same two in the whole tile: within its budget


def test_the_owner_keeps_the_largest_sums_of_each_tile_hand_checked() -> None:
    reduced = reduce_parts(_parts(PARTS), start=0, numel=NUMEL, spec=FP32, mean_over="peers")
    # tile 0: 0 (3) and 1 (-2); tile 1: 4 (5) and 6 (0.1), not 5 (0); vector row 32-35: 33 (0.5), not 34 (0.25).
    assert reduced.indices_K.tolist() == [0, 1, 4, 6, 33]
    assert reduced.values_K.tolist() == pytest.approx([3.0, -2.0, 5.0, 0.1, 0.5])
    assert reduced.num_union == 7
    assert torch.equal(reduced.absorbed_K, torch.zeros(5))  # FP32 on the wire: nothing to round


def test_without_k_the_budget_is_the_parts_mean_count_and_quantized_rounding_is_absorbed() -> None:
    spec = ReduceSpec(LAYOUT, chunk=4, k=None, value_dtype="quantized", bits=2)
    reduced = reduce_parts(_parts(PARTS), start=0, numel=NUMEL, spec=spec, mean_over="senders")
    # tile 0: the parts hold 2, 1 and 1 entries: budget ceil(4/3) = 2; tile 1: 1, 2, 2: ceil(5/3) = 2; the vector's
    # first row: 1, 1, 0: ceil(2/3) = 1. Means over senders: 0 -> 1.5, 1 -> -1, 4 -> 2.5, 5 -> 0, 6 -> 0.1.
    assert reduced.indices_K.tolist() == [0, 1, 4, 6, 33]
    exact = torch.tensor([1.5, -1.0, 2.5, 0.1, 0.5])
    # sent + absorbed is the aggregate, to the one rounding of the absorbed difference
    assert torch.allclose(reduced.values_K + reduced.absorbed_K, exact, rtol=0.0, atol=1e-7)
    assert len(set(reduced.values_K[:4].tolist())) <= 4  # one 2-bit table for the matrix's kept values
    assert float(reduced.absorbed_K.abs().max()) > 0.0


def test_a_member_refuses_an_aggregate_over_its_budget() -> None:
    check_budget(FP32, torch.tensor([0, 1, 4, 6, 33]), 0, NUMEL)
    with pytest.raises(PayloadError, match="budget"):
        check_budget(FP32, torch.tensor([0, 1, 2, 4]), 0, NUMEL)  # three entries in tile 0
    with pytest.raises(PayloadError, match="budget"):
        check_budget(FP32, torch.tensor([1, 2]), 32, 10)  # local 1 and 2 of a shard from 32: one row of the vector


def test_a_budget_of_two_parts_keeps_twice_the_entries_per_tile_hand_checked() -> None:
    """``factor`` 2 (the default ``exchange_budget``): 4 in each full 4 x 4 tile, ceil(2 * 2 * 4 / 16) = 1 in each
    row of 4 of the vector; without ``k``, twice the parts' mean count (tile 0: ceil(2 * 4/3) = 3)."""
    spec = ReduceSpec(LAYOUT, chunk=4, k=2, value_dtype="float32", factor=2.0)
    reduced = reduce_parts(_parts(PARTS), start=0, numel=NUMEL, spec=spec, mean_over="peers")
    assert reduced.indices_K.tolist() == [0, 1, 4, 5, 6, 33]  # tile 1 keeps all three of its union now
    check_budget(spec, torch.tensor([0, 1, 2, 3, 4, 33]), 0, NUMEL)
    with pytest.raises(PayloadError, match="2 x k=2"):
        check_budget(spec, torch.tensor([0, 1, 2, 3, 8]), 0, NUMEL)  # five entries in tile 0
    gate = ReduceSpec(LAYOUT, chunk=4, k=None, value_dtype="float32", factor=2.0)
    reduced = reduce_parts(_parts(PARTS), start=0, numel=NUMEL, spec=gate, mean_over="peers")
    assert reduced.indices_K.tolist() == [0, 1, 4, 5, 6, 33, 34]  # every row of the vector: ceil(2 * 2/3) = 2
    for bad in (0.0, -1.0, 5000.0):
        with pytest.raises(ValueError, match="factor"):
            ReduceSpec(LAYOUT, factor=bad)


def test_exchange_budget_is_checked_with_the_fix() -> None:
    from pulseloco.errors import ConfigError
    from pulseloco.loco.config import AveragingConfig

    assert AveragingConfig().exchange_budget == DEFAULT_EXCHANGE_BUDGET == 2.0
    assert AveragingConfig(exchange_budget=1).exchange_budget == 1
    for bad in (0, -2.0, True, "2", 1e9):
        with pytest.raises(ConfigError, match="exchange_budget must be a number above 0"):
            AveragingConfig(exchange_budget=bad)  # type: ignore[arg-type]


class _Owner(ShardOwner):
    """An owner's aggregation without a network (``_sum_contributions`` is pure CPU work)."""

    def __init__(self, peer_id: str, spec: ReduceSpec = FP32, exchange: str = "topk") -> None:
        self.numel, self.peer_id, self.max_norm_ratio = NUMEL, peer_id, 10.0
        self.clip_to_median, self.dispute_norm_ratio = False, 4.0
        self.repeat_outliers = RepeatOutliers(8)
        self.exchange, self.reduce_spec, self.mean_over = exchange, spec, "peers"

    def sum(self, parts: dict[str, tuple[list[int], list[float]]]) -> ShardSum:
        frames = {
            peer: encode_sparse(CONTRIBUTION_NAME, NUMEL, torch.tensor(i), torch.tensor(v), round_index=0)
            for peer, (i, v) in parts.items()
        }
        return self._sum_contributions(0, NUMEL, frames, len(parts), 0)


def _member(peer_id: str, spec: ReduceSpec = FP32) -> SparseAverager:
    member = object.__new__(SparseAverager)  # the member's checks and averaging only: no network
    member.peer_id, member.max_norm_ratio, member.disputed = peer_id, 10.0, set()
    member.reduce_spec, member.exchange = spec, "topk"
    return member


GROUP = Group(round=0, members=("a", "b", "c"), servers=("a",))


def test_an_owner_takes_parts_of_the_round_it_registers_for_though_it_joined_late() -> None:
    """An owner accepts parts for rounds next to its current one; a peer that just joined (or downloaded the
    swarm's state) is many rounds past its last exchange, so registering for a round moves the window there
    first (``expect_round``, before matchmaking): a member that pushes as soon as the group forms is not refused
    (it was, and the group then waited out averaging_timeout: tests/test_wan.py's churn run)."""
    owner = _Owner("a")
    owner._owned, owner._current_round = {}, 0
    assert owner._owned_shard(6, "g") is None  # a fresh process: round 6 is out of its window
    owner.expect_round(6)
    assert owner._owned_shard(6, "g") is not None and owner._owned_shard(5, "g") is not None
    assert owner._owned_shard(4, "g") is None and owner._owned_shard(9, "g") is None


def test_conservation_in_a_group_of_three_hand_checked() -> None:
    """Each member's sent entries are counted where the owner kept them and returned where it did not; the owner's
    rounding stays with the owner: per peer, counted + returned == sent, and over the group, what theta gets (the
    kept sums) plus what the owner absorbed is everything counted."""
    summed = _Owner("a").sum(PARTS)
    assert summed.header["exchange"] == "topk" and summed.header["accepted"] == ["a", "b", "c"]
    counted_N = torch.zeros(NUMEL)
    returned_at: dict[str, list[int]] = {}
    for peer, (i, v) in PARTS.items():
        indices_K, values_K = torch.tensor(i), torch.tensor(v)
        member = _member(peer)
        own = encode_sparse(CONTRIBUTION_NAME, NUMEL, indices_K, values_K, round_index=0)
        results: list[tuple[dict[str, Any], bytes] | None] = [(summed.header, summed.payload)]
        got = member._average_shards(
            GROUP, [(0, NUMEL)], results, [float(values_K.abs().max())], [own], [part_norm(values_K)]
        )
        indices, averages, accepted, _, _, _, kept = got
        assert accepted == [("a", "b", "c")]
        assert indices[0].tolist() == [0, 1, 4, 6, 33]
        assert averages[0].tolist() == pytest.approx([1.0, -2 / 3, 5 / 3, 0.1 / 3, 0.5 / 3])
        returned_K, dropped_K, unknown = delivery(
            peer, indices_K, [0, len(i)], [(0, NUMEL)], accepted, kept, topk_expected=True
        )
        assert torch.equal(returned_K, dropped_K) and unknown == []
        returned_at[peer] = indices_K[returned_K].tolist()
        counted_N.index_add_(0, indices_K[~returned_K], values_K[~returned_K])
    # a: 5 and 34 are not kept; b: 5 and 34; c: nothing of its entries was dropped (0, 4, 6 kept).
    assert returned_at == {"a": [5], "b": [5, 34], "c": []}
    kept_K, sums_K = decode_sparse(summed.payload, AGGREGATE_NAME, NUMEL)
    applied_N = torch.zeros(NUMEL).index_add_(0, kept_K, sums_K)
    assert summed.absorbed is not None
    absorbed_N = torch.zeros(NUMEL).index_add_(0, summed.absorbed[0], summed.absorbed[1])
    assert torch.equal(applied_N + absorbed_N, counted_N)


def test_a_dropped_entry_stays_in_the_residual_and_is_sent_later() -> None:
    """A SparseLoCo-style selection (top-1 per row of 4, FP32 values) over two rounds: peer c's entry 9 loses to
    the others' sum at 8 in round 1 and comes back to its residual whole; in round 2 it is selected again (its
    residual plus the new signal) and, the others sending nothing there now, kept."""
    layout = ParamLayout([(12,)])
    spec = ReduceSpec(layout, chunk=4, k=4, value_dtype="float32")  # ceil(4 * 4 / 16) = 1 per row of 4
    selector = ChunkedSelector(layout, gate=False, k=4, chunk=4, values="float32")
    theta_N = torch.zeros(12)
    signals = {"a": torch.zeros(12), "b": torch.zeros(12), "c": torch.zeros(12)}
    signals["a"][8], signals["b"][8], signals["c"][9] = 1.0, 1.0, 1.5
    residuals = {}
    round1 = {}
    for peer, signal_N in signals.items():
        selection = selector.select(theta_N, signal_N)
        residuals[peer] = selection.residual_N.clone()
        round1[peer] = (selection.indices_K.tolist(), selection.values_K.tolist())
    assert round1["c"] == ([0, 4, 9], [0.0, 0.0, 1.5])  # SparseLoCo sends k per tile, zeros included
    reduced = reduce_parts(_parts(round1), start=0, numel=12, spec=spec, mean_over="peers")
    assert reduced.indices_K.tolist() == [0, 4, 8]  # the sum 2 at 8 beats c's 1.5 at 9
    indices_K = torch.tensor(round1["c"][0])
    returned_K, dropped_K, _ = delivery(
        "c", indices_K, [0, 3], [(0, 12)], [("a", "b", "c")], [reduced.indices_K], topk_expected=True
    )
    assert dropped_K.tolist() == [False, False, True]
    residuals["c"].index_add_(0, indices_K[returned_K], torch.tensor(round1["c"][1])[returned_K])
    assert torch.equal(residuals["c"], signals["c"])  # nothing of it was lost
    signal2 = residuals["c"] + 0.25 * (torch.arange(12) == 9)
    again = selector.select(theta_N, signal2)
    assert again.indices_K.tolist() == [0, 4, 9] and again.values_K.tolist() == [0.0, 0.0, 1.75]
    reduced2 = reduce_parts(
        _parts({"c": ([0, 4, 9], [0.0, 0.0, 1.75])}), start=0, numel=12, spec=spec, mean_over="peers"
    )
    assert reduced2.indices_K.tolist() == [0, 4, 9] and reduced2.values_K.tolist() == [0.0, 0.0, 1.75]


def test_a_malformed_or_oversized_aggregate_is_refused_and_nothing_is_lost() -> None:
    """An owner serving more entries per tile than the budget, or a frame that does not decode: the member applies
    nothing of that shard and gets back every entry it sent there (``returned_K``), as for a missing sum."""
    member = _member("b")
    indices_K, values_K = torch.tensor(PARTS["b"][0]), torch.tensor(PARTS["b"][1])
    own = encode_sparse(CONTRIBUTION_NAME, NUMEL, indices_K, values_K, round_index=0)
    dense = encode_sparse(AGGREGATE_NAME, NUMEL, torch.arange(NUMEL), torch.ones(NUMEL), round_index=0)
    honest = {"ok": True, "accepted": ["a", "b", "c"], "exchange": "topk"}
    served = _Owner("a").sum(PARTS)  # within the budget, but reduced at another exchange_budget than the member's
    other_budget = ({**served.header, "budget": 4.0}, served.payload)
    assert served.header["budget"] == FP32.factor
    for header, payload in ((honest, dense), (honest, dense[:-3]), other_budget):
        got = member._average_shards(GROUP, [(0, NUMEL)], [(header, payload)], [4.0], [own], [part_norm(values_K)])
        indices, _, accepted, _, _, _, kept = got
        assert indices == [] and accepted == [None] and kept == [None]
        returned_K, dropped_K, unknown = delivery(
            "b", indices_K, [0, 4], [(0, NUMEL)], accepted, kept, topk_expected=True
        )
        assert returned_K.all() and not dropped_K.any() and unknown == [0]


def test_auto_picks_topk_for_quantized_values_where_it_sends_less_than_gather() -> None:
    """``gather`` sends ``R - 1`` payloads, ``topk`` ``(1 + factor) (R - 1)/R``: topk from 3 peers on with an
    aggregate of one part, from 4 with the default of two; at equal bytes the exact gather."""
    owner = _Owner("a", ReduceSpec(LAYOUT, chunk=4, k=2, value_dtype="quantized"), exchange="auto")
    assert [owner.exchange_for(r) for r in (1, 2, 3, 64)] == ["gather", "gather", "topk", "topk"]
    spec = ReduceSpec(LAYOUT, chunk=4, k=2, value_dtype="quantized", factor=DEFAULT_EXCHANGE_BUDGET)
    assert [_Owner("a", spec, exchange="auto").exchange_for(r) for r in (3, 4)] == ["gather", "topk"]
    assert _Owner("a", FP32, exchange="auto").exchange_for(8) == "sums"


def test_the_owners_absorbed_rounding_follows_the_adopted_lineage(caplog: pytest.LogCaptureFixture) -> None:
    """The absorbed error stays in the owner's residual when the adopted theta applied its shard in that group,
    leaves it otherwise (and comes back if a later state applied it after all); a shard whose kept set this peer
    never learned is not corrected, and that is logged."""
    ledger = Ledger("me")
    residual_N = torch.zeros(6)
    absorbed = (0, torch.tensor([1, 4]), torch.tensor([0.25, -0.5]))
    residual_N.index_add_(0, absorbed[1], absorbed[2])
    bounds = [(0, 5), (5, 6)]
    part = pending("g", torch.tensor([1, 4]), torch.tensor([1.0, 2.0]), bounds, [True, False], absorbed=absorbed)
    part.kept_unknown = {1}
    ledger.record(3, LedgerEntry("g", (("me",), None)), part)
    moved = ledger.reconcile({3: LedgerEntry("other", (("x",), ("x",)))}, 4, residual_N)
    # Another group's round: nothing of this peer counted (its part of shard 0 comes back) and no absorbed error.
    assert moved == 4 and residual_N.tolist() == [0.0, 1.0, 0.0, 0.0, 2.0, 0.0]
    ledger2 = Ledger("me")
    residual2 = torch.zeros(6)
    pending2 = pending("g", torch.tensor([1, 4]), torch.tensor([1.0, 2.0]), [(0, 3), (3, 6)], [True, False])
    pending2.kept_unknown = {1}
    ledger2.record(3, LedgerEntry("g", (("me",), None)), pending2)
    with caplog.at_level(logging.WARNING, logger="pulseloco.loco.ledger"):
        ledger2.reconcile({3: LedgerEntry("g", (("me",), ("me",)))}, 4, residual2)
    assert torch.equal(residual2, torch.zeros(6))  # shard 1's kept set is unknown: not corrected
    assert "cannot reconcile round=3 shard=1 exactly" in caplog.text
    # The owner's own wait for its shard was cut short (not applied here, the error kept aside), but the others
    # applied it: a repair to their theta puts the error into the residual, once.
    ledger3 = Ledger("me")
    residual3 = torch.zeros(6)
    pending3 = pending(
        "g", torch.tensor([1, 4]), torch.tensor([1.0, 2.0]), [(0, 5), (5, 6)], [False, False], absorbed=absorbed
    )
    pending3.absorbed_counted = False
    ledger3.record(3, LedgerEntry("g", (None, None)), pending3)
    applied = {3: LedgerEntry("g", (("me", "x"), ("x",)))}
    assert ledger3.reconcile(applied, 4, residual3) == 4  # the part counted after all, and the error
    assert residual3.tolist() == [0.0, -0.75, 0.0, 0.0, -2.5, 0.0]  # - (1, 2) counted + (0.25, -0.5) absorbed
    assert ledger3.reconcile(applied, 4, residual3) == 0


def test_a_state_that_counted_an_unfetched_topk_part_names_the_kept_entries() -> None:
    """A peer that never fetched a topk shard returned its whole part there; the adopted state counted it, and its
    ledger's kept set (JSON, Rice-coded) says which entries: exactly those leave the residual, once."""
    # shard 1's part is 2, 4, 8 (norm sqrt(84)); its owner's bar, half that, clips it at 1/2
    entry = LedgerEntry("g", (("me",), ("me",)), (None, 0.5 * math.sqrt(84.0)), (None, torch.tensor([3, 5])))
    parsed = Ledger.parse({"3": entry.to_json(6)})[3]
    assert parsed.kept_in(0) is None and parsed.kept_in(1) is not None
    assert parsed.kept_in(1).tolist() == [3, 5]  # type: ignore[union-attr]
    ledger = Ledger("me")
    residual_N = torch.tensor([0.0, 0.0, 0.0, 2.0, 4.0, 8.0])  # the part of shard 1 came back whole
    part = pending("g", torch.tensor([1, 3, 4, 5]), torch.tensor([1.0, 2.0, 4.0, 8.0]), [(0, 3), (3, 6)], [True, False])
    part.kept_unknown = {1}
    ledger.record(3, LedgerEntry("g", (("me",), None)), part)
    assert ledger.reconcile({3: parsed}, 4, residual_N) == 2
    # 3 and 5 were kept, at clip scale 0.5: half of each leaves; 4 was dropped by the owner and stays whole.
    assert residual_N.tolist() == [0.0, 0.0, 0.0, 1.0, 4.0, 4.0]
    assert ledger.reconcile({3: parsed}, 4, residual_N) == 0  # a second reconcile moves nothing


@pytest.mark.parametrize(
    "kept",
    [
        {"count": 2, "method": "rice", "k": 0, "data": "!!"},
        {"count": 9, "method": "all", "k": 0, "data": ""},
        {"count": 1, "method": "bitmask", "k": 0, "data": "AA=="},
        ["not", "an", "object"],
    ],
)
def test_a_malformed_kept_set_is_refused(kept: Any) -> None:
    data = {"group": "g", "accepted": [["a"]], "bars": [None], "numel": 6, "kept": [kept]}
    Ledger.parse({"1": {**data, "kept": [None]}})  # well formed but for the kept set
    with pytest.raises(PayloadError):
        Ledger.parse({"1": data})


def test_served_headers_name_the_accepted_peers_by_a_mask_of_the_group_and_carry_one_clip_bar() -> None:
    """An owner sends its accepted list as a hex mask over the group's sorted members (peer ids would cost every
    member O(R) bytes per shard) and one clip bar, whatever the group's size (each member derives its own scale);
    the member reads them back and refuses a mask or a bar that is not valid."""
    from pulseloco.loco.shard_owner import accepted_names, compact_header, served_bar

    members = ("a", "b", "c", "d")
    header = {"ok": True, "accepted": ["a", "c"], "clip_bar": 7.5, "rejected": ["d"], "exchange": "topk"}
    wire = compact_header(header, list(members))
    assert wire == {"ok": True, "exchange": "topk", "accepted_mask": "5", "clip_bar": 7.5}
    assert accepted_names(wire, members) == ["a", "c"]
    assert served_bar(wire) == 7.5 and served_bar({**wire, "clip_bar": 3}) == 3.0
    assert served_bar({"accepted_mask": "5"}) is None  # nothing clipped
    assert accepted_names(compact_header({**header, "accepted": []}, list(members)), members) == []
    for bad in ("", "10", "zz", 5, "0000f"):
        with pytest.raises(PayloadError, match="accepted_mask"):
            accepted_names({"accepted_mask": bad}, members)
    for bar in ("7.5", True, -1.0, float("nan"), float("inf"), [7.5]):
        with pytest.raises(PayloadError, match="clip bar"):
            served_bar({"clip_bar": bar})
