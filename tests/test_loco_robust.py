"""pulseloco.loco.robust and its use by the owner, the member and the sender, on hand-checked tensors (no swarm).

The owner's sum (``ShardOwner._sum_contributions``) clips each part to the median norm and reports the bar; the
member checks the bar it receives and derives its own scale (``SparseAverager._average_shards``); the sender
returns what was clipped off to its residual (``PulseLoCo._average``) and its ledger follows an adopted state's
bars (``Ledger.reconcile``).
A real group with a Byzantine peer: tests/test_loco_swarm.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pulseloco.errors import ConfigError, PayloadError
from pulseloco.loco import AveragingConfig, PulseLoCo, RoundConfig
from pulseloco.loco.averaging import AllReduceResult, SparseAverager, shard_bounds
from pulseloco.loco.ledger import Ledger, LedgerEntry
from pulseloco.loco.matchmaking import Group
from pulseloco.loco.robust import RepeatOutliers, clip_scale, clip_split, parse_bar, part_norm, to_float32
from pulseloco.loco.shard_owner import AGGREGATE_NAME, CONTRIBUTION_NAME, ShardOwner, ShardSum
from pulseloco.loco.validation import decode_sparse, encode_parts, encode_sparse

NUMEL = 6


class _Owner(ShardOwner):
    """The owner's summing, without a network (``_sum_contributions`` is pure CPU work)."""

    def __init__(self, peer_id: str, *, clip_to_median: bool = True, dispute_rounds: int = 8) -> None:
        self.numel, self.peer_id, self.max_norm_ratio = NUMEL, peer_id, 10.0
        self.clip_to_median, self.dispute_norm_ratio = clip_to_median, 4.0
        self.repeat_outliers = RepeatOutliers(dispute_rounds)

    def sum(self, parts: dict[str, tuple[list[int], list[float]]], round_index: int = 0) -> ShardSum:
        frames = {
            peer: encode_sparse(CONTRIBUTION_NAME, NUMEL, torch.tensor(i), torch.tensor(v), round_index=round_index)
            for peer, (i, v) in parts.items()
        }
        return self._sum_contributions(round_index, NUMEL, frames)


def _sum_of(summed: ShardSum) -> dict[int, float]:
    indices_K, sum_K = decode_sparse(summed.payload, AGGREGATE_NAME, NUMEL)
    return dict(zip(indices_K.tolist(), sum_K.tolist()))


# Norms 5, 3, 10 and 40 (d: a's direction sign-flipped at 8x): median 7.5, so c is scaled by 0.75 and d by 0.1875;
# d is under the outlier screen (10x the others' median, 5) but strikes (above 4x the median).
PARTS = {
    "a": ([0, 1], [3.0, 4.0]),
    "b": ([1], [3.0]),
    "c": ([3], [10.0]),
    "d": ([0, 1], [-24.0, -32.0]),
}


def test_parts_are_clipped_to_the_median_norm_and_the_bar_reported() -> None:
    summed = _Owner("a").sum(PARTS)
    assert summed.header["accepted"] == ["a", "b", "c", "d"]
    assert summed.header["clip_bar"] == 7.5 and summed.scales == (1.0, 1.0, 0.75, 0.1875)
    # every sender derives its own scale from the bar and its own part, to the owner's bit
    derived = tuple(clip_scale(part_norm(torch.tensor(values)), 7.5) for _, values in PARTS.values())
    assert derived == summed.scales
    assert summed.header["rejected"] == [] and summed.num_rejected == 0
    # 3 - 24 * 0.1875, 4 + 3 - 32 * 0.1875, 10 * 0.75: the sign-flipped part subtracts one median-sized vector
    assert _sum_of(summed) == {0: -1.5, 1: 1.0, 3: 7.5}
    assert summed.largest_norm_ratio == pytest.approx(40 / 7.5)
    # The screen alone lets the attack through whole, and it reverses the honest sum (3 + 4 + ... -> -21, -25).
    unclipped = _Owner("a", clip_to_median=False).sum(PARTS)
    assert _sum_of(unclipped) == {0: -21.0, 1: -25.0, 3: 10.0} and "clip_bar" not in unclipped.header


def test_without_a_majority_the_bar_is_the_owners_own_part_and_a_zero_bar_clips_nothing() -> None:
    pair = {"a": ([0, 1], [3.0, 4.0]), "d": ([0, 1], [-24.0, -32.0])}
    summed = _Owner("a").sum(pair)  # d is 8x a (under the 10x screen): clipped to a's norm, 1/8
    assert summed.scales == (1.0, 0.125) and summed.header["clip_bar"] == 5.0
    assert _sum_of(summed) == {0: 0.0, 1: 0.0}
    no_bar = _Owner("x").sum(pair)  # no part of its own: no bar
    assert no_bar.scales == (1.0, 1.0) and "clip_bar" not in no_bar.header
    lone = {"a": ([], []), "b": ([], []), "c": ([], []), "d": ([2], [5.0])}
    held = _Owner("a").sum(lone)  # median 0: a lone sender is not held
    assert held.scales == (1.0, 1.0, 1.0, 1.0) and "clip_bar" not in held.header


def test_the_part_norm_is_the_same_in_any_order_and_exact_where_it_can_be() -> None:
    """The owner and the sender must reach the same scale on any machine: the norm does not depend on the order
    of the values (a sum rounded once) and is exact where the true norm is an FP64 number."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=gen) * torch.logspace(-20, 20, 10_000)
    norm = part_norm(values)
    for _ in range(3):
        assert part_norm(values[torch.randperm(values.numel(), generator=gen)]) == norm
    assert part_norm(torch.tensor([3.0, 4.0])) == 5.0 and part_norm(torch.zeros(0)) == 0.0
    orders = [torch.randperm(values.numel(), generator=gen) for _ in range(8)]
    naive = torch.stack([values[order].double().square().sum() for order in orders])
    assert naive.unique().numel() > 1  # what a plain FP64 sum would give depends on the order
    assert clip_scale(5.0, None) == clip_scale(5.0, 0.0) == clip_scale(5.0, 5.0) == 1.0
    assert clip_scale(10.0, 7.5) == 0.75 and clip_scale(float("inf"), 7.5) == 0.0
    assert clip_scale(3.0, 1.0) == to_float32(1.0 / 3.0)


def test_clip_split_halves_add_up_to_the_values_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=gen) * torch.logspace(-40, 30, 4096)
    values = torch.cat([values, torch.tensor([0.0, -0.0, 1e-45, -3e-45, 3.0e38])])
    for scale in (1.0, 0.75, 0.5, 0.5000001, 0.49999997, 0.1875, 1 / 3, 1e-3, 1e-30, 0.0):
        scale = float(torch.tensor(scale, dtype=torch.float32))
        kept, clipped = clip_split(values, scale)
        assert torch.all((kept + clipped) == values)  # exactly (bitwise but for -0.0 + 0.0, which is +0.0)
        if scale >= 0.5:
            assert torch.equal(kept, values * torch.tensor(scale))
        # below 1/2 the returned part is rounded on the values' own grid: kept is off by up to an ulp of the value
        assert torch.all((kept - values.double() * scale).abs() <= values.abs().double() * 2.0**-23 + 1e-45)
    with pytest.raises(ValueError, match="scale"):
        clip_split(values, 0.1)  # not an FP32 number: the two sides could round it differently
    with pytest.raises(ValueError, match="scale"):
        clip_split(values, 1.5)


class _FakeMatchmaker:
    matchmaking_time = 1.0

    def form_group(self, round_index: int, expiration: float, digest: str) -> Group:
        return Group(round=round_index, members=("b", "me"), servers=("b", "me", "z"))


class _FakeAverager:
    """Answers ``all_reduce`` with a fixed verdict: shard 0 counted at 0.75, shard 1 at 0.3 (below 1/2: the other
    branch of clip_split), shard 2 not counted (its sum was not fetched)."""

    peer_id = "me"
    averaging_timeout = 1.0

    def expect_round(self, round_index: int) -> None:
        """The owner's window of rounds (``ShardOwner.expect_round``): nothing to move without a network."""

    def all_reduce(
        self, group: Group, indices_K: torch.Tensor, values_K: torch.Tensor, _: str, __: torch.Tensor | None = None
    ) -> AllReduceResult:
        bounds = shard_bounds(15, 3)
        returned_K = indices_K >= bounds[2][0]
        return AllReduceResult(
            group=group,
            indices_K=torch.zeros(0, dtype=torch.int64),
            average_K=torch.zeros(0),
            returned_K=returned_K,
            complete=False,
            live_peers=frozenset({"me"}),
            num_rejected=0,
            bytes_sent=0,
            bytes_received=0,
            accepted=(("b", "me"), ("b", "me"), None),
            bars=(0.75, to_float32(0.3), None),  # this peer's parts taken to have norm 1: scales 0.75 and 0.3
            own_scales=(0.75, to_float32(0.3), None),
            own_norms=(1.0, 1.0, 1.0),
            bounds=tuple(bounds),
            parts=tuple(encode_parts(indices_K, values_K, bounds, round_index=group.round)),
        )


def test_the_sender_keeps_exactly_what_was_clipped_and_follows_an_adopted_ledger() -> None:
    """sent-and-counted + residual == signal, bit for bit, after the owners' clipping; and again after the ledger
    of an adopted state says otherwise (shard 0 not counted, shard 2 counted at 1/2)."""
    torch.manual_seed(0)
    opt = PulseLoCo(torch.nn.Linear(4, 3), None, round_config=RoundConfig(selector="dense"))
    opt.averager, opt.matchmaker = _FakeAverager(), _FakeMatchmaker()  # type: ignore[assignment]
    opt.ledger = Ledger("me")
    signal_N = torch.randn(15) * 1e-2
    opt.residual_N.copy_(signal_N)
    result, _, _, values_K, _ = opt._average()
    assert result is not None and torch.equal(values_K, signal_N) and opt._num_clipped == 10

    def check(scales: list[float | None]) -> None:
        counted_N = torch.zeros(15)
        for (start, stop), scale in zip(shard_bounds(15, 3), scales):
            if scale is not None:
                counted_N[start:stop] = clip_split(signal_N[start:stop], scale)[0]
        assert torch.equal(counted_N + opt.residual_N, signal_N)

    check([0.75, float(torch.tensor(0.3)), None])
    pending = opt.ledger.pending[0]
    assert pending.counted == [True, True, False] and pending.scales == [0.75, float(torch.tensor(0.3)), 1.0]
    group = opt.ledger.entries[0].group
    bars = [1.0, to_float32(0.3), 0.5]  # at this peer's norms of 1: not counted, 0.3 and 0.5
    adopted = Ledger.parse({"0": {"group": group, "accepted": [["b"], ["b", "me"], ["me"]], "bars": bars}})
    assert adopted[0] == LedgerEntry(group, (("b",), ("b", "me"), ("me",)), tuple(bars))
    assert opt.ledger.reconcile(adopted, 1, opt.residual_N) == 10
    check([None, float(torch.tensor(0.3)), 0.5])
    assert opt.ledger.reconcile(adopted, 1, opt.residual_N) == 0  # idempotent


@pytest.mark.parametrize(
    ("bar", "message"),
    [
        (True, "not a number"),
        ("0.5", "not a number"),
        ([0.5], "not a number"),
        (-1.0, "finite number at least 0"),
        (float("nan"), "finite number at least 0"),
        (float("inf"), "finite number at least 0"),
    ],
)
def test_a_bad_clip_bar_is_refused_with_a_clear_error(bar: Any, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        parse_bar(bar)
    ledger = Ledger("me")
    entry = {"group": "g", "accepted": [["a", "b"]], "bars": [bar]}
    with pytest.raises(PayloadError, match=message):
        ledger.reconcile(Ledger.parse({"3": entry}), 4, torch.zeros(3))
    assert ledger.entries == {} and ledger.pending == {}


def test_a_ledger_with_per_contributor_scales_is_refused_with_the_fix() -> None:
    """A state from a release before the clip bar lists scales per contributor: refused, naming the fix, not
    read as counted whole."""
    with pytest.raises(PayloadError, match="same pulseloco release"):
        Ledger.parse({"3": {"group": "g", "accepted": [["a", "b"]], "scales": [[1.0, 0.5]]}})


def test_a_member_refuses_a_sum_with_a_bad_bar_and_applies_nothing_of_it() -> None:
    """The member side: a shard whose header carries a bad clip bar, or one that would scale the member's own
    counted part to nothing, is not applied (the sender's part of it goes back to its residual, as for a missing
    sum); the well-formed shard is."""
    member = object.__new__(SparseAverager)  # only the checks of _average_shards: no network
    member.peer_id, member.max_norm_ratio, member.disputed = "b", 10.0, set()
    group = Group(round=0, members=("a", "b", "c", "d"), servers=("a", "b"))
    good = _Owner("a").sum(PARTS)
    bad = _Owner("b").sum(PARTS)
    bounds = [(0, NUMEL), (NUMEL, 2 * NUMEL)]
    for bad_bar in (-2.0, "7.5", 1e-300):  # the last: b's part (norm 3) would count at a scale of 0
        bad.header["clip_bar"] = bad_bar
        results: list[tuple[dict[str, Any], bytes] | None] = [(good.header, good.payload), (bad.header, bad.payload)]
        got = member._average_shards(group, bounds, results, [3.0, 3.0], [b"", b""], [3.0, 3.0])
        indices, averages, accepted, bars, own_scales, _, _ = got
        assert accepted == [("a", "b", "c", "d"), None] and bars == [7.5, None] and own_scales == [1.0, None]
        assert len(indices) == 1 and indices[0].tolist() == [0, 1, 3]
        assert averages[0].tolist() == [-1.5 / 4, 1.0 / 4, 7.5 / 4]
    assert member.disputed == set()


def test_a_peer_striking_in_most_rounds_is_excluded_and_an_honest_one_is_not() -> None:
    outliers = RepeatOutliers(8)
    assert outliers.num_strikes == 5
    for r in range(4):
        assert outliers.record(r, {"x": "9x", "h": "4.1x" if r % 2 else None}) == {}
    newly = outliers.record(4, {"x": "9x", "h": None})
    assert list(newly) == ["x"] and "struck in 5 of its last 5 rounds" in newly["x"]
    for r in range(5, 200):  # strikes in every other round: never a majority
        outliers.record(r, {"x": None, "h": "4.1x" if r % 2 else None})
    assert outliers.excluded().keys() == {"x"} and outliers.exclusion("h") is None
    never = RepeatOutliers(0)
    for r in range(20):
        assert never.record(r, {"x": "9x"}) == {}
    assert never.excluded() == {}


def test_an_owner_excludes_a_repeat_outlier_and_never_an_honest_peer() -> None:
    """Fifty rounds of three honest parts in random directions with norms spread over a factor of two, and an
    attacker sending a's part sign-flipped at 8x: it strikes every round (clipped hard, or refused by the screen),
    so from round 5 on every part of it is refused as excluded; no honest part is ever refused."""
    owner = _Owner("a")
    gen = torch.Generator().manual_seed(1)
    for r in range(50):
        honest = {}
        for peer in ("a", "b", "c"):
            direction = torch.randn(3, generator=gen)
            honest[peer] = direction / direction.norm() * (1 + float(torch.rand(1, generator=gen)))
        parts = {peer: ([0, 1, 2], values.tolist()) for peer, values in honest.items()}
        summed = owner.sum({**parts, "d": ([0, 1, 2], (-8 * honest["a"]).tolist())}, round_index=r)
        assert set(summed.header["accepted"]) >= {"a", "b", "c"}
        assert (owner.repeat_outliers.exclusion("d") is not None) == (r >= 4)
        if r >= 5:
            assert "d" in summed.header["rejected"] and "d" not in summed.header["accepted"]
    assert owner.repeat_outliers.excluded().keys() == {"d"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dispute_norm_ratio": 1.0}, "dispute_norm_ratio"),
        ({"dispute_norm_ratio": float("inf")}, "dispute_norm_ratio"),
        ({"dispute_rounds": -1}, "dispute_rounds"),
        ({"dispute_rounds": 2.5}, "dispute_rounds"),
        ({"clip_to_median": "yes"}, "clip_to_median"),
    ],
)
def test_bad_robust_aggregation_settings_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        AveragingConfig(**kwargs)
